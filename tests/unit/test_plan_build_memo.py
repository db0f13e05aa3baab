"""``layout_assemble.build_plan`` keeps its plans by all they are built from: random candidates, each
asked again as an equal copy and under other job settings, give exactly the plain path's plans
(``hethub.memo.reference_path``), placed or not, validated or not; a candidate that does not fit the
cluster is refused each time."""

from __future__ import annotations

import dataclasses
import random

from test_prediction_memos import BRIDGED, CLUSTER

from conftest import tiny_model
from hethub.errors import InfeasibleError, PlanError
from hethub.layout_assemble import build_plan
from hethub.memo import clear_caches, reference_path
from hethub.plan import Recompute
from hethub.search.combine import Estimate, Group
from hethub.search.split import PipeCost, Slot


def _estimate(rng: random.Random) -> Estimate:
    """One or two groups of random templates (kinds, TP 1 or 2, a layer split of the tiny model's 6,
    modes, SP) with one or two pipelines each and random micro-batch counts."""
    groups, counts = [], []
    for _ in range(rng.randint(1, 2)):
        n = rng.randint(1, 3)
        slots = tuple(Slot(rng.choice(["fast", "slow"]), rng.choice([1, 2])) for _ in range(n))
        cuts = sorted(rng.sample(range(1, 6), n - 1))
        layers = tuple(b - a for a, b in zip([0, *cuts], [*cuts, 6], strict=True))
        pipe = PipeCost(slots=slots, mbs=rng.choice([1, 2]), layers=layers,
                        recompute=tuple(rng.choice(list(Recompute)) for _ in range(n)), fwd_s=(1.0,) * n,
                        bwd_s=(1.0,) * n, update_s=(0.0,) * n, p2p_s=(0.0,) * (n - 1), params=(1.0,) * n,
                        schedule="1f1b", sp=tuple(sl.tp == 2 and rng.random() < 0.5 for sl in slots))
        c = rng.randint(1, 2)
        groups.append(Group(pipe, c))
        counts.append(tuple(rng.randint(1, 4) for _ in range(c)))
    return Estimate(groups=tuple(groups), micro_batches=tuple(counts), step_time_s=rng.random())


def _calls(seed: int) -> list[dict]:
    """Each candidate's build, then again with an equal copy of it and with one setting changed."""
    rng = random.Random(seed)
    out = []
    for _ in range(40):
        est = _estimate(rng)
        samples = sum(sum(m) * g.pipe.mbs for g, m in zip(est.groups, est.micro_batches, strict=True))
        kw = dict(cluster=CLUSTER, model=tiny_model(), est=est, global_batch=samples, seq_len=32, schedule="1f1b",
                  precision="bf16-mixed", strategy="hethub", validate=rng.random() < 0.7, place=rng.random() < 0.8)
        copy = dataclasses.replace(est, groups=tuple(dataclasses.replace(g) for g in est.groups), step_time_s=0.0)
        out += [kw, {**kw, "est": copy}, {**kw, "global_batch": samples + 1}, {**kw, "seq_len": 64},
                {**kw, "precision": "fp32"}, {**kw, "strategy": "homogeneous"}, {**kw, "validate": not kw["validate"]},
                {**kw, "place": not kw["place"]}, {**kw, "cluster": BRIDGED},
                {**kw, "model": dataclasses.replace(tiny_model(), name="u")},
                {**kw, "est": dataclasses.replace(est, micro_batches=tuple(m[::-1] for m in est.micro_batches))},
                {**kw, "est": dataclasses.replace(est, groups=tuple(dataclasses.replace(g, pipe=dataclasses.replace(
                    g.pipe, layers=g.pipe.layers[::-1], recompute=(Recompute.FULL,) * len(g.pipe.layers)))
                    for g in est.groups))}]
    return out


def _answers(calls: list[dict]) -> list[object]:
    out: list[object] = []
    for kw in calls:
        try:
            out.append(build_plan(**kw))
        except (InfeasibleError, PlanError) as e:
            out.append(repr(e))
    return out


def test_kept_plans_equal_the_plain_path() -> None:
    calls = _calls(3)
    with reference_path():
        ref = _answers(calls)
    assert sum(isinstance(r, str) for r in ref) > 5 and sum(not isinstance(r, str) for r in ref) > 150
    clear_caches()
    assert _answers(calls) == ref
    assert _answers(calls) == ref  # from the memo the first pass filled
