"""The predictor's step floor (predictor.step_floor_s, plus the exact sync tail, sync_tail_s) and the
two screens built on it (predictor.floor_reaches): the polish
skips moves whose floor cannot beat the current step, and the planner's scoring skips finalists
whose floor cannot enter the fastest few. Both are exact only if the floor is below the predicted
step of every plan, under every schedule and both transfer modes; and the screened scoring must
keep the same fastest few.
"""

from __future__ import annotations

import functools
from dataclasses import replace

import pytest

from hethub.predict.plan_costs import PlanCosts
from hethub.predict.predictor import floor_reaches, predict, step_floor_s, sync_tail_s
from hethub.predict.scoring import Firsts, Screen, score_plans
from hethub.search import PlannerConfig, make_plan
from hethub.search.polish import _apply, _moves
from hethub.spec.cluster import parse_cluster
from hethub.spec.model import ModelSpec

NETWORK = {"inter_node_bw_bytes_per_s": 25e9, "inter_node_latency_s": 10e-6,
           "cross_kind_bw_bytes_per_s": 12.5e9, "cross_kind_latency_s": 40e-6}
MODEL = ModelSpec(name="m8x4k", num_layers=8, hidden_size=4096, num_heads=32, num_kv_heads=32, ffn_hidden_size=11008,
                  vocab_size=32000, max_seq_len=4096)
CLUSTER = parse_cluster({"name": "floor-24", "network": NETWORK, "group": [
    {"kind": "a100-80gb", "nodes": 1, "devices_per_node": 8},
    {"kind": "v100-16gb", "nodes": 2, "devices_per_node": 8}]}, where="test")


@functools.cache  # one search per schedule for the whole module (plans are frozen)
def _plans(schedule: str) -> list:
    """Every plan the planner predicts around its best few: the alternatives and all their polish moves."""
    # Six alternatives: with links at their achievable rates the best plans are shallow pipelines
    # (TP 1-2), which have few polish moves each.
    cfg = PlannerConfig(global_batch=64, seq_len=1024, schedule=schedule, top_k=6, polish=False)
    out = []
    for plan, _ in make_plan(cluster=CLUSTER, model=MODEL, config=cfg).alternatives:
        out.append(plan)
        out += [c for mv in _moves(plan) if (c := _apply(plan, mv, allow_recompute=True, headroom=0.1)) is not None]
    return out


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "zb-h1", "interleaved"])
def test_step_floor_is_below_every_predicted_step_and_not_vacuous(schedule):
    plans = _plans(schedule)
    assert len(plans) >= 10
    ratios = []
    for plan in plans:
        floor, step = step_floor_s(plan), predict(plan).step_time_s
        assert floor <= step, (floor, step)
        ratios.append(floor / step)
        # Sends that hold their stage only add to the simulation's times.
        assert floor <= predict(replace(plan, p2p="blocking")).step_time_s
    assert max(ratios) > 0.5  # it bounds something: each stage's own work is most of a pipeline's step


def test_screened_scoring_keeps_the_same_fastest_plans():
    plans = _plans("1f1b")
    plans = plans + plans[::-1]  # the fastest again late, after slow ones
    full = score_plans(plans, None)
    for keep in (1, 3):
        screened = score_plans(plans, None, keep=keep)
        assert len(screened) < len(full)  # some were screened out
        assert [(id(p), pr.step_time_s) for p, pr in screened[:keep]] == [(id(p), pr.step_time_s)
                                                                          for p, pr in full[:keep]]


def _shape(plan) -> int:
    return len(plan.pipelines)


def _shape_firsts(scored: list, n: int) -> list[float]:
    """The best step of each of the first ``n`` distinct shapes."""
    out: dict[int, float] = {}
    for p, pr in sorted(scored, key=lambda x: x[1].step_time_s):
        out.setdefault(_shape(p), pr.step_time_s)
    return sorted(out.values())[:n]


def test_screened_scoring_keeps_each_readers_firsts():
    """Calls sharing their fastest (``steps``) each keep their own firsts too (``Firsts``): their best
    plan, and the best plan of each of the first two distinct shapes (here: pipeline counts) over both
    calls, are those of the unscreened scoring, even where the fastest shape's plans come first and
    set a low bar."""
    order = [p for p, _ in score_plans(_plans("1f1b"), None)]
    assert len({_shape(p) for p in order}) >= 2
    fastest = [p for p in order if _shape(p) == _shape(order[0])]
    rest = [p for p in order if _shape(p) != _shape(order[0])]
    calls = [fastest + rest[::2], rest[1::2]]
    steps, shapes, got = [], Firsts(2, _shape), []
    for call in calls:
        got.append(score_plans(call, None, screen=Screen(1, None, steps, (Firsts(1), shapes))))
    full = [score_plans(call, None) for call in calls]
    assert sum(map(len, full)) > sum(map(len, got))  # some were screened out
    for screened, whole in zip(got, full, strict=True):
        assert screened[0][1].step_time_s == whole[0][1].step_time_s  # each call's best
    assert _shape_firsts([x for g in got for x in g], 2) == _shape_firsts([x for w in full for x in w], 2)
    assert min(pr.step_time_s for g in got for _, pr in g) == min(pr.step_time_s for w in full for _, pr in w)


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_sync_tail_is_exact_after_the_last_finish(schedule):
    """The loss all-reduce is a barrier, so the step is the last pipeline finish plus the tail, whatever
    the finishes; the floor plus the tail is then still below the step."""
    for plan in _plans(schedule):
        pred = predict(plan)
        tail = sync_tail_s(plan)
        assert tail > 0
        assert max(pred.pipeline_times_s) + tail == pytest.approx(pred.step_time_s, rel=1e-9, abs=0)
        floor = step_floor_s(plan)
        assert floor + tail <= pred.step_time_s
        costs = PlanCosts(plan, None)
        assert floor_reaches(plan, floor + tail * 0.5, costs=costs)  # reached only with the tail
        assert not floor_reaches(plan, pred.step_time_s * (1 + 1e-9), costs=costs)


def test_sync_tail_of_a_sharded_plan_is_a_floor():
    plan = replace(_plans("1f1b")[0], optimizer_sharding="zero1")
    assert 0.0 == sync_tail_s(plan) <= predict(plan).step_time_s
