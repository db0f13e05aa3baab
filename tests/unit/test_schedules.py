"""Pipeline schedules: the registry's op orders, in-flight rules and closed forms, and the event
simulation against hand-computed timelines."""

import itertools
import random

import pytest

from hethub.schedules import SCHEDULES, get_schedule
from hethub.schedules.event_sim import _codes, stage_codes
from hethub.schedules.simulate import simulate_pipeline, simulate_pipeline_time


def finish(fwd, bwd, p2p, m, schedule="1f1b"):
    return simulate_pipeline_time(fwd_s=fwd, bwd_s=bwd, p2p_s=p2p, num_micro_batches=m, schedule=schedule)


def op_order(*, num_stages, stage, num_micro_batches, schedule):
    ops = get_schedule(schedule).ops(stage=stage, num_stages=num_stages, num_micro_batches=num_micro_batches)
    assert all(o.chunk == 0 for o in ops)
    return [(o.kind, o.micro_batch) for o in ops]


def test_op_order_1f1b_and_gpipe():
    # p=4, m=6: stage 0 warms up with 3 forwards, stage 3 (last) with none.
    assert op_order(num_stages=4, stage=0, num_micro_batches=6, schedule="1f1b") == [
        ("F", 0), ("F", 1), ("F", 2), ("F", 3), ("B", 0), ("F", 4), ("B", 1), ("F", 5), ("B", 2),
        ("B", 3), ("B", 4), ("B", 5)]
    assert op_order(num_stages=4, stage=3, num_micro_batches=2, schedule="1f1b") == [
        ("F", 0), ("B", 0), ("F", 1), ("B", 1)]
    # m < p: the warm-up is cut at m.
    assert op_order(num_stages=4, stage=0, num_micro_batches=2, schedule="1f1b") == [
        ("F", 0), ("F", 1), ("B", 0), ("B", 1)]
    assert op_order(num_stages=2, stage=1, num_micro_batches=2, schedule="gpipe") == [
        ("F", 0), ("F", 1), ("B", 0), ("B", 1)]


def test_two_unequal_stages_1f1b():
    # F=[1,2], B=[2,4], no p2p, m=3.
    # stage 0 order F0 F1 B0 F2 B1 B2; stage 1 order F0 B0 F1 B1 F2 B2.
    # s0: F0 0-1, F1 1-2.           s1: F0 1-3, B0 3-7.
    # s0: B0 7-9 (waits B(1,0)=7), F2 9-10.
    # s1: F1 max(7, F(0,1)=2)=7-9, B1 9-13, F2 max(13, 10)=13-15, B2 15-19.
    # s0: B1 max(10, 13)=13-15, B2 max(15, 19)=19-21.
    assert finish([1, 2], [2, 4], [0], 3) == [21.0, 19.0]
    sched = simulate_pipeline(fwd_s=[1, 2], bwd_s=[2, 4], p2p_s=[0], num_micro_batches=3)
    assert [(o.kind, o.micro_batch, o.start_s, o.end_s) for o in sched[0].ops] == [
        ("F", 0, 0, 1), ("F", 1, 1, 2), ("B", 0, 7, 9), ("F", 2, 9, 10), ("B", 1, 13, 15), ("B", 2, 19, 21)]
    assert sched[1].finish_s == 19.0


def test_two_unequal_stages_gpipe():
    # s0: F0 0-1, F1 1-2, F2 2-3.  s1: F0 1-3, F1 3-5, F2 5-7, B0 7-11, B1 11-15, B2 15-19.
    # s0: B0 max(3, 11)=11-13, B1 max(13, 15)=15-17, B2 max(17, 19)=19-21.
    assert finish([1, 2], [2, 4], [0], 3, "gpipe") == [21.0, 19.0]


def test_gpipe_equals_1f1b_for_balanced_stages_without_p2p():
    # Balanced stages: both schedules take (m + p - 1)(F + B).
    for sched in ("1f1b", "gpipe"):
        assert finish([1] * 4, [2] * 4, [0] * 3, 8, sched)[0] == pytest.approx((8 + 3) * 3)


def test_p2p_delays():
    # F=[1,1], B=[1,1], p2p 0.5, m=1.
    # s0 F0 0-1; s1 F0 1.5-2.5, B0 2.5-3.5; s0 B0 4-5.
    assert finish([1, 1], [1, 1], [0.5], 1) == [5.0, 3.5]
    # A trailing p2p entry for the last stage is accepted and ignored.
    assert finish([1, 1], [1, 1], [0.5, 99.0], 1) == [5.0, 3.5]


