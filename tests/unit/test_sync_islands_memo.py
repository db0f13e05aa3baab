"""A sync group's islands and bridge (``sync_rules.holder_islands``) kept by the cluster and its holders'
first devices and kinds give the plain path's group prices (``hethub.memo.reference_path``), on plans
of single-stage replicas across two vendor islands that repeat one sequence of kinds on other devices
(holders on one node or several: other ring and bridge links)."""

from __future__ import annotations

import dataclasses
import random

from test_prediction_memos import BRIDGED, CLUSTER

from conftest import tiny_model
from hethub.memo import clear_caches, reference_path
from hethub.plan import Pipeline, Plan, Stage
from hethub.predict.predictor import predict
from hethub.predict.sync import sync_groups


def _plans(rng: random.Random) -> list[Plan]:
    """For random sequences of kinds, plans of one single-stage pipeline per kind on random devices of it,
    each also on the cluster with both kinds in one island."""
    free = {"fast": list(range(8)), "slow": list(range(8, 16))}
    out = []
    for _ in range(10):
        kinds = [rng.choice(["fast", "slow"]) for _ in range(rng.randint(2, 5))]
        for _ in range(4):
            picks = {k: rng.sample(free[k], kinds.count(k)) for k in free}
            stages = [Stage(k, (picks[k].pop(),), (0, 6), embedding=True, head=True) for k in kinds]
            pipes = tuple(Pipeline(1, 2, (s,)) for s in stages)
            plan = Plan(model=tiny_model(), cluster=BRIDGED, global_batch=2 * len(pipes), seq_len=32,
                        pipelines=pipes).validate()
            out += [plan, dataclasses.replace(plan, cluster=CLUSTER).validate()]  # the kinds in one island
    return out


def _answers(plans: list[Plan]) -> list[tuple]:
    return [(sync_groups(p), predict(p).step_time_s) for p in plans]


def test_islands_by_first_devices_equal_the_plain_path() -> None:
    plans = _plans(random.Random(4))
    with reference_path():
        ref = _answers(plans)
    assert len({g.time_s for groups, _ in ref for g in groups}) > 5
    clear_caches()
    assert _answers(plans) == ref
    assert _answers(plans) == ref
