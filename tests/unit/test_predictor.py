"""The assembled predictor on small hand-built plans, plus its speed on a 4,096-device plan."""

import itertools
from dataclasses import replace

import pytest

from hethub.emulation.effects import HostEffects
from hethub.emulation.host import host_model
from hethub.plan import Pipeline, Plan, Stage
from hethub.predict.comm import allreduce_time_s, small_allreduce_time_s
from hethub.predict.predictor import predict
from hethub.predict.profiles import KindProfile, LayerTimes, ProfileEntry, ProfileSet
from hethub.predict.sync import sync_groups, world_collectives
from hethub.spec.cluster import Cluster, EmulationHost, Link, NodeGroup
from hethub.spec.kind import DeviceKind
from hethub.spec.model import PRESETS

TINY = PRESETS["tiny"]  # 6 layers, hidden 64
SEQ = 64


def kind(name: str, *, flops: float = 1e12, mem_bytes: int = 10**10, bw: float = 1e10) -> DeviceKind:
    # efficiency 1 and no mem_bw (no optimizer time) keep hand computations simple.
    return DeviceKind(name=name, vendor="test", mem_bytes=mem_bytes, peak_flops=flops, intra_node_bw_bytes_per_s=bw,
                      intra_node_latency_s=0.0, efficiency=1.0)


def cluster(*groups: tuple[DeviceKind, int, int], inter_bw: float = 1e9, cross_bw: float = 1e9) -> Cluster:
    kinds = {k.name: k for k, _, _ in groups}
    return Cluster(name="test", kinds=kinds, groups=tuple(NodeGroup(k.name, n, d) for k, n, d in groups),
                   inter_node=Link(inter_bw, 0.0), cross_kind=Link(cross_bw, 0.0))


def stages(kind_name: str, splits: list[tuple[int, ...]], devices: list[tuple[int, ...]]) -> tuple[Stage, ...]:
    n = len(splits)
    return tuple(Stage(kind=kind_name, devices=devs, layers=(lo, hi), embedding=i == 0, head=i == n - 1)
                 for i, ((lo, hi), devs) in enumerate(zip(splits, devices, strict=True)))


def plan(c: Cluster, pipelines: list[Pipeline], *, model=TINY, schedule: str = "1f1b") -> Plan:
    gb = sum(p.num_samples for p in pipelines)
    return Plan(model=model, cluster=c, global_batch=gb, seq_len=SEQ, pipelines=tuple(pipelines),
                schedule=schedule).validate()


def fwd_flops(layers: int, *, head: bool, mbs: int = 1) -> float:
    tokens = mbs * SEQ
    return layers * TINY.layer_fwd_flops(tokens=tokens, seq_len=SEQ) + (TINY.head_fwd_flops(tokens=tokens) if head
                                                                         else 0.0)


def test_single_stage_step_is_m_times_f_plus_b():
    c = cluster((kind("a"), 1, 1))
    pl = plan(c, [Pipeline(1, 4, stages("a", [(0, 6)], [(0,)]))])
    pred = predict(pl)
    f = fwd_flops(6, head=True) / 1e12
    assert pred.step_time_s == pytest.approx(4 * 3 * f)
    assert pred.tokens_per_s == pytest.approx(4 * SEQ / pred.step_time_s)
    assert pred.model_flops_per_step == pytest.approx(TINY.train_flops_per_token(seq_len=SEQ) * 4 * SEQ)
    assert pred.compute_sources == {"a": "analytic, constant efficiency"}  # no sm_count: roofline


def test_two_stages_with_p2p_one_micro_batch():
    # Two devices on one node: p2p over the intra-node link (1e10 B/s, no latency).
    c = cluster((kind("a"), 1, 2))
    pl = plan(c, [Pipeline(1, 1, stages("a", [(0, 3), (3, 6)], [(0,), (1,)]))])
    pred = predict(pl)
    f0, f1 = fwd_flops(3, head=False) / 1e12, fwd_flops(3, head=True) / 1e12
    p2p = SEQ * TINY.hidden_size * 2 / 1e10
    # F0, send, F1, B1, send back, B0, then the runtime's two world all-reduces (loss, gradient norm):
    # 8 bytes over the 2-rank ring, 2 (p-1)/p x 8 bytes at 1e10 B/s (no latency) each.
    world = 8.0 / 1e10
    assert world_collectives(pl)[0].time_s == pytest.approx(world)
    assert pred.step_time_s == pytest.approx(f0 + p2p + f1 + 2 * f1 + p2p + 2 * f0 + 2 * world)
    assert pred.stages[0].p2p_s == pytest.approx(p2p) and pred.stages[1].p2p_s == 0.0