def test_fewer_micro_batches_than_stages():
    # p=3, m=2, all F=1, B=2, no p2p.
    # Forwards: s0 F0 0-1, F1 1-2; s1 F0 1-2, F1 2-3.
    # s2 order F0 B0 F1 B1: F0 2-3, B0 3-5, F1 max(5, 3)=5-6, B1 6-8.
    # s1 order F0 F1 B0 B1: B0 max(3, 5)=5-7, B1 max(7, 8)=8-10.
    # s0 order F0 F1 B0 B1: B0 7-9, B1 max(9, 10)=10-12.
    assert finish([1, 1, 1], [2, 2, 2], [0, 0], 2) == [12.0, 10.0, 8.0]


def test_single_stage_is_m_times_f_plus_b():
    for sched in ("1f1b", "gpipe"):
        assert finish([1.5], [2.5], [], 7, sched) == [7 * 4.0]


def test_bad_inputs():
    with pytest.raises(ValueError, match="schedule"):
        finish([1], [1], [], 1, "zigzag")
    with pytest.raises(ValueError, match="unknown schedule 'zb'; use one of 1f1b, gpipe"):
        get_schedule("zb")
    with pytest.raises(ValueError, match="p2p_s"):
        finish([1, 1], [1, 1], [], 1)
    with pytest.raises(ValueError, match="num_micro_batches"):
        finish([1], [1], [], 0)


def test_ops_never_overlap_on_a_stage_and_respect_dependencies():
    rng = random.Random(0)
    p, m = 5, 7
    fwd = [rng.uniform(0.5, 2) for _ in range(p)]
    bwd = [rng.uniform(1, 4) for _ in range(p)]
    p2p = [rng.uniform(0, 0.3) for _ in range(p - 1)]
    for sched in ("1f1b", "gpipe"):
        stages = simulate_pipeline(fwd_s=fwd, bwd_s=bwd, p2p_s=p2p, num_micro_batches=m, schedule=sched)
        end = {(o.kind, s, o.micro_batch): o.end_s for s, st in enumerate(stages) for o in st.ops}
        for s, st in enumerate(stages):
            assert len(st.ops) == 2 * m
            for a, b in itertools.pairwise(st.ops):
                assert b.start_s >= a.end_s
            for o in st.ops:
                if o.kind == "F" and s > 0:
                    assert o.start_s >= end[("F", s - 1, o.micro_batch)] + p2p[s - 1] - 1e-12
                if o.kind == "B":
                    assert o.start_s >= end[("F", s, o.micro_batch)]
                    if s < p - 1:
                        assert o.start_s >= end[("B", s + 1, o.micro_batch)] + p2p[s] - 1e-12
        assert [st.finish_s for st in stages] == finish(fwd, bwd, p2p, m, sched)


def test_large_pipeline_is_at_least_its_bottleneck_bound():
    # 64 stages x 512 micro-batches (the simulation's speed is measured by bench/, not asserted here).
    rng = random.Random(1)
    fwd = [rng.uniform(1, 2) for _ in range(64)]
    bwd = [2 * f for f in fwd]
    t = finish(fwd, bwd, [0.1] * 63, 512)
    bottleneck = max(f + b for f, b in zip(fwd, bwd, strict=True))
    assert t[0] >= 512 * bottleneck and t[0] >= sum(fwd) + sum(bwd) + 2 * 0.1 * 63
    assert t == sorted(t, reverse=True)  # the last backward ripples up: earlier stages end later


SHAPES = [(p, m) for p in (1, 2, 3, 4, 6) for m in (1, 2, 3, 5, 8, 13)]


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_every_op_order_is_complete_and_causal(schedule):
    # Each stage runs every micro-batch's forward once and backward once, a backward after its forward.
    sched = get_schedule(schedule)
    for p, m in SHAPES:
        for s in range(p):
            ops = sched.ops(stage=s, num_stages=p, num_micro_batches=m)
            kinds = "FBW" if sched.split_backward else "FB"
            assert sorted((o.kind, o.micro_batch) for o in ops) == sorted((k, i) for k in kinds for i in range(m))
            seen = set()
            for o in ops:
                if o.kind in "BW":
                    assert ("F" if o.kind == "B" else "B", o.micro_batch) in seen
                seen.add((o.kind, o.micro_batch))


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_in_flight_rule_is_the_op_orders_peak(schedule):
    # The activation memory rule equals the most forwards whose backward has not run yet.
    sched = get_schedule(schedule)
    for p, m in SHAPES:
        for s in range(p):
            live = peak = 0
            for o in sched.ops(stage=s, num_stages=p, num_micro_batches=m):
                # A split backward frees a micro-batch's activations at its W, not at its B.
                live += 1 if o.kind == "F" else -1 if o.kind == ("W" if sched.split_backward else "B") else 0
                peak = max(peak, live)
            assert sched.in_flight(stage=s, num_stages=p, num_micro_batches=m) == peak


