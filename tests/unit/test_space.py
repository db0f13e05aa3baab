"""The planner against exhaustive enumeration of the same space, under the same predictor."""

import pytest
from _plan_space import _splits, enumerate_plans, exhaustive_best

from hethub.search import PlannerConfig, make_plan
from hethub.spec.cluster import parse_cluster
from hethub.spec.model import ModelSpec

MODEL = ModelSpec(name="m", num_layers=6, hidden_size=1024, num_heads=8, num_kv_heads=4, ffn_hidden_size=2816,
                  vocab_size=32000, max_seq_len=4096)


def _cluster(*, fast_mem: int, slow_mem: int, slow_flops: float, fast_per_node: int = 4, slow_nodes: int = 1):
    # Memory is tight on purpose: no device holds the whole model, so plans must pipeline. The budgets
    # are tensor bytes only: no framework context, collective buffers or fragmentation on top.
    bare = {"context_bytes": 0, "comm_buffer_bytes": 0, "fragmentation": 0}
    return parse_cluster({
        "name": "fast-slow",
        "kinds": {"fast": {"base": "a100-40gb", "mem_bytes": fast_mem, **bare},
                  "slow": {"base": "a100-40gb", "mem_bytes": slow_mem, "peak_flops": slow_flops, **bare}},
        "group": [{"kind": "fast", "nodes": 1, "devices_per_node": fast_per_node},
                  {"kind": "slow", "nodes": slow_nodes, "devices_per_node": 2}],
        "network": {"inter_node_bw_bytes_per_s": 25e9, "cross_kind_bw_bytes_per_s": 25e9},
    }, where="test")


CASES = [
    # 4 fast + 2 slow (half speed), 6 layers, micro-batch 2 or 4.
    (dict(fast_mem=3_000_000_000, slow_mem=1_500_000_000, slow_flops=156e12),
     dict(global_batch=8, seq_len=2048, tp_degrees=(1,), micro_batch_sizes=(2, 4))),
    (dict(fast_mem=3_000_000_000, slow_mem=1_500_000_000, slow_flops=100e12),
     dict(global_batch=8, seq_len=2048, tp_degrees=(1,), micro_batch_sizes=(2, 4))),
    # 2 fast + 2 slow with TP 1 or 2; the slow kind is nearly as fast but small.
    (dict(fast_mem=5_000_000_000, slow_mem=1_600_000_000, slow_flops=250e12, fast_per_node=2),
     dict(global_batch=8, seq_len=2048, tp_degrees=(1, 2), micro_batch_sizes=(2, 4))),
]


@pytest.mark.parametrize(("cluster_args", "config_args"), [
    pytest.param(*CASES[0], marks=pytest.mark.slow),  # ~4,000 plans each: ~20 s apiece here
    pytest.param(*CASES[1], marks=pytest.mark.slow),
    CASES[2],
])
def test_planner_matches_exhaustive_optimum(cluster_args, config_args):
    cluster = _cluster(**cluster_args)
    # The enumerated space has no context parallelism (tests/unit/_plan_space.py).
    cfg = PlannerConfig(**config_args, context_parallel=False)
    _, best, n = exhaustive_best(cluster=cluster, model=MODEL, config=cfg)
    assert n > 100  # the space is really enumerated
    r = make_plan(cluster=cluster, model=MODEL, config=cfg)
    # The same optimum (README: "equal optimum"), up to float rounding, not within a slack: worse
    # would mean the planner misses the best plan, better that the enumeration misses plans.
    assert r.prediction.step_time_s == pytest.approx(best.step_time_s, rel=1e-9)


def test_layer_splits_are_all_compositions():
    assert sorted(_splits(3, 1)) == [(3,)]
    assert sorted(_splits(2, 2)) == [(0, 2), (1, 1), (2, 0)]
    # Middle stages hold at least one layer, edge stages may hold none.
    three = set(_splits(3, 3))
    assert (0, 3, 0) in three and (1, 1, 1) in three and (3, 0, 0) not in three
    assert len(three) == 6


def test_enumeration_refuses_large_problems():
    big = parse_cluster({"name": "big", "group": [{"kind": "a100-40gb", "nodes": 2, "devices_per_node": 8}]},
                        where="test")
    with pytest.raises(ValueError, match="exhaustive"):
        next(enumerate_plans(cluster=big, model=MODEL, config=PlannerConfig(global_batch=8, seq_len=128)))
