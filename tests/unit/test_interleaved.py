"""Interleaved 1F1B (virtual stages): Megatron's op order per device, its in-flight rule, its closed
form against the event simulation over virtual stages, and the simulation's dependencies."""

import itertools
import random

import pytest

from hethub.schedules import get_schedule
from hethub.schedules.interleaved import warmup_forwards
from hethub.schedules.simulate import simulate_pipeline, simulate_pipeline_time

SHAPES = [(p, v, m) for p in (1, 2, 3, 4, 6) for v in (2, 3, 4) for m in (1, 2, 3, 4, 5, 6, 7, 8, 9, 11, 12, 13)]


def order(p, v, m, s):
    return " ".join(f"{o.kind}{o.micro_batch}.{o.chunk}"
                    for o in get_schedule("interleaved", chunks=v).ops(stage=s, num_stages=p, num_micro_batches=m))


def sim(fwd, bwd, p2p, m, v):
    return simulate_pipeline_time(fwd_s=fwd, bwd_s=bwd, p2p_s=p2p, num_micro_batches=m, schedule="interleaved",
                                  chunks=v)


def test_megatron_op_order_p2_v2_m4():
    # Groups of p = 2 micro-batches per chunk: forwards (0,c0) (1,c0) (0,c1) (1,c1) (2,c0) ...;
    # backwards the same micro-batches on chunk v - 1 - c. Warm-up 2 (p - s - 1) + (v - 1) p.
    assert [warmup_forwards(stage=s, num_stages=2, num_micro_batches=4, chunks=2) for s in (0, 1)] == [4, 2]
    assert order(2, 2, 4, 0) == ("F0.0 F1.0 F0.1 F1.1 F2.0 B0.1 F3.0 B1.1 F2.1 B0.0 F3.1 B1.0 "
                                 "B2.1 B3.1 B2.0 B3.0")
    assert order(2, 2, 4, 1) == ("F0.0 F1.0 F0.1 B0.1 F1.1 B1.1 F2.0 B0.0 F3.0 B1.0 F2.1 B2.1 F3.1 B3.1 "
                                 "B2.0 B3.0")


def test_m_equal_p_is_all_warm_up_and_remainders_join_the_last_group():
    # Megatron's special case: m == p runs every forward first on every device.
    assert order(2, 2, 2, 1) == "F0.0 F1.0 F0.1 F1.1 B0.1 B1.1 B0.0 B1.0"
    # m = 5, p = 2: groups {0, 1, 2} and {3, 4} (the left-over micro-batch joins the first group).
    fwd = [o for o in get_schedule("interleaved", chunks=2).ops(stage=0, num_stages=2, num_micro_batches=5)
           if o.kind == "F"]
    assert [(o.micro_batch, o.chunk) for o in fwd] == [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1), (3, 0), (4, 0),
                                                       (3, 1), (4, 1)]
    # ... and the warm-up counts it: 2 (p - s - 1) + (v - 1) x 3.
    assert [warmup_forwards(stage=s, num_stages=2, num_micro_batches=5, chunks=2) for s in (0, 1)] == [5, 3]


def test_one_chunk_is_1f1b():
    il, one = get_schedule("interleaved"), get_schedule("1f1b")
    assert il.chunks_per_stage == 1
    for p, m in itertools.product((1, 2, 4), (1, 3, 8)):
        for s in range(p):
            assert il.ops(stage=s, num_stages=p, num_micro_batches=m) == one.ops(stage=s, num_stages=p,
                                                                                num_micro_batches=m)
            assert il.in_flight(stage=s, num_stages=p, num_micro_batches=m) == one.in_flight(
                stage=s, num_stages=p, num_micro_batches=m)


def test_chunks_only_for_interleaved():
    with pytest.raises(ValueError, match="'1f1b' runs one model chunk per device, not 2; virtual stages need"):
        get_schedule("1f1b", chunks=2)
    with pytest.raises(ValueError, match="must be >= 1"):
        get_schedule("interleaved", chunks=0)
    assert get_schedule("interleaved", chunks=3).chunks_per_stage == 3


def test_every_order_is_complete_causal_and_deadlock_free():
    for p, v, m in SHAPES:
        sched = get_schedule("interleaved", chunks=v)
        for s in range(p):
            ops = sched.ops(stage=s, num_stages=p, num_micro_batches=m)
            assert sorted(ops) == sorted((k, i, c) for k in "FB" for i in range(m) for c in range(v))
            seen = set()
            for o in ops:
                if o.kind == "B":
                    assert ("F", o.micro_batch, o.chunk) in seen
                seen.add(o)
        # The simulation raises on a dependency cycle between devices.
        assert len(sim([1.0] * (p * v), [2.0] * (p * v), [0.0] * (p * v - 1), m, v)) == p


def test_in_flight_rule_is_the_op_orders_peak():
    for p, v, m in SHAPES:
        sched = get_schedule("interleaved", chunks=v)
        for s in range(p):
            live = peak = 0
            for o in sched.ops(stage=s, num_stages=p, num_micro_batches=m):
                live += 1 if o.kind == "F" else -1
                peak = max(peak, live)
            assert sched.in_flight(stage=s, num_stages=p, num_micro_batches=m) == peak
            assert sched.peak_held(stage=s, num_stages=p, num_micro_batches=m, chunk_weights=[1.0] * v) == peak
            bound = sched.max_in_flight(stage=s, num_stages=p)
            assert bound is not None and peak <= bound