def test_tp_adds_collectives_over_the_intra_node_link():
    c = cluster((kind("a"), 1, 2))
    one = predict(plan(c, [Pipeline(1, 1, stages("a", [(0, 6)], [(0,)]))]))
    two = predict(plan(c, [Pipeline(1, 1, stages("a", [(0, 6)], [(0, 1)]))]))
    act = SEQ * TINY.hidden_size * 2
    tp_fwd = 2 * 6 * allreduce_time_s(nbytes=act, participants=2, link=Link(1e10, 0.0))
    assert two.stages[0].fwd_s == pytest.approx(one.stages[0].fwd_s / 2 + tp_fwd)


def test_dp_sync_waits_for_the_slower_replica():
    c = cluster((kind("fast", flops=2e12), 1, 1), (kind("slow"), 1, 1))
    pl = plan(c, [Pipeline(1, 2, stages("fast", [(0, 6)], [(0,)])), Pipeline(1, 2, stages("slow", [(0, 6)], [(1,)]))])
    pred = predict(pl)
    fast, slow = pred.pipeline_times_s
    assert slow == pytest.approx(2 * fast)
    total_sync = sum(g.time_s for g in sync_groups(pl))
    world = sum(g.time_s for g in world_collectives(pl))
    assert total_sync > 0 and world > 0
    assert pred.step_time_s == pytest.approx(slow + total_sync + world)
    assert pred.stages[0].sync_s == pytest.approx(total_sync)  # the world all-reduces are not gradient sync


