"""The planner's memory-scaling choices: sequence parallelism as a stage mode beside recomputation,
ZeRO-2/3 as sharding variants where memory binds, context parallelism by fusing replicas
(predict/stage_modes.py, search/variants.py, predict/context_plans.py)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from hethub.errors import SpecError
from hethub.plan import Pipeline, Plan, Recompute, Stage, zero23_refusal
from hethub.predict.context_plans import cp_degrees, fuse_replicas
from hethub.predict.predictor import predict
from hethub.predict.scoring import score_plans
from hethub.predict.stage_modes import choose_recompute, stage_modes
from hethub.runtimes import runtime_runs
from hethub.search import PlannerConfig, make_plan
from hethub.search.finalists import finalist_plans
from hethub.search.hetero import search
from hethub.search.split import CostBook, Job
from hethub.search.templates import Searcher
from hethub.search.variants import Variant, enumeration_variants, variants_of
from hethub.spec.cluster import load_cluster, parse_cluster
from hethub.spec.model import ModelSpec, get_model

MODEL = ModelSpec(name="m", num_layers=6, hidden_size=1024, num_heads=8, num_kv_heads=4, ffn_hidden_size=2816,
                  vocab_size=32000, max_seq_len=8192)


def _cluster(mem_bytes: float, *, devices: int = 2, per_node: int = 2):
    # Tensor bytes only (no context, collective buffers or fragmentation), so the budgets below are exact.
    bare = {"context_bytes": 0, "comm_buffer_bytes": 0, "fragmentation": 0}
    return parse_cluster({"name": "t", "kinds": {"k": {"base": "a100-40gb", "mem_bytes": mem_bytes, **bare}},
                          "group": [{"kind": "k", "nodes": devices // per_node, "devices_per_node": per_node}],
                          "network": {"inter_node_bw_bytes_per_s": 25e9}}, where="test")


def _one_stage(cluster, *, recompute: str, sp: bool) -> Plan:
    st = Stage(kind="k", devices=(0, 1), layers=(0, 6), embedding=True, head=True, recompute=recompute,
               sequence_parallel=sp)
    return Plan(model=MODEL, cluster=cluster, global_batch=4, seq_len=4096, schedule="1f1b", precision="bf16-mixed",
                pipelines=(Pipeline(micro_batch_size=2, num_micro_batches=2, stages=(st,)),)).validate()


def _peak(plan: Plan) -> float:
    return predict(plan).stages[0].peak_mem_bytes


def _sp_config(**kw) -> PlannerConfig:
    return PlannerConfig(global_batch=4, seq_len=4096, tp_degrees=(2,), micro_batch_sizes=(2,), mem_headroom=0.0,
                         schedule="auto", optimizer_sharding="auto", **kw)


def test_split_modes_add_sp_on_tp_stages_only_where_offered():
    cluster = _cluster(40e9)
    job = Job(model=MODEL, seq_len=4096, precision="bf16-mixed", schedule="1f1b")
    book = CostBook(job, cluster)
    assert [(m.recompute, m.sp) for m in book.modes("k", tp=2, mbs=1)] == [
        (rc, sp) for rc in (Recompute.NONE, Recompute.SELECTIVE, Recompute.FULL) for sp in (False, True)]
    assert all(not m.sp for m in book.modes("k", tp=1, mbs=1))  # SP splits what TP replicates
    assert [m.recompute for m in book.modes("k", tp=2, mbs=1, allow_recompute=False)] == [Recompute.NONE]
    no_sp = CostBook(replace(job, sequence_parallel=False), cluster)
    assert all(not m.sp for m in no_sp.modes("k", tp=2, mbs=1))
    odd = CostBook(replace(job, seq_len=4095), cluster)  # the sequence does not split over 2 TP ranks
    assert all(not m.sp for m in odd.modes("k", tp=2, mbs=1))
    # Other runtimes are offered what their lists (hethub.runtimes) say they run.
    assert runtime_runs("hethub", sequence_parallel=True, cp=4, zero_stage=3)
    assert runtime_runs("megatron", sequence_parallel=True, cp=2) and not runtime_runs("megatron", zero_stage=2)
    assert not runtime_runs("deepspeed", sequence_parallel=True) and not runtime_runs("deepspeed", cp=2)


def test_stage_modes_are_ordered_by_the_stage_cost_model():
    plan = _one_stage(_cluster(40e9), recompute="none", sp=False)
    modes = stage_modes(plan)[(0, 0)]
    assert len(modes) == 6 and modes[-1][0] is Recompute.FULL  # full recomputation is the slowest
    assert stage_modes(plan, allow_sp=False)[(0, 0)] == [m for m in modes if not m[1]]
    times = [predict(_one_stage(plan.cluster, recompute=rc.value, sp=sp)).stages[0] for rc, sp in modes]
    assert [t.fwd_s + t.bwd_s for t in times] == sorted(t.fwd_s + t.bwd_s for t in times)


def test_planner_takes_sp_where_nothing_else_fits_without_full_recomputation():
    # Memory between the stage's peak with SP and without (both without recomputation): SP is the
    # only way to keep every activation, and it is faster than recomputing.
    big = _cluster(1e12)
    with_sp, without = _peak(_one_stage(big, recompute="none", sp=True)), _peak(_one_stage(big, recompute="none",
                                                                                        sp=False))
    assert with_sp < without
    cluster = _cluster((with_sp + without) / 2)
    r = make_plan(cluster=cluster, model=MODEL, config=_sp_config())
    (stage,) = r.plan.pipelines[0].stages
    assert stage.sequence_parallel and stage.recompute is Recompute.NONE
    no_sp = make_plan(cluster=cluster, model=MODEL, config=_sp_config(sequence_parallel=False))
    (plain,) = no_sp.plan.pipelines[0].stages
    assert not plain.sequence_parallel and plain.recompute is not Recompute.NONE
    assert r.prediction.step_time_s < no_sp.prediction.step_time_s


def test_planner_leaves_sp_out_where_memory_does_not_bind():
    # SP adds its norms' gradient sums over the TP group: with memory to spare it costs time.
    r = make_plan(cluster=_cluster(40e9), model=MODEL, config=_sp_config())
    assert not any(s.sequence_parallel or s.recompute is not Recompute.NONE
                   for p in r.plan.pipelines for s in p.stages)
    forced = predict(choose_recompute(replace(r.plan, pipelines=tuple(
        replace(p, stages=tuple(replace(s, sequence_parallel=s.tp > 1) for s in p.stages))
        for p in r.plan.pipelines)), allow_sp=False))
    assert forced.step_time_s > r.prediction.step_time_s


def test_zero23_variants_are_priced_where_memory_binds_and_only_valid_ones():
    variants, enumerated = variants_of(PlannerConfig(global_batch=8, seq_len=512, schedule="auto",
                                                     optimizer_sharding="auto"))
    assert enumerated == ["none", "zero1"]  # ZeRO-2/3 price the enumerations' shapes, not their own
    shardings = {(v.schedule, v.sharding) for v in variants}
    assert {("1f1b", "zero2"), ("1f1b", "zero3"), ("zb-h1", "zero3")} <= shardings
    # Under auto the interleaved plans are the best 1F1B plans in chunks; stages sized for chunks only
    # where the schedule is asked for (docs/planner.md, Variants).
    assert not any(v.schedule == "interleaved" for v in variants)
    forced, _ = variants_of(PlannerConfig(global_batch=8, seq_len=512, schedule="interleaved",
                                          optimizer_sharding="auto"))
    sized = {v.sharding for v in forced if v.schedule == "interleaved"}
    assert sized == {"none", "zero1", "zero2"} and all(v.chunks == 2 for v in forced if v.schedule == "interleaved")
    assert {v.schedule for v in forced} == {"1f1b", "interleaved"}  # it starts from 1F1B's plans
    with pytest.raises(SpecError, match="zero3"):
        PlannerConfig(global_batch=8, seq_len=512, schedule="interleaved", optimizer_sharding="zero3")

    class _Pipe:
        def __init__(self, recompute, sp=()):
            self.recompute, self.sp = recompute, sp

    class _Shape:
        def __init__(self, *pipes):
            self.groups = [type("G", (), {"pipe": p})() for p in pipes]

    plain = [_Shape(_Pipe((Recompute.NONE, Recompute.NONE))) for _ in range(4)]
    bound = [_Shape(_Pipe((Recompute.NONE, Recompute.FULL))), *plain]
    firsts = frozenset({0, 2})
    assert Variant("1f1b", "zero1").pool(plain, firsts) == (plain, firsts)  # every shape
    assert Variant("1f1b", "zero3").pool(plain, firsts) == ([], frozenset())  # memory does not bind
    for z in ("zero2", "zero3"):  # the enumerations' firsts only
        assert Variant("1f1b", z).pool(bound, firsts) == ([bound[0], bound[2]], frozenset({0, 1}))
    with_sp = [_Shape(_Pipe((Recompute.NONE,), (True,)))]
    assert Variant("1f1b", "zero3").pool(with_sp, frozenset({0})) == (with_sp, frozenset({0}))


def test_a_forced_sharding_prices_the_one_replica_shapes_unsharded():
    # A plan of one replica is unsharded whatever sharding is asked (finalists.finalist_plans): a forced
    # ZeRO-2/3 also searches at one holder, where its per-micro-batch collectives do not rank the
    # one-replica shapes last, and the unsharded variant prices those shapes.
    config = PlannerConfig(global_batch=8, seq_len=512, schedule="1f1b", optimizer_sharding="zero2")
    variants, asked = variants_of(config)
    assert asked == ["zero2"] and {v.sharding for v in variants} == {"zero2", "none"}
    enums = enumeration_variants(variants, asked)
    assert [(v.sharding, v.one_holder) for v in enums] == [("zero2", False), ("zero2", True)]
    assert enums[1].config(config, holders=64).shard_holders == 1 < enums[0].config(config, holders=64).shard_holders
    auto = variants_of(replace(config, optimizer_sharding="auto"))
    assert not any(v.one_holder for v in enumeration_variants(*auto))  # "none" is asked: the default path as it was

    class _Shape:
        def __init__(self, *counts):
            self.groups = [type("G", (), {"count": n})() for n in counts]

    shapes = [_Shape(2), _Shape(1), _Shape(1, 1), _Shape(1)]
    assert Variant("1f1b", "none").pool(shapes, frozenset({0, 1})) == ([shapes[1], shapes[3]], frozenset({0}))


def test_forced_zero2_is_at_least_the_best_one_replica_plan():
    # The README's 32-device job under --schedule 1f1b --optimizer-sharding zero2: the best one-replica
    # plan (a 16-17 stage pipeline, unsharded) beats every ZeRO-2 plan of several replicas; the pool
    # enumerated at the loosest memory held none, so the forced search lost a quarter of its tokens/s.
    cluster, model = load_cluster("examples/clusters/a100-v100-32.toml"), get_model("llama-2-7b")
    config = PlannerConfig(global_batch=256, seq_len=2048, schedule="1f1b", optimizer_sharding="zero2")
    s = Searcher(cluster=cluster, model=model, config=config, profiles=None)  # one holder: a replica's memory
    ones = [e for e in search(s) if sum(g.count for g in e.groups) == 1]
    plans = finalist_plans(s, ones, config=config, strategy="hethub")
    best = score_plans(plans, None)[0]
    assert not best[0].sharded_optimizer and len(best[0].pipelines) == 1
    got = make_plan(cluster=cluster, model=model, config=config)
    assert got.prediction.tokens_per_s >= best[1].tokens_per_s * (1 - 1e-9)


def test_zero23_plans_need_equal_micro_batch_counts():
    cluster = _cluster(40e9, devices=4)
    pipes = tuple(Pipeline(micro_batch_size=1, num_micro_batches=m, stages=(
        Stage(kind="k", devices=(i,), layers=(0, 6), embedding=True, head=True),)) for i, m in enumerate((3, 1)))
    plan = Plan(model=MODEL, cluster=cluster, global_batch=4, seq_len=512, pipelines=pipes, schedule="1f1b",
                precision="bf16-mixed", optimizer_sharding="zero2")
    assert zero23_refusal(plan) is not None
    even = replace(plan, pipelines=tuple(replace(p, num_micro_batches=2) for p in pipes))
    assert zero23_refusal(even) is None and zero23_refusal(replace(even, optimizer_sharding="zero3")) is None


def test_forced_zero3_plans_are_valid_and_fit():
    cfg = PlannerConfig(global_batch=8, seq_len=512, tp_degrees=(1,), micro_batch_sizes=(1,), schedule="1f1b",
                        optimizer_sharding="zero3", polish=False)
    r = make_plan(cluster=_cluster(40e9, devices=4), model=MODEL, config=cfg)
    assert r.plan.optimizer_sharding in ("zero3", "none")  # "none" only for a plan of one replica
    assert r.prediction.fits_memory and r.plan.validate() is not None
    if r.plan.optimizer_sharding == "zero3":
        assert len({p.num_micro_batches for p in r.plan.pipelines}) == 1


def _replicas(cluster, *, n: int, recompute: str) -> Plan:
    pipes = tuple(Pipeline(micro_batch_size=1, num_micro_batches=2, stages=(
        Stage(kind="k", devices=(2 * i, 2 * i + 1), layers=(0, 3), embedding=True, recompute=recompute),
        Stage(kind="k", devices=(2 * n + 2 * i, 2 * n + 2 * i + 1), layers=(3, 6), head=True, recompute=recompute)))
        for i in range(n))
    return Plan(model=MODEL, cluster=cluster, global_batch=2 * n, seq_len=4096, pipelines=pipes, schedule="1f1b",
                precision="bf16-mixed").validate()


def test_cp_fuses_identical_replicas_on_the_same_devices():
    cluster = _cluster(40e9, devices=16, per_node=4)
    plan = _replicas(cluster, n=4, recompute="full")
    assert cp_degrees(plan) == (2, 4)
    assert cp_degrees(_replicas(cluster, n=4, recompute="none")) == ()  # memory does not bind
    assert cp_degrees(replace(plan, seq_len=4092)) == (2,)  # 4092 splits into 4 chunks, not 8
    fused = fuse_replicas(plan, 2).validate()
    assert len(fused.pipelines) == 2
    for p in fused.pipelines:
        assert p.num_micro_batches == 4 and all(s.cp == 2 and s.tp == 2 for s in p.stages)
    assert sorted(d for p in fused.pipelines for s in p.stages for d in s.devices) == list(range(16))
    # CP rank c of a stage is replica c's TP group (CP-major devices)
    assert fused.pipelines[0].stages[0].devices == (0, 1, 2, 3)
    assert fuse_replicas(_replicas(cluster, n=1, recompute="full"), 2) is None


def test_cp_is_offered_but_not_taken_where_its_ring_costs_more_than_it_frees():
    # The ring's K/V passes are priced whole (seq_parallel.cp_ring_s); at 4k tokens on TP-2 stages
    # across a shared NIC the fused plan is slower, and the planner says so.
    cluster = _cluster(40e9, devices=16, per_node=4)
    plan = _replicas(cluster, n=4, recompute="full")
    fused = choose_recompute(fuse_replicas(plan, 2))
    assert predict(fused).fits_memory
    assert predict(fused).step_time_s > predict(choose_recompute(plan)).step_time_s


def test_planned_zero23_memory_lets_a_stage_hold_more_layers():
    # llama-2-70b on A100-40GB, 8 holders: ZeRO-2 shards the fp32 gradients, ZeRO-3 the parameters too.
    from hethub.spec.model import get_model

    model = get_model("llama-2-70b")
    cluster = parse_cluster({"name": "t", "kinds": {"k": {"base": "a100-40gb"}},
                             "group": [{"kind": "k", "nodes": 2, "devices_per_node": 4}]}, where="test")
    most = []
    for z in (1, 2, 3):
        job = Job(model=model, seq_len=1024, precision="bf16-mixed", schedule="1f1b", optimizer_shard_holders=8,
                  zero_stage=z)
        sm = CostBook(job, cluster).stage("k", tp=1, mbs=1, recompute=Recompute.FULL)
        most.append(sm.max_layers(emb=False, head=False, in_flight=1, limit=model.num_layers))
        if z >= 2:
            mem = sm.memory(4, emb=False, head=False, in_flight=1)
            assert mem.grads_bytes == pytest.approx(4 * sm.params(4, emb=False, head=False) / 8)
    assert most[0] < most[1] < most[2], most
