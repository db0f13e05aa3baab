"""``pipeline_floors.fits_some_mode_kept`` answers as the plain ``fits_some_mode`` (the reference path,
hethub/memo.py) on plans of pipelines that each run one TP degree, drawn from a few such pipelines
with their micro-batch counts (so a pipeline's proof that it cannot fit is reused by later plans holding
it), under 1F1B and ZB-H1, unsharded and ZeRO-1, at headrooms around the stages' peaks; and it declines
(no keys) for plans it cannot speak for."""

from __future__ import annotations

import itertools
import random
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from test_stage_fits_fastpath import _tight

from conftest import small_cluster, tiny_model
from hethub.cli import build_parser, plan_config
from hethub.memo import reference_path
from hethub.plan import Pipeline, Plan, Stage
from hethub.predict.pipeline_floors import fits_some_mode_kept, floor_keys
from hethub.predict.stage_links import LinkBook
from hethub.predict.stage_modes import fits_some_mode
from hethub.search.combine import Estimate
from hethub.search.hetero import plan_key, search
from hethub.search.planner import SHARD_HOLDERS_OPTIMISM
from hethub.search.templates import Searcher
from hethub.search.variants import enumeration_variants, variants_of
from hethub.spec.model import get_model

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import planner_scale

# Pipelines of one TP degree each (two of TP 2, two of TP 1), on devices of their own.
PIPES = [
    (Stage("fast", (0, 1), (0, 3), embedding=True), Stage("slow", (8, 9), (3, 6), head=True)),
    (Stage("fast", (2,), (0, 2), embedding=True), Stage("fast", (3,), (2, 4)), Stage("slow", (10,), (4, 6), head=True)),
    (Stage("fast", (4, 5), (0, 2), embedding=True), Stage("slow", (12, 13), (2, 6), head=True)),
    (Stage("fast", (6,), (0, 4), embedding=True), Stage("slow", (11,), (4, 6), head=True)),
]


def _plan(picks: list[tuple[int, int]], *, schedule: str, sharding: str) -> Plan:
    pipes = tuple(Pipeline(16, m, PIPES[i]) for i, m in picks)  # activations that weigh: in flight matters
    return Plan(model=tiny_model(), cluster=small_cluster(fast=8, slow=8, per_node=4), seq_len=64,
                global_batch=sum(p.num_samples for p in pipes), pipelines=pipes, schedule=schedule,
                optimizer_sharding=sharding).validate()


def test_kept_pipeline_proofs_answer_as_the_plain_rule() -> None:
    rng = random.Random(5)
    draws = []
    for _ in range(40):
        chosen = rng.sample(range(len(PIPES)), rng.randint(2, 4))
        if len({len(PIPES[i][0].devices) for i in chosen}) == 2:
            draws.append([(i, rng.choice((1, 2, 4))) for i in chosen])
    decided = 0
    for schedule, sharding in itertools.product(("1f1b", "zb-h1"), ("none", "zero1")):
        plans = [_plan(d, schedule=schedule, sharding=sharding) for d in draws]
        with reference_path():
            # A sweep across the stages' peaks (free memory from below the smallest to above the largest).
            edges = [1 - h for p in plans[:4] for h in _tight(p)]
            lo, hi = min(edges) / 2, max(edges) * 2
            headrooms = [1 - lo * (hi / lo) ** (i / 23) for i in range(24)]
            want = [[fits_some_mode(p, mem_headroom=h) for p in plans] for h in headrooms]
        for h, answers in zip(headrooms, want, strict=True):
            kept: dict[tuple, bool] = {}  # one job, schedule, sharding and headroom: one memo, as a Searcher's
            got = []
            for p in plans:
                keys = floor_keys(p.pipelines, schedule=p.schedule, zero_stage=p.zero_stage)
                decided += keys is not None and any(kept.get(k) for k in keys)
                got.append(fits_some_mode_kept(p, kept, allow_recompute=True, mem_headroom=h, allow_sp=True))
            assert got == answers, (schedule, sharding, h)
        assert any(not a for a in itertools.chain(*want)) and any(itertools.chain(*want))
    assert decided  # some plans were answered by a pipeline's kept proof alone


def test_plans_it_cannot_speak_for_have_no_keys() -> None:
    plan = _plan([(0, 2), (1, 2)], schedule="1f1b", sharding="zero1")
    assert floor_keys(plan.pipelines, schedule=plan.schedule, zero_stage=plan.zero_stage) is not None
    one = _plan([(0, 2), (2, 2)], schedule="1f1b", sharding="zero1")
    assert floor_keys(one.pipelines, schedule="1f1b", zero_stage=1) is None  # one TP degree
    two = replace(plan.pipelines[0], stages=(PIPES[0][0], replace(PIPES[1][2], layers=(3, 6))))
    mixed = replace(plan, pipelines=(two, plan.pipelines[1]))
    assert floor_keys(mixed.pipelines, schedule="1f1b", zero_stage=1) is None  # a pipeline of two TP degrees
    assert floor_keys(plan.pipelines, schedule="1f1b", zero_stage=2) is None
    with reference_path():
        assert floor_keys(plan.pipelines, schedule=plan.schedule, zero_stage=plan.zero_stage) is None


def test_a_searchs_fit_checks_answer_as_the_plain_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    # bench's 512 devices (three kinds of their own TP degrees, llama-2-70b): the 1F1B enumeration's
    # Searcher.fits answers, most of those that do not fit from a pipeline's kept proof without laying the
    # candidate out, equal a fresh searcher's on the reference path, candidate by candidate.
    cluster, model, global_batch, seq_len = planner_scale.case(512)
    config = plan_config(build_parser().parse_args(["plan", "--cluster", cluster.name, "--model", model,
                                                    "--global-batch", str(global_batch), "--seq-len", str(seq_len)]))

    def searcher() -> Searcher:
        variants, shardings = variants_of(config)
        variant = next(v for v in enumeration_variants(variants, shardings) if v.schedule == "1f1b")
        return variant.searcher(config, cluster=cluster, model=get_model(model), profiles=None,
                                links=LinkBook(cluster, runtime=config.runtime),
                                holders=SHARD_HOLDERS_OPTIMISM * cluster.num_devices)

    s, asked = searcher(), []
    fits = s.fits

    def recorded(est: Estimate) -> bool:
        asked.append((est, fits(est)))
        return asked[-1][1]

    monkeypatch.setattr(s, "fits", recorded)
    search(s, first=48)
    refused = {plan_key(est) for est, ok in asked if not ok}
    assert len(refused) > 2 * sum(s._hopeless.values())  # most by a kept proof
    with reference_path():
        plain = searcher()
        assert [plain.fits(est) for est, _ in asked] == [ok for _, ok in asked]
