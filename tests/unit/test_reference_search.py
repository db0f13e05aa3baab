"""Property test: on random small instances the planner's plan is within 1% of the slow reference
search's (tests/unit/_reference_search.py), both scored by the same predictor.

Instances are seeded: 2-3 kinds, 8-128 devices, four model shapes (few layers, so the reference's
exhaustive mixed-pipeline enumeration stays small), several global batches, both schedules. Both
sides run without the predictor-driven polish, so the test compares the searches themselves.

KNOWN_MISSES: instances where the planner is more than 1% behind; they are strict xfails, so a fix
(or a predictor change that moves them) shows up as a failure to update. One (below) since the mixed
pipelines are searched by branch-and-bound over every TP degree, replica count and stage count per
kind (search/mixed.py; before, small pools combined two TP degrees per kind, large pools used every
stage of each kind and replica counts were spread geometrically), pure templates may have L + 2
stages (embedding-only and head-only ends), and the 1F1B closed form carries the round-trip period
and the predictor's hop rule (search/split.py, predict/stage_links.py): 11 of 30 were behind before.
"""

import random

import pytest
from _reference_search import reference_plan

from hethub.search import PlannerConfig, make_plan
from hethub.spec.cluster import parse_cluster
from hethub.spec.model import ModelSpec

KINDS = ("h100-sxm", "a100-80gb", "a100-40gb", "v100-16gb", "mi300x", "mi250x")
MODELS = (
    ModelSpec(name="m6x8k", num_layers=6, hidden_size=8192, num_heads=64, num_kv_heads=8, ffn_hidden_size=28672,
              vocab_size=32000, max_seq_len=4096),
    ModelSpec(name="m8x4k", num_layers=8, hidden_size=4096, num_heads=32, num_kv_heads=32, ffn_hidden_size=11008,
              vocab_size=32000, max_seq_len=4096),
    ModelSpec(name="m10x5k", num_layers=10, hidden_size=5120, num_heads=40, num_kv_heads=40, ffn_hidden_size=13824,
              vocab_size=32000, max_seq_len=4096),
    ModelSpec(name="m12x2k", num_layers=12, hidden_size=2048, num_heads=16, num_kv_heads=16, ffn_hidden_size=8192,
              vocab_size=50272, max_seq_len=4096),
)
NETWORK = {"inter_node_bw_bytes_per_s": 25e9, "inter_node_latency_s": 10e-6,
           "cross_kind_bw_bytes_per_s": 12.5e9, "cross_kind_latency_s": 40e-6}
N_INSTANCES = 30
# 27 (v100 + a100-40gb + mi300x, m10x5k, 64 x 2048): 3.2% behind. The closed form's 1F1B makespan
# (search/split.py) of the reference's pipeline (2 A100 TP-2 stages, then 8 MI300X stages; 32
# micro-batches) is 0.440 s where the predictor's simulation gives 0.413 s (+6.5%), against +1.3% for
# the planner's two unequal pipelines, so the search ranks the reference's shape below its own. The
# sync after it is priced by the predictor's rule (combine.step_time_s, LinkBook.sync_allreduce_s):
# 0.092 / 0.117 s in closed form, 0.101 / 0.131 s predicted with the runtime's bucket overlap.
# 2 (16 h100-sxm + 32 mi250x, m8x4k, 128 x 1024): 1.1% behind (454,838 vs 460,065 tokens/s). The
# reference runs one H100 pipeline of 8 TP-2 stages beside one MI250X pipeline of 8 TP-4 stages; the
# planner's kind-pure search (search/hetero.py) keeps each kind's few best templates by rate, which for
# MI250X are 9-10 TP-2 stages or 5 TP-4 ones, not that one. Shown since the closed form prices the
# NVIDIA/AMD sync as the bridge's two-level all-reduce (0.057 s after the makespan, the predictor's
# rule, where a flat ring gave 0.127 s) and the reference's floors stay below it across islands.
KNOWN_MISSES: set[int] = {2, 27}


def instance(seed: int):
    rng = random.Random(seed)
    n_kinds = rng.choice((2, 2, 3))
    kinds = rng.sample(KINDS, n_kinds)
    while True:
        groups = [{"kind": k, "nodes": rng.choice((1, 1, 2) if n_kinds == 3 else (1, 2, 4, 8)),
                   "devices_per_node": rng.choice((4, 8))} for k in kinds]
        total = sum(g["nodes"] * g["devices_per_node"] for g in groups)
        if 8 <= total <= 128:
            break
    cluster = parse_cluster({"name": f"r{seed}", "network": NETWORK, "group": groups}, where=f"instance {seed}")
    model = rng.choice(MODELS)
    config = PlannerConfig(global_batch=rng.choice((32, 64, 128)), seq_len=rng.choice((1024, 2048)),
                           schedule=rng.choice(("1f1b", "gpipe")), micro_batch_sizes=(1, 2, 4), polish=False)
    return cluster, model, config


@pytest.mark.slow
@pytest.mark.parametrize("seed", [pytest.param(i, marks=pytest.mark.xfail(
    strict=True, reason="planner misses the reference's plan by >1% (KNOWN_MISSES says why)"))
    if i in KNOWN_MISSES else i for i in range(N_INSTANCES)])
def test_planner_is_within_one_percent_of_the_reference_search(seed):
    cluster, model, config = instance(seed)
    ref = reference_plan(cluster=cluster, model=model, config=config)
    if ref is None:  # nothing in the reference space fits: the planner may still find a plan, or none
        return
    got = make_plan(cluster=cluster, model=model, config=config)
    assert got.prediction.fits_memory
    assert got.prediction.tokens_per_s >= 0.99 * ref.prediction.tokens_per_s, (
        f"{cluster.count_by_kind()} {model.name} {config.global_batch}x{config.seq_len} {config.schedule}: "
        f"planner {got.prediction.tokens_per_s:,.0f} vs reference {ref.prediction.tokens_per_s:,.0f} tokens/s")