def test_in_flight_counts_and_unequal_chunk_weights():
    il = get_schedule("interleaved", chunks=2)
    # p = 4, m = 8: device s holds 2 (p - s - 1) + (v - 1) p + 1 chunk activations.
    assert [il.in_flight(stage=s, num_stages=4, num_micro_batches=8) for s in range(4)] == [11, 9, 7, 5]
    # A chunk of 3 layers beside one of 1: the peak weighs what is held then, not a count.
    held = il.peak_held(stage=3, num_stages=4, num_micro_batches=8, chunk_weights=[3.0, 1.0])
    # Last device: F0..F3 of chunk 0, then chunk 1's F/B pairs (4 x 3 + 1), then F4 of chunk 0 before
    # B0 of chunk 0: five chunk-0 activations, 15, more than the count's peak (5) x the mean weight.
    assert held == 5 * 3.0
    with pytest.raises(ValueError, match="need 2 chunk weights"):
        il.peak_held(stage=0, num_stages=4, num_micro_batches=8, chunk_weights=[1.0])


@pytest.mark.parametrize(("fwd", "bwd"), [(1.0, 2.0), (1.5, 1.0), (0.2, 5.0), (3.0, 3.0)])
def test_closed_form_equals_simulation_on_uniform_pipelines_without_transfers(fwd, bwd):
    for p, v, m in SHAPES:
        if m < p:
            continue  # fewer micro-batches than devices: a longer step (the planner never gives such)
        sched = get_schedule("interleaved", chunks=v)
        got = sim([fwd / v] * (p * v), [bwd / v] * (p * v), [0.0] * (p * v - 1), m, v)
        closed = sched.step_time_s(fwd_s=[fwd] * p, bwd_s=[bwd] * p, p2p_s=[0.0] * (p - 1), num_micro_batches=m)
        assert closed == pytest.approx(max(got), rel=1e-12)
        assert closed == pytest.approx((m + (p - 1) / v) * (fwd + bwd), rel=1e-12)  # the paper's bubble / v
        assert sched.stage_finish_s(step_s=got[0], bwd_s=[bwd] * p, p2p_s=[0.0] * (p - 1)) == pytest.approx(got)


def test_interleaving_shortens_the_deep_pipeline():
    # 4 devices, 8 micro-batches, F = 1, B = 2: 1F1B 33, v = 2 28.5, v = 4 26.25 (simulated and closed form).
    one = simulate_pipeline_time(fwd_s=[1.0] * 4, bwd_s=[2.0] * 4, p2p_s=[0.0] * 3, num_micro_batches=8)
    assert one[0] == 33.0
    assert max(sim([0.5] * 8, [1.0] * 8, [0.0] * 7, 8, 2)) == 28.5
    assert max(sim([0.25] * 16, [0.5] * 16, [0.0] * 15, 8, 4)) == 26.25


def test_simulation_runs_the_registry_order_and_respects_every_dependency():
    rng = random.Random(5)
    for p, v, m in [(2, 2, 4), (3, 2, 5), (4, 3, 8), (4, 2, 2), (5, 2, 7)]:
        n = p * v
        fwd = [rng.uniform(0.5, 2) for _ in range(n)]  # unequal chunks and devices
        bwd = [rng.uniform(1, 3) for _ in range(n)]
        p2p = [rng.uniform(0, 0.3) for _ in range(n - 1)]
        devs = simulate_pipeline(fwd_s=fwd, bwd_s=bwd, p2p_s=p2p, num_micro_batches=m, schedule="interleaved",
                                 chunks=v)
        end = {(o.kind, o.chunk * p + s, o.micro_batch): o.end_s for s, d in enumerate(devs) for o in d.ops}
        for s, d in enumerate(devs):
            assert " ".join(f"{o.kind}{o.micro_batch}.{o.chunk}" for o in d.ops) == order(p, v, m, s)
            for a, b in itertools.pairwise(d.ops):
                assert b.start_s >= a.end_s
            for o in d.ops:
                k = o.chunk * p + s
                assert o.end_s - o.start_s == pytest.approx((fwd if o.kind == "F" else bwd)[k])
                if o.kind == "F" and k > 0:  # chunk c of device 0 waits for chunk c - 1 of the last device
                    assert o.start_s >= end[("F", k - 1, o.micro_batch)] + p2p[k - 1] - 1e-12
                if o.kind == "B" and k < n - 1:
                    assert o.start_s >= end[("B", k + 1, o.micro_batch)] + p2p[k] - 1e-12
            assert d.finish_s == d.ops[-1].end_s
        assert [d.finish_s for d in devs] == sim(fwd, bwd, p2p, m, v)


def test_simulation_input_errors():
    with pytest.raises(ValueError, match="need a multiple of 2"):
        sim([1.0] * 3, [1.0] * 3, [0.0] * 2, 2, 2)
    with pytest.raises(ValueError, match="runs one model chunk per device"):
        simulate_pipeline_time(fwd_s=[1.0] * 4, bwd_s=[1.0] * 4, p2p_s=[0.0] * 3, num_micro_batches=2,
                               schedule="1f1b", chunks=2)


def test_closed_form_with_transfers_counts_every_hop_and_bounds_planning():
    il = get_schedule("interleaved", chunks=2)
    # p = 3: 2 inner hops per chunk, one wrap (the p-th entry), both ways.
    t = il.fill_drain_s(fwd_s=[1.0] * 3, bwd_s=[2.0] * 3, p2p_s=[0.1, 0.2, 0.5], per_micro_batch_s=3.0)
    assert t == pytest.approx((9.0 - 3.0) / 2 + 2 * (2 * 0.3 + 0.5))
    # The planner's floor never exceeds fill + one period less transfers.
    assert il.fill_work_floor_s(work_s=9.0, bottleneck_s=3.0) <= (9.0 - 3.0) / 2 + 3.0 + 1e-12
    # Its memory is bounded whatever m: largest at m = 2p - 1 (the first group holds 2p - 1).
    assert il.max_in_flight(stage=0, num_stages=4) == 2 * 3 + 7 + 1
