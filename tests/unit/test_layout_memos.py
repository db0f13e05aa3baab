"""The rank layout's shortcuts give the plain path's answers (``hethub.memo.reference_path``): stage
places kept by the plan's pipelines (plans of other training settings, models and sequence lengths
share them), unit holders kept by the places and the model's unit rules, and ``single_holder_units``
answering a plan of several replicas without walking its holders."""

from __future__ import annotations

import dataclasses
import random

from test_prediction_memos import _plans

from conftest import tiny_model
from hethub.layout import single_holder_units, stage_places, unit_holders
from hethub.memo import clear_caches, reference_path
from hethub.plan import Plan


def _one_replica(plan: Plan) -> Plan:
    """``plan``'s first pipeline alone."""
    p = plan.pipelines[0]
    return dataclasses.replace(plan, pipelines=(p,), global_batch=p.num_samples,
                               optimizer_sharding="none").validate()


def _variants(plans: list[Plan]) -> list[Plan]:
    """Each plan, then plans on the same pipelines (objects) with other settings and models whose unit
    rules differ (tied embeddings, GPT's learned positions), and each plan's first replica alone."""
    rng = random.Random(5)
    out = []
    for plan in plans:
        tied = dataclasses.replace(tiny_model(), tied_embeddings=True, arch=rng.choice(["llama", "gpt"]))
        gpt = dataclasses.replace(tiny_model(), arch="gpt")
        out += [plan, plan.with_runtime("megatron"), dataclasses.replace(plan, precision="fp32"),
                dataclasses.replace(plan, model=tied), dataclasses.replace(plan, model=gpt),
                _one_replica(plan), _one_replica(dataclasses.replace(plan, model=tied))]
    return out


def _answers(plans: list[Plan]) -> list[tuple]:
    return [(stage_places(p), unit_holders(p), unit_holders(p, stage_places(p)), single_holder_units(p))
            for p in plans]


def test_places_holders_and_lone_units_equal_the_plain_path() -> None:
    plans = _variants(_plans(31, 8))
    assert any(a[3] for a in _answers(plans)) and any(not a[3] for a in _answers(plans))
    with reference_path():
        ref = _answers(plans)
    clear_caches()
    assert _answers(plans) == ref
    assert _answers(plans) == ref  # from the memos the first pass filled
    got = _answers(plans[:1])[0][1]
    got.clear()  # a caller's change must not reach the next reader
    assert _answers(plans[:1]) == ref[:1]
