"""``zero23_stage_bytes`` finds a bucket holder's bytes once per (TP degree, weight bytes) and a stage's
gather peak once per gathered shape: exactly the plain walk of every holder and stage
(``hethub.memo.reference_path``), on random plans and plans of replicas under ZeRO-2 and ZeRO-3, with
kinds of other precisions and bucket sizes that cut the buckets."""

from __future__ import annotations

import dataclasses
import random

from test_plan_validate_shapes import _replicas
from test_prediction_memos import _plans

from hethub.errors import PlanError
from hethub.memo import clear_caches, reference_path
from hethub.plan import Plan
from hethub.predict.zero23_bytes import zero23_stage_bytes


def _sharded(plans: list[Plan], rng: random.Random) -> list[Plan]:
    """Each plan of several pipelines, at one micro-batch count, under ZeRO-2 and ZeRO-3, some with one
    kind in fp32 (mixed precisions among a bucket's holders) or the whole plan in fp32; those ZeRO-2/3
    refuses left out."""
    out = []
    for plan in plans:
        if len(plan.pipelines) < 2:
            continue
        m = max(p.num_micro_batches for p in plan.pipelines)  # ZeRO-2/3 runs one count on every pipeline
        pipes = tuple(dataclasses.replace(p, num_micro_batches=m) for p in plan.pipelines)
        plan = dataclasses.replace(plan, pipelines=pipes, global_batch=sum(p.num_samples for p in pipes))
        for sharding in ("zero2", "zero3"):
            kinds = rng.choice([{}, {"slow": {"precision": "fp32"}}, {"fast": {"precision": "fp32"}}])
            precision = "fp32" if rng.random() < 0.2 else plan.precision
            try:
                out.append(dataclasses.replace(plan, optimizer_sharding=sharding, kind_settings=kinds,
                                               precision=precision).validate())
            except PlanError:
                continue
    return out


def test_held_bytes_by_shape_equal_the_plain_walk() -> None:
    rng = random.Random(8)
    plans = _sharded(_plans(61, 12) + [_replicas(rng) for _ in range(16)], rng)
    assert len(plans) > 20 and any(p.zero_stage == 3 for p in plans) and any(p.kind_settings for p in plans)
    sizes = [rng.choice([500, 20_000, 10**8]) for _ in plans]
    with reference_path():
        ref = [zero23_stage_bytes(p, bucket_elems=n) for p, n in zip(plans, sizes, strict=True)]
    assert any(g > 0 for r in ref for _, g, _ in r)  # some stages gather
    clear_caches()
    assert [zero23_stage_bytes(p, bucket_elems=n) for p, n in zip(plans, sizes, strict=True)] == ref