def test_profile_is_used_when_given():
    c = cluster((kind("a"), 1, 1))
    pl = plan(c, [Pipeline(2, 1, stages("a", [(0, 6)], [(0,)]))])
    entry = ProfileEntry(embedding=LayerTimes(0.001, 0.002), layer=LayerTimes(0.01, 0.02),
                         head=LayerTimes(0.005, 0.01))
    prof = ProfileSet({"a": KindProfile(kind="a", model="tiny", seq_len=SEQ, entries={(2, 1): entry})})
    pred = predict(pl, profiles=prof)
    assert pred.compute_sources == {"a": "profile"}
    assert pred.stages[0].fwd_s == pytest.approx(6 * 0.01 + 0.001 + 0.005)
    assert pred.step_time_s == pytest.approx(6 * 0.03 + 0.003 + 0.015)
    # A profile at another sequence length is not trusted.
    other = ProfileSet({"a": replace(prof.by_kind["a"], seq_len=SEQ // 2)})
    assert predict(pl, profiles=other).compute_sources == {"a": "analytic, constant efficiency"}


def test_memory_overflow_is_reported():
    small = cluster((kind("a", mem_bytes=10**5), 1, 1))
    big = cluster((kind("a"), 1, 1))
    p = [Pipeline(1, 1, stages("a", [(0, 6)], [(0,)]))]
    assert not predict(plan(small, p)).fits_memory
    pred = predict(plan(big, p))
    assert pred.fits_memory
    assert pred.stages[0].capacity_bytes == pytest.approx(10**10 * 0.9)  # the default 10% headroom
    assert pred.peak_mem_bytes_by_device[0] == pytest.approx(pred.stages[0].peak_mem_bytes)


def test_cross_kind_sync_is_slower_than_same_kind():
    a, b = kind("a"), kind("b")
    c = cluster((a, 2, 1), (b, 1, 1), inter_bw=1e9, cross_bw=1e8)

    def two(dev0: int, k1: str, dev1: int) -> Plan:
        return plan(c, [Pipeline(1, 1, stages("a", [(0, 6)], [(dev0,)])),
                        Pipeline(1, 1, stages(k1, [(0, 6)], [(dev1,)]))])

    same = predict(two(0, "a", 1))
    cross = predict(two(0, "b", 2))
    assert cross.stages[0].sync_s == pytest.approx(10 * same.stages[0].sync_s)
    assert cross.step_time_s > same.step_time_s


def test_replicas_that_split_layers_differently():
    c = cluster((kind("a"), 1, 5))
    p0 = Pipeline(1, 2, stages("a", [(0, 3), (3, 6)], [(0,), (1,)]))
    p1 = Pipeline(1, 2, stages("a", [(0, 2), (2, 4), (4, 6)], [(2,), (3,), (4,)]))
    pl = plan(c, [p0, p1])
    groups = _by_member(sync_groups(pl))
    assert groups["layer 2"].holders == ((0, 0), (1, 1))
    assert groups["layer 3"].holders == ((0, 1), (1, 1))
    assert groups["embedding"].holders == ((0, 0), (1, 0))
    assert groups["head"].holders == ((0, 1), (1, 2))
    pred = predict(pl)
    assert len(pred.stages) == 5
    by_stage = {(s.pipeline, s.stage): s for s in pred.stages}
    # Stage (1, 1) holds layers 2 and 3 only.
    expected = groups["layer 2"].time_s + groups["layer 3"].time_s
    assert by_stage[(1, 1)].sync_s == pytest.approx(expected)
    assert pred.step_time_s >= max(pred.pipeline_times_s) + expected


def test_tied_embedding_on_another_stage_joins_the_embedding_group():
    gpt = replace(PRESETS["opt-350m"], name="mini-gpt", num_layers=4, hidden_size=64, num_heads=4, num_kv_heads=4,
                  ffn_hidden_size=256, vocab_size=512, max_seq_len=128)
    c = cluster((kind("a"), 1, 3))
    pl = plan(c, [Pipeline(1, 1, stages("a", [(0, 2), (2, 4)], [(0,), (1,)])),
                  Pipeline(1, 1, stages("a", [(0, 4)], [(2,)]))], model=gpt)
    groups = _by_member(sync_groups(pl))
    assert groups["embedding"].holders == ((0, 0), (1, 0), (0, 1))
    # The head keeps only the final norm; layers 2-3 have the same holders, so they share its all-reduce.
    assert groups["head"] is groups["layer 2"] is groups["layer 3"]
    assert groups["head"].nbytes == (gpt.final_norm_params + 2 * gpt.layer_params) * 4  # fp32 gradients


def _by_member(groups):
    """Fused sync groups by each parameter group they contain ("embedding", "layer 3", "head")."""
    return {name: g for g in groups for name in g.name.split(", ")}


def test_replicas_sync_with_one_all_reduce_like_the_runtime():
    c = cluster((kind("a"), 1, 3))
    pl = plan(c, [Pipeline(1, 2, stages("a", [(0, 6)], [(d,)])) for d in range(3)])
    (only,) = sync_groups(pl)
    assert only.holders == ((0, 0), (1, 0), (2, 0))
    # fp32 gradients of every parameter: bf16-mixed accumulates and syncs them in fp32 (the runtime's
    # fp32 parameters, Megatron's accumulate_allreduce_grads_in_fp32), twice what bf16 would move.
    assert only.nbytes == pl.model.num_params * 4
    assert only.name == ", ".join(["embedding", *(f"layer {i}" for i in range(pl.model.num_layers)), "head"])


def test_measured_host_allreduce_replaces_the_ring_model_on_emulation_hosts():
    c = cluster((kind("a"), 1, 2))
    pl = plan(c, [Pipeline(1, 2, stages("a", [(0, 6)], [(d,)])) for d in range(2)])
    measured = Link(bw_bytes_per_s=1e8, latency_s=2e-3)
    nbytes = pl.model.num_params * 4  # fp32 gradients
    host = replace(pl, cluster=replace(c, host=EmulationHost(cores=2, allreduce=((2, measured),))))
    hook = host_model(host.cluster)
    assert hook.price_collectives(sync_groups(host))[0].time_s == pytest.approx(measured.time_s(nbytes))
    assert predict(host, host=hook).stages[0].sync_s == pytest.approx(measured.time_s(nbytes))
    # The plain predictor (no hook) never uses the host's measurement: the ring model stands.
    assert sync_groups(host)[0].time_s == pytest.approx(sync_groups(pl)[0].time_s)
    assert sync_groups(pl)[0].time_s != pytest.approx(measured.time_s(nbytes))
    assert predict(host).stages[0].sync_s == pytest.approx(sync_groups(pl)[0].time_s)
    # A real cluster has no hook at all.
    assert host_model(c) is None


def test_timeline_compute_events_do_not_overlap():
    c = cluster((kind("a"), 1, 4), (kind("b", flops=5e11), 1, 2))
    p0 = Pipeline(1, 4, stages("a", [(0, 2), (2, 4), (4, 6)], [(0,), (1,), (2, 3)]))
    p1 = Pipeline(1, 3, stages("b", [(0, 4), (4, 6)], [(4,), (5,)]))
    for schedule in ("1f1b", "gpipe"):
        pred = predict(plan(c, [p0, p1], schedule=schedule), timeline=True)
        assert {e.category for e in pred.timeline} >= {"forward", "backward", "p2p", "allreduce"}
        for d in range(6):
            busy = sorted((e.start_s, e.end_s) for e in pred.timeline
                          if e.device == d and e.category in ("forward", "backward"))
            assert len(busy) == 2 * (4 if d < 4 else 3)
            for (_, e0), (s1, _) in itertools.pairwise(busy):
                assert s1 >= e0 - 1e-15
        assert max(e.end_s for e in pred.timeline) == pytest.approx(pred.step_time_s)
        # Without a timeline the numbers are the same.
        assert predict(plan(c, [p0, p1], schedule=schedule)).step_time_s == pred.step_time_s


def test_timeline_on_an_emulation_host_is_the_shared_core_replay():
    c = cluster((kind("a"), 1, 4))
    entry = ProfileEntry(embedding=LayerTimes(0.001, 0.002), layer=LayerTimes(0.01, 0.02, 0.001),
                         head=LayerTimes(0.005, 0.01))
    prof = ProfileSet({"a": KindProfile(kind="a", model="tiny", seq_len=SEQ, entries={(1, 1): entry})})
    pipes = [Pipeline(1, 4, stages("a", [(0, 2), (2, 4), (4, 6)], [(0,), (1,), (2,)]))]
    for schedule in ("1f1b", "gpipe"):
        own = predict(plan(c, pipes, schedule=schedule), profiles=prof, timeline=True)
        one_core = plan(replace(c, host=EmulationHost(cores=1)), pipes, schedule=schedule)
        shared = predict(one_core, profiles=prof, timeline=True, host=host_model(one_core.cluster))
        # Three ranks on one core: each chunk runs slower whenever others compute at the same time.
        assert shared.step_time_s > own.step_time_s * 1.2
        assert max(e.end_s for e in shared.timeline) == pytest.approx(shared.step_time_s)
        chunks = {d: sorted((e.start_s, e.end_s, e.name) for e in shared.timeline
                            if e.device == d and e.category in ("forward", "backward")) for d in range(3)}
        for busy in chunks.values():
            assert [n for *_, n in sorted(busy, key=lambda b: b[2])] == [*(f"B{i}" for i in range(4)),
                                                                        *(f"F{i}" for i in range(4))]
            for (_, e0, _), (s1, _, _) in itertools.pairwise(busy):
                assert s1 >= e0 - 1e-12
        # A stage's forward starts only once the previous stage's forward of that micro-batch ended.
        ends = {(e.stage, e.name): e.end_s for e in shared.timeline if e.category == "forward"}
        for e in shared.timeline:
            if e.category == "forward" and e.stage > 0:
                assert e.start_s >= ends[(e.stage - 1, e.name)] - 1e-12
        stretched = [e.dur_s for e in shared.timeline if e.category == "forward" and e.stage == 1]
        assert max(stretched) > shared.stages[1].fwd_s * 1.5  # shared with the other two ranks
        assert {e.category for e in shared.timeline} >= {"forward", "backward", "p2p", "allreduce", "optimizer"}


def test_predict_4096_devices_is_fast():
    model = PRESETS["llama-2-70b"]
    k = DeviceKind(name="h", vendor="t", mem_bytes=80 * 10**9, peak_flops=989e12, intra_node_bw_bytes_per_s=450e9,
                   intra_node_latency_s=5e-6, efficiency=0.45, mem_bw_bytes_per_s=3.35e12)
    c = Cluster(name="big", kinds={"h": k}, groups=(NodeGroup("h", 512, 8),), inter_node=Link(50e9, 10e-6),
                cross_kind=Link(12.5e9, 40e-6))
    pipes = []
    for p in range(512):
        devs = [(p * 8 + i,) for i in range(8)]
        pipes.append(Pipeline(1, 8, stages("h", [(10 * i, 10 * i + 10) for i in range(8)], devs)))
    pl = Plan(model=model, cluster=c, global_batch=512 * 8, seq_len=4096, pipelines=tuple(pipes))
    pred = predict(pl)  # fast because identical replicas are simulated once (speed: not asserted on wall clock)
    assert len(pred.stages) == 4096 and len(set(pred.pipeline_times_s)) == 1
    assert pred.step_time_s > pred.pipeline_times_s[0]


def test_layer_time_is_interpolated_at_the_stage_depth():
    one, four, eight = LayerTimes(0.010, 0.020, 0.001), LayerTimes(0.008, 0.016, 0.0008), LayerTimes(0.012, 0.024)
    entry = ProfileEntry(embedding=LayerTimes(0.0, 0.0), layer=one, head=LayerTimes(0.0, 0.0),
                         layer_by_depth=((4, four), (8, eight)))
    assert entry.layer_at(1) == one
    assert entry.layer_at(4) == four
    assert entry.layer_at(2).fwd_s == pytest.approx(0.010 + (0.008 - 0.010) / 3)
    assert entry.layer_at(6).bwd_s == pytest.approx(0.020)
    assert entry.layer_at(12) == eight  # nearest beyond the deepest measured stack
    assert ProfileEntry(LayerTimes(0, 0), one, LayerTimes(0, 0)).layer_at(8) == one  # no depths: as before
    c = cluster((kind("a"), 1, 1))
    pl = plan(c, [Pipeline(2, 1, stages("a", [(0, 6)], [(0,)]))])
    prof = ProfileSet({"a": KindProfile(kind="a", model="tiny", seq_len=SEQ, entries={(2, 1): entry})})
    assert predict(pl, profiles=prof).stages[0].fwd_s == pytest.approx(6 * 0.010)


def test_wake_penalty_slows_work_after_idle_gaps_on_emulation_hosts():
    c = cluster((kind("a"), 1, 2))
    entry = ProfileEntry(embedding=LayerTimes(0.001, 0.002), layer=LayerTimes(0.01, 0.02),
                         head=LayerTimes(0.005, 0.01))
    base = KindProfile(kind="a", model="tiny", seq_len=SEQ, entries={(1, 1): entry})
    prof = ProfileSet({"a": base})
    host = replace(c, host=EmulationHost(cores=2))
    woken = host_model(host, effects={"a": HostEffects(wake_penalty=((0.001, 0.004),))})
    plain = host_model(host)
    one = plan(host, [Pipeline(1, 4, stages("a", [(0, 6)], [(0,)]))])
    # One rank computes back to back: never idle, no penalty.
    assert predict(one, profiles=prof, host=woken).step_time_s == pytest.approx(
        predict(one, profiles=prof, host=plain).step_time_s)
    # Two stages wait for each other: each chunk after a wait pays up to 4 ms.
    two = plan(host, [Pipeline(1, 4, stages("a", [(0, 3), (3, 6)], [(0,), (1,)]))])
    slower = predict(two, profiles=prof, host=woken).step_time_s - predict(two, profiles=prof, host=plain).step_time_s
    assert 0.004 < slower < 16 * 0.004
    # Not an emulation host: no hook, so no shared-core replay and no penalty.
    assert host_model(c, effects={"a": HostEffects(wake_penalty=((0.001, 0.004),))}) is None


def test_measured_split_backward_sets_b_and_w_in_the_emulation_replay():
    c = replace(cluster((kind("a"), 1, 3)), host=EmulationHost(cores=4))
    entry = ProfileEntry(embedding=LayerTimes(0.0, 0.0), layer=LayerTimes(0.01, 0.02), head=LayerTimes(0.0, 0.0))
    prof = ProfileSet({"a": KindProfile(kind="a", model="tiny", seq_len=SEQ, entries={(1, 1): entry})})
    zb = replace(plan(c, [Pipeline(1, 4, stages("a", [(0, 2), (2, 4), (4, 6)], [(0,), (1,), (2,)]))]),
                 schedule="zb-h1").validate()

    def ops(split: tuple[float, float] | None) -> dict[tuple[int, str], float]:
        """Duration of each stage's B0 and W0 in the replayed timeline."""
        pred = predict(zb, profiles=prof, timeline=True,
                       host=host_model(c, effects={"a": HostEffects(split_backward=split)}))
        return {(e.stage, e.name): e.dur_s for e in pred.timeline if e.name in ("B0", "W0")}

    halves, measured = ops(None), ops((0.8, 0.3))
    bwd = 2 * 0.02  # two layers a stage
    assert halves[(1, "B0")] == pytest.approx(0.5 * bwd) and halves[(1, "W0")] == pytest.approx(0.5 * bwd)
    assert measured[(1, "B0")] == pytest.approx(0.8 * bwd) and measured[(1, "W0")] == pytest.approx(0.3 * bwd)
    # The first stage's B is the whole backward and its W empty, as the runtime runs them.
    assert measured[(0, "B0")] == pytest.approx(bwd) and measured[(0, "W0")] == pytest.approx(0.0)


def test_emulated_kind_stretches_only_the_cpu_share_of_a_profile():
    c = cluster((kind("a"), 1, 1), (replace(kind("s"), emulated_slowdown=3.0), 1, 1))
    entry = ProfileEntry(embedding=LayerTimes(0.0, 0.0), layer=LayerTimes(0.01, 0.02), head=LayerTimes(0.0, 0.0))
    half = replace(entry, cpu_fraction=0.5)  # half of each chunk waits in TP collectives
    pl = plan(c, [Pipeline(1, 1, stages("s", [(0, 6)], [(1,)]))])

    def fwd(e: ProfileEntry) -> float:
        return predict(pl, profiles=ProfileSet({"s": KindProfile(kind="s", model="tiny", seq_len=SEQ,
                                                                  entries={(1, 1): e})})).stages[0].fwd_s

    assert fwd(entry) == pytest.approx(6 * 0.01 * 3.0)
    assert fwd(half) == pytest.approx(6 * 0.01 * (1 + 2.0 * 0.5))


def test_step_breakdown_and_mfu_per_kind():
    """Per stage, compute + exposed comm + update + bubble make the step; MFU per kind is model FLOPs
    over the kinds' dense peaks; the JSON says where each part came from."""
    a = kind("a", flops=2e12)
    b = kind("b", flops=1e12)
    c = cluster((a, 1, 2), (b, 1, 2))
    st = (Stage(kind="a", devices=(0, 1), layers=(0, 4), embedding=True),
          Stage(kind="b", devices=(2, 3), layers=(4, 6), head=True))
    pred = predict(plan(c, [Pipeline(1, 4, st)]))
    for s in pred.stages:
        assert s.compute_s > 0 and s.exposed_comm_s > 0  # TP 2: collectives exposed
        # bubble_s is clamped at 0, so `bubble_s >= 0` could not fail; the sum can: it breaks when the
        # stage's own parts exceed the step (the clamp engaged) or when a part is left out.
        assert s.compute_s + s.exposed_comm_s + s.update_s + s.bubble_s == pytest.approx(pred.step_time_s)
    flops_a = 3 * fwd_flops(4, head=False, mbs=1) * 4
    assert pred.mfu_by_kind["a"] == pytest.approx(flops_a / pred.step_time_s / (2 * 2e12))
    assert 0 < pred.mfu_by_kind["all"] < 1
    d = pred.to_dict()
    assert set(d["stages"][0]["step_breakdown_s"]) == {"compute", "exposed_comm", "update", "bubble"}
    assert d["sources"]["compute"] == {"a": "analytic, constant efficiency", "b": "analytic, constant efficiency"}
    assert d["mfu_by_kind"] == pred.mfu_by_kind


def test_world_all_reduces_take_the_faster_of_ring_and_tree():
    link = Link(bw_bytes_per_s=1e10, latency_s=1e-5)
    # Two ranks: the ring (2 latencies, the bytes once) is what a tree would do too, bytes halved.
    assert small_allreduce_time_s(nbytes=8.0, participants=2, link=link) == pytest.approx(
        allreduce_time_s(nbytes=8.0, participants=2, link=link))
    # 4,096 ranks: 2 x 12 tree hops, not the ring's 2 x 4,095 latencies.
    big = small_allreduce_time_s(nbytes=8.0, participants=4096, link=link)
    assert big == pytest.approx(24 * 1e-5 + 16 / 1e10)
    assert big < allreduce_time_s(nbytes=8.0, participants=4096, link=link) / 300
    assert small_allreduce_time_s(nbytes=8.0, participants=1, link=link) == 0.0