def test_in_flight_counts():
    one, gpipe = get_schedule("1f1b"), get_schedule("gpipe")
    assert [one.in_flight(stage=s, num_stages=4, num_micro_batches=8) for s in range(4)] == [4, 3, 2, 1]
    # Fewer micro-batches than stages: never more than m.
    assert one.in_flight(stage=0, num_stages=4, num_micro_batches=2) == 2
    assert [gpipe.in_flight(stage=s, num_stages=4, num_micro_batches=8) for s in range(4)] == [8] * 4
    assert [one.max_in_flight(stage=s, num_stages=4) for s in range(4)] == [4, 3, 2, 1]
    assert gpipe.max_in_flight(stage=0, num_stages=4) is None
    # Before the batch split, 1F1B sizes for its bound and GPipe for the expected micro-batches.
    assert one.planning_in_flight(stage=1, num_stages=4, expected_micro_batches=1) == 3
    assert gpipe.planning_in_flight(stage=1, num_stages=4, expected_micro_batches=7) == 7


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_simulation_runs_the_registry_op_order(schedule):
    # The predictor's simulated ops per stage are the registry's, in the same order.
    rng = random.Random(3)
    for p, m in SHAPES:
        fwd = [rng.uniform(0.5, 2) for _ in range(p)]
        bwd = [rng.uniform(1, 3) for _ in range(p)]
        stages = simulate_pipeline(fwd_s=fwd, bwd_s=bwd, p2p_s=[0.1] * (p - 1), num_micro_batches=m, schedule=schedule)
        for s, st in enumerate(stages):
            assert [(o.kind, o.micro_batch) for o in st.ops] == op_order(num_stages=p, stage=s, num_micro_batches=m,
                                                                         schedule=schedule)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_the_simulations_codes_are_the_op_order_written_over_integers(schedule):
    # stage_codes runs Schedule.order over integer codes instead of ops: the same order, code for code,
    # and the shared alphabet comes back unchanged (every stage reads the one list).
    for p in range(1, 9):
        for m in range(1, 14):
            alphabet = [list(x) for x in _codes(m)]
            for s in range(p):
                ops = get_schedule(schedule).ops(stage=s, num_stages=p, num_micro_batches=m)
                want = tuple({"F": o.micro_batch, "B": ~o.micro_batch, "W": ~(m + o.micro_batch)}[o.kind] for o in ops)
                assert stage_codes(p, s, m, schedule) == want
            assert [list(x) for x in _codes(m)] == alphabet
    with pytest.raises(ValueError, match="chunks"):
        get_schedule("interleaved", chunks=2).order(stage=0, num_stages=2, alphabet=_codes(4))


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize(("fwd", "bwd"), [(1.0, 2.0), (1.5, 1.0), (0.2, 5.0), (3.0, 3.0)])
def test_closed_form_equals_simulation_on_uniform_pipelines_without_transfers(schedule, fwd, bwd):
    sched = get_schedule(schedule)
    for p, m in SHAPES:
        if sched.split_backward and m < p:
            continue  # ZB-H1's closed form is exact from m >= p on (fewer micro-batches: a shorter fill)
        sim = finish([fwd] * p, [bwd] * p, [0.0] * (p - 1), m, schedule)
        assert sched.step_time_s(fwd_s=[fwd] * p, bwd_s=[bwd] * p, p2p_s=[0.0] * (p - 1),
                                 num_micro_batches=m) == pytest.approx(max(sim), rel=1e-12)
        # ... and each stage's finish, which the planner's sync model starts from (ZB-H1's later
        # stages finish early by up to a B each when B > F; the planner takes them as ending together).
        if not sched.split_backward:
            assert sched.stage_finish_s(step_s=sim[0], bwd_s=[bwd] * p, p2p_s=[0.0] * (p - 1)) == pytest.approx(sim)


# The closed form holds while the link keeps up (a transfer no longer than the stage's forward and
# backward); a slower link sets the pace itself (test below).
@pytest.mark.parametrize(("fwd", "bwd", "p2p"), [(1.0, 2.0, 0.3), (1.5, 1.0, 0.7), (1.0, 1.0, 1.0), (0.5, 5.0, 0.4)])
def test_gpipe_closed_form_equals_simulation_with_transfers(fwd, bwd, p2p):
    gpipe = get_schedule("gpipe")
    for p, m in SHAPES:
        sim = finish([fwd] * p, [bwd] * p, [p2p] * (p - 1), m, "gpipe")
        assert gpipe.step_time_s(fwd_s=[fwd] * p, bwd_s=[bwd] * p, p2p_s=[p2p] * (p - 1),
                                 num_micro_batches=m) == pytest.approx(sim[0], rel=1e-12)
        assert gpipe.stage_finish_s(step_s=sim[0], bwd_s=[bwd] * p, p2p_s=[p2p] * (p - 1)) == pytest.approx(sim)


