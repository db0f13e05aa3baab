"""One home for the gradient-sync rule: the planner's closed form (search/combine.py, through
LinkBook.sync_allreduce_s on representative links) and the predictor (predict/sync.py) price a sync
group with the same function, predict.sync_rules.islands_allreduce_s: a ring inside a vendor island, the
bridge's two-level all-reduce across islands."""

import ast
from pathlib import Path

import pytest
from test_reference_search import instance

from hethub.plan import Pipeline, Plan, Stage
from hethub.predict.stage_links import LinkBook
from hethub.predict.sync import sync_groups
from hethub.predict.sync_overlap import unoverlapped_sync_s
from hethub.spec.model import ModelSpec

SEARCH = Path(__file__).resolve().parents[2] / "src" / "hethub" / "search"


def two_island_plan() -> Plan:
    """Two replicas on a v100 + a100 + mi300x cluster (reference-search instance 27): one of MI300X
    stages only, one whose last layers sit on A100 TP-2 stages, so some layers sync inside AMD's
    island and some across the NVIDIA/AMD bridge."""
    cluster, model, config = instance(27)
    one = Pipeline(micro_batch_size=1, num_micro_batches=40, stages=tuple(
        Stage(kind="mi300x", devices=(12 + i,), layers=(i, min(i + 1, 10)), embedding=i == 0, head=i == 10)
        for i in range(11)))
    bounds = [(0, 1), (1, 3), (3, 5), (5, 6), (6, 7)]
    two = Pipeline(micro_batch_size=1, num_micro_batches=24, stages=(
        *(Stage(kind="mi300x", devices=(23 + i,), layers=b, embedding=i == 0) for i, b in enumerate(bounds)),
        *(Stage(kind="a100-40gb", devices=(4 + 2 * i, 5 + 2 * i), layers=(7 + i, min(8 + i, 10)), head=i == 3)
          for i in range(4))))
    return Plan(model=model, cluster=cluster, global_batch=64, seq_len=config.seq_len, pipelines=(one, two),
                precision=config.precision).validate()


@pytest.mark.parametrize("runtime", ["deepspeed", "hethub"])
def test_the_closed_form_prices_each_sync_group_as_the_predictor_does(runtime):
    """DeepSpeed's engine reduces each fused group at once; hethub's runtime in ~40M-element buckets,
    each its own all-reduce (before the predictor's overlap with the backward)."""
    plan = two_island_plan().with_runtime(runtime)
    links = LinkBook(plan.cluster, runtime=runtime)
    grad_bytes = ModelSpec.state_bytes_per_param(plan.precision)["grads"]
    groups = sync_groups(plan)
    across, per_stage = 0, {}
    for g in groups:
        kinds: dict[str, int] = {}
        for pi, si in g.holders:
            kind = plan.pipelines[pi].stages[si].kind
            kinds[kind] = kinds.get(kind, 0) + 1
        across += len(kinds) > 1
        tp = min(plan.pipelines[pi].stages[si].tp for pi, si in g.holders)
        got = links.sync_allreduce_s(kinds, tp=tp, nbytes=g.nbytes, elem_bytes=grad_bytes, devices=plan.world_size)
        if runtime == "deepspeed":
            assert got == pytest.approx(g.time_s, rel=1e-12), g.name
        for x in g.holders:
            per_stage[x] = per_stage.get(x, 0.0) + got
    assert per_stage == pytest.approx(unoverlapped_sync_s(plan, groups), rel=1e-12)
    assert across >= 2  # the two-level exchange is exercised, not only rings


def test_search_has_no_ring_formula_of_its_own():
    """search/ calls the predictor's collective rules; no module restates a ring all-reduce."""
    for path in SEARCH.glob("*.py"):
        tree = ast.parse(path.read_text())
        called = {n.func.id for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
        assert "allreduce_time_s" not in called, path.name


@pytest.mark.parametrize("nbytes", [1e3, 5e7, 2e9])
def test_the_bridge_floor_is_below_the_rule_for_any_holder_counts(nbytes):
    """The search's sync floors (sync_floors.SyncFloors, LinkBook.embedding_sync_floor_s) do not know how many
    holders each kind has: LinkBook.bridge_floor_s must stay below the two-level exchange for all."""
    cluster = instance(27)[0]
    links = LinkBook(cluster)
    kinds = frozenset({"a100-40gb", "mi300x", "v100-16gb"})
    assert links.bridge_floor_s(frozenset({"a100-40gb", "v100-16gb"}), nbytes=nbytes, replicas=4) == float("inf")
    for a in range(0, 5):
        for b in range(1, 5):
            for c in range(0, 3):
                count = {k: n for k, n in zip(sorted(kinds), (a, b, c), strict=True) if n}
                replicas = sum(count.values())
                if replicas < 2 or len(count) < 2 or "mi300x" not in count:
                    continue
                exact = links.sync_allreduce_s(count, tp=1, nbytes=nbytes, elem_bytes=4, devices=cluster.num_devices)
                assert links.bridge_floor_s(frozenset(count), nbytes=nbytes, replicas=replicas) <= exact


@pytest.mark.parametrize("runtime", ["deepspeed", "hethub"])
@pytest.mark.parametrize("seed", [1, 10, 27])
def test_the_layer_floor_times_a_blocks_layers_is_below_the_blocks_fused_sync(runtime, seed):
    """The search's sync floors price a block of k layers, synced fused, at k x LinkBook.layer_sync_floor_s:
    the latencies a fused block pays once per bucket (hethub) or once (DeepSpeed) must not be counted per
    layer. Small models' layers (a fraction of a bucket) at many replicas, where latency dominates, and
    large ones."""
    cluster = instance(seed)[0]
    links = LinkBook(cluster, runtime=runtime)
    kinds = sorted(cluster.kinds)
    worst = 0.0
    for layer_params in (2e5, 5e6, 3e7, 2e8, 9e8):
        matrix, extra = layer_params * 0.99, layer_params * 0.01
        for kind_set in [[k] for k in kinds] + [kinds]:
            for tp in (1, 2, 8):
                for per_kind in (1, 4, 64):
                    count = {k: per_kind for k in kind_set}
                    floor = links.layer_sync_floor_s(frozenset(kind_set), tp=tp, replicas=sum(count.values()),
                                                     devices=cluster.num_devices, matrix=matrix, extra=extra,
                                                     elem_bytes=4, counts=count)
                    for k in (1, 2, 7, 40):
                        exact = links.sync_allreduce_s(count, tp=tp, nbytes=k * (matrix / tp + extra) * 4,
                                                       elem_bytes=4, devices=cluster.num_devices)
                        if exact > 0:
                            worst = max(worst, k * floor / exact)
    assert 0.5 < worst <= 1.0
