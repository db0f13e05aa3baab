"""ZB-H1 in the schedules registry: op order invariants, in-flight rule, simulation and closed form."""

from __future__ import annotations

import random

import pytest

from hethub.schedules import get_schedule
from hethub.schedules.simulate import simulate_pipeline, simulate_pipeline_time

ZB = get_schedule("zb-h1")


@pytest.mark.parametrize(("p", "m"), [(1, 1), (2, 1), (4, 2), (4, 4), (4, 8), (6, 13)])
def test_every_op_once_in_dependency_order_and_in_flight_is_the_counted_peak(p: int, m: int) -> None:
    for s in range(p):
        ops = ZB.ops(stage=s, num_stages=p, num_micro_batches=m)
        assert sorted((o.kind, o.micro_batch) for o in ops) == sorted((k, i) for k in "FBW" for i in range(m))
        pos = {(o.kind, o.micro_batch): n for n, o in enumerate(ops)}
        assert all(pos[("F", i)] < pos[("B", i)] < pos[("W", i)] for i in range(m))
        held = peak = 0
        for o in ops:
            held += {"F": 1, "B": 0, "W": -1}[o.kind]
            peak = max(peak, held)
        assert peak == ZB.in_flight(stage=s, num_stages=p, num_micro_batches=m) == min(m, p)


def test_defers_w_by_the_stage_index() -> None:
    ops = [(o.kind, o.micro_batch) for o in ZB.ops(stage=2, num_stages=4, num_micro_batches=6)]
    assert ops[:6] == [("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1), ("F", 3)]
    assert ops[6:9] == [("B", 2), ("W", 0), ("F", 4)]
    assert ops[-2:] == [("W", 4), ("W", 5)]


def test_the_order_is_the_docstrings_rule_on_every_shape() -> None:
    # ZeroBubbleH1.order lays its runs out by slices; the rule as the class states it, op by op, on every
    # stage of up to 24 stages and 60 micro-batches (warm-ups longer and shorter than the batch, deferrals
    # past it).
    def rule(s: int, p: int, m: int) -> list[tuple[str, int]]:
        w = min(p - s - 1, m)
        out = [("F", i) for i in range(w)]
        for j in range(m):
            out += [("F", w + j)] if j < m - w else []
            out += [("B", j)] + ([("W", j - s)] if j >= s else [])
        return out + [("W", i) for i in range(max(0, m - s), m)]
    sched = get_schedule("zb-h1")
    for p in range(1, 25):
        for m in range(1, 61):
            for s in range(p):
                got = [(o.kind, o.micro_batch) for o in sched.ops(stage=s, num_stages=p, num_micro_batches=m)]
                assert got == rule(s, p, m), (p, m, s)


def test_equal_stages_reach_the_papers_bubble() -> None:
    # F = B = W = 1: 1F1B's bubble is (p-1)(F+B+W) = 9, ZB-H1's (p-1)(F+B-W) = 3 (Qi et al., Table 2).
    kw = dict(fwd_s=[1.0] * 4, bwd_s=[2.0] * 4, p2p_s=[0.0] * 3, num_micro_batches=8)
    assert max(simulate_pipeline_time(**kw, schedule="1f1b")) == 33.0
    assert max(simulate_pipeline_time(**kw, schedule="zb-h1")) == 27.0
    assert ZB.step_time_s(fwd_s=kw["fwd_s"], bwd_s=kw["bwd_s"], p2p_s=kw["p2p_s"], num_micro_batches=8) == 27.0
    stages = simulate_pipeline(**kw, schedule="zb-h1")
    assert [op.kind for op in stages[3].ops[:4]] == ["F", "B", "F", "B"]
    assert {op.end_s - op.start_s for op in stages[0].ops if op.kind == "W"} == {1.0}


def test_closed_form_tracks_the_simulation_on_unequal_stages() -> None:
    rng = random.Random(3)
    errs = []
    for _ in range(100):
        p = rng.randint(2, 8)
        m = rng.randint(p, 3 * p)
        f = [rng.uniform(0.5, 2.0) for _ in range(p)]
        b = [2 * x * rng.uniform(0.8, 1.2) for x in f]
        c = [rng.uniform(0.0, 0.2) for _ in range(p - 1)]
        sim = max(simulate_pipeline_time(fwd_s=f, bwd_s=b, p2p_s=c, num_micro_batches=m, schedule="zb-h1"))
        one = max(simulate_pipeline_time(fwd_s=f, bwd_s=b, p2p_s=c, num_micro_batches=m, schedule="1f1b"))
        assert sim <= one + 1e-9, "ZB-H1 never loses to 1F1B at equal per-op times"
        errs.append(abs(ZB.step_time_s(fwd_s=f, bwd_s=b, p2p_s=c, num_micro_batches=m) - sim) / sim)
    assert sorted(errs)[len(errs) // 2] < 0.05 and max(errs) < 0.15


def test_planner_picks_zero_bubble_where_it_predicts_a_gain() -> None:
    from pathlib import Path

    from hethub.search.config import PlannerConfig
    from hethub.search.planner import make_plan
    from hethub.spec.cluster import load_cluster
    from hethub.spec.model import get_model

    cluster = load_cluster(Path(__file__).resolve().parents[2] / "examples" / "clusters" / "a100-v100-32.toml")
    model = get_model("llama-3-8b")
    auto = make_plan(cluster=cluster, model=model, config=PlannerConfig(global_batch=64, seq_len=2048, schedule="auto"))
    forced = make_plan(cluster=cluster, model=model, config=PlannerConfig(global_batch=64, seq_len=2048,
                                                                          schedule="1f1b"))
    assert auto.plan.schedule == "zb-h1"
    assert auto.prediction.fits_memory
    assert auto.prediction.step_time_s < forced.prediction.step_time_s
    assert auto.notes[0].startswith("schedule zb-h1 chosen")
    # Every schedule open is named: interleaving was tried on the best 1F1B plans and paid nowhere.
    assert "1f1b" in auto.notes[0] and auto.notes[0].endswith("interleaved: no chunking of the best 1F1B plans pays")