# Links that keep up (transfer <= forward + backward); a slower one sets the pace (test below).
@pytest.mark.parametrize(("fwd", "bwd", "p2p"), [(1.0, 2.0, 0.3), (1.5, 1.0, 0.7), (1.0, 1.0, 2.0), (0.2, 5.0, 1.0)])
def test_1f1b_transfers_add_bubbles_the_affine_closed_form_leaves_out(fwd, bwd, p2p):
    # With transfers, 1F1B's steady state waits on round trips: on a uniform pipeline the simulation
    # is the affine closed form plus 2 p2p for each of the micro-batches 3..m except every p-th, so
    # (p - 1) / p x 2 p2p per micro-batch in the long run. The planner's closed form (affine in m,
    # for its water-level batch split) omits that term; this pins down by how much.
    one = get_schedule("1f1b")
    for p, m in SHAPES:
        sim = finish([fwd] * p, [bwd] * p, [p2p] * (p - 1), m, "1f1b")[0]
        closed = one.step_time_s(fwd_s=[fwd] * p, bwd_s=[bwd] * p, p2p_s=[p2p] * (p - 1), num_micro_batches=m)
        j = max(0, m - 2)
        waits = j - j // p if p > 1 else 0
        assert sim == pytest.approx(closed + 2 * p2p * waits, rel=1e-12)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_a_slow_link_carries_one_message_at_a_time_and_sets_the_pace(schedule):
    # Transfers of 3 s on a 2-stage pipeline whose ops take 1 s: each further micro-batch adds at
    # least one transfer time (the link is busy), never just one op's time as if messages overlapped
    # on the wire.
    fwd, bwd, p2p = [1.0, 1.0], [1.0, 1.0], [3.0]
    t = [finish(fwd, bwd, p2p, m, schedule)[0] for m in (4, 5, 6)]
    assert t[1] - t[0] >= 3.0 - 1e-12 and t[2] - t[1] >= 3.0 - 1e-12
    # The sender is never held: stage 0's forwards of GPipe run back to back whatever the link.
    if schedule == "gpipe":
        ops = simulate_pipeline(fwd_s=fwd, bwd_s=bwd, p2p_s=p2p, num_micro_batches=4, schedule=schedule)[0].ops
        assert [o.end_s for o in ops if o.kind == "F"] == [1.0, 2.0, 3.0, 4.0]


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_fill_work_floor_is_below_every_closed_form_it_stands_for(schedule):
    # The planner's floors (search/bounds.pipe_floor, mixed._box_level) take fill_drain + one period,
    # less the transfers, to be at least fill_work_floor_s(the summed work, the slowest stage): on random
    # stages, any forward share (0 to all of a stage's work) and interleaving's device totals.
    sched = get_schedule(schedule, chunks=2 if schedule == "interleaved" else 1)
    rng = random.Random(7)
    for _ in range(2000):
        p = rng.randint(1, 12)
        work = [rng.choice((1.0, rng.uniform(0.05, 4.0))) for _ in range(p)]
        share = [rng.choice((0.0, 1.0, 1 / 3, rng.random())) for _ in range(p)]
        fwd = [w * a for w, a in zip(work, share, strict=True)]
        bwd = [w - f for w, f in zip(work, fwd, strict=True)]
        per = sched.per_micro_batch_s(fwd_s=fwd, bwd_s=bwd)
        exact = sched.fill_drain_s(fwd_s=fwd, bwd_s=bwd, p2p_s=[0.0] * p, per_micro_batch_s=per) + per
        # the floor's arguments may themselves be floors, below the exact work and slowest stage
        low = rng.choice((1.0, rng.uniform(0.5, 1.0)))
        assert sched.fill_work_floor_s(work_s=sum(work) * low, bottleneck_s=max(work) * low) <= exact * (1 + 1e-12)
    # ZB-H1's is exact on equal stages whose W is the backward's assumed share (F = B - W = W).
    if schedule == "zb-h1":
        for p in range(1, 9):
            exact = sched.step_time_s(fwd_s=[1.0] * p, bwd_s=[2.0] * p, p2p_s=[0.0] * (p - 1), num_micro_batches=1)
            assert sched.fill_work_floor_s(work_s=3.0 * p, bottleneck_s=3.0) == pytest.approx(exact, rel=1e-12)
