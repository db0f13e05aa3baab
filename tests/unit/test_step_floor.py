"""The predictor's step floor (predictor.step_floor_s) and the two screens built on it: the polish
skips moves whose floor cannot beat the current step, and the planner's scoring skips finalists
whose floor cannot enter the fastest few. Both are exact only if the floor is below the predicted
step of every plan, under every schedule and both transfer modes; and the screened scoring must
keep the same fastest few.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from hethub.predict.predictor import predict, step_floor_s
from hethub.search import PlannerConfig, make_plan
from hethub.search.planner import _score
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


def _plans(schedule: str) -> list:
    """Every plan the planner predicts around its best few: the alternatives and all their polish moves."""
    cfg = PlannerConfig(global_batch=64, seq_len=1024, schedule=schedule, top_k=4, polish=False)
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
    full = _score(plans, None)
    for keep in (1, 3):
        screened = _score(plans, None, keep=keep)
        assert len(screened) < len(full)  # some were screened out
        assert [(id(p), pr.step_time_s) for p, pr in screened[:keep]] == [(id(p), pr.step_time_s)
                                                                          for p, pr in full[:keep]]
