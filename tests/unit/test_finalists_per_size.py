"""Allowing more micro-batch sizes never gives a worse plan than allowing one (issue 17 item 3).

The closed form ranks candidates of different sizes with errors of their own, so the overall best
few finalists can all be of one size while another size's runner-up predicts faster. The search
keeps the best finalists of every size besides the overall ones (hetero.Results, per_size), so the
predictor decides between sizes; the smallest size is searched first, so its finalists are exactly
those of a search of that size alone (the winner in both cases here). Both cases are instances of
tests/unit/test_reference_search.py (seeds 7 and 74) where, without per-size places, all sizes
planned below size 1 alone until the rings of holders that share one node were priced on that
node's link (predict/stage_links.py); the places themselves are checked on made-up candidates below.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from hethub.search import PlannerConfig, make_plan
from hethub.search.combine import Estimate, Group
from hethub.search.hetero import Results
from hethub.search.split import PipeCost, Slot
from hethub.spec.cluster import parse_cluster
from hethub.spec.model import ModelSpec

NETWORK = {"inter_node_bw_bytes_per_s": 25e9, "inter_node_latency_s": 10e-6,
           "cross_kind_bw_bytes_per_s": 12.5e9, "cross_kind_latency_s": 40e-6}
M6X8K = ModelSpec(name="m6x8k", num_layers=6, hidden_size=8192, num_heads=64, num_kv_heads=8, ffn_hidden_size=28672,
                  vocab_size=32000, max_seq_len=4096)
M12X2K = ModelSpec(name="m12x2k", num_layers=12, hidden_size=2048, num_heads=16, num_kv_heads=16, ffn_hidden_size=8192,
                   vocab_size=50272, max_seq_len=4096)
CASES = {
    "a100-v100-12": ([("a100-80gb", 1, 4), ("v100-16gb", 1, 8)], M6X8K,
                     PlannerConfig(global_batch=128, seq_len=1024, schedule="1f1b", micro_batch_sizes=(1, 2, 4),
                                   polish=False)),
    "mi300x-h100-a100-16": ([("mi300x", 1, 8), ("h100-sxm", 1, 4), ("a100-40gb", 1, 4)], M12X2K,
                            PlannerConfig(global_batch=64, seq_len=2048, schedule="gpipe", micro_batch_sizes=(1, 2, 4),
                                          polish=False)),
}


@pytest.mark.parametrize("name", ["a100-v100-12", pytest.param("mi300x-h100-a100-16", marks=pytest.mark.slow)])
def test_all_sizes_plan_at_least_as_well_as_the_best_single_size(name):
    groups, model, config = CASES[name]
    cluster = parse_cluster({"name": name, "network": NETWORK,
                             "group": [{"kind": k, "nodes": n, "devices_per_node": d} for k, n, d in groups]},
                            where="test")
    every = make_plan(cluster=cluster, model=model, config=config).prediction.tokens_per_s
    single = {b: make_plan(cluster=cluster, model=model, config=replace(config, micro_batch_sizes=(b,)))
              .prediction.tokens_per_s for b in config.micro_batch_sizes}
    assert every >= max(single.values()) * (1 - 1e-9), (every, single)


def _est(step_s: float, mbs: int) -> Estimate:
    pipe = PipeCost(slots=(Slot("k", 1),), mbs=mbs, layers=(1,), recompute=(False,), fwd_s=(step_s,), bwd_s=(0.0,),
                    update_s=(0.0,), p2p_s=(), params=(1.0,), schedule="gpipe")
    return Estimate(groups=(Group(pipe, 1),), micro_batches=((1,),), step_time_s=step_s)


def test_results_keep_each_sizes_best_besides_the_overall_best():
    results = Results(keep=2, per_size=1)
    for step, mbs in ((1.0, 2), (1.1, 2), (1.2, 2), (1.5, 1), (1.4, 1)):
        results.add(_est(step, mbs))
    # Overall: 1.0 and 1.1 (size 2); size 1's best (1.4) keeps its place, size 1's 1.5 does not.
    assert [s for s, *_ in results._best.entries] == [1.0, 1.1]
    assert [s for s, *_ in results._by_size[(1,)].entries] == [1.4]
    # Pruning reads the overall places only (the per-size ones keep what was priced anyway).
    assert results.may_enter(1.05) and not results.may_enter(1.3)
