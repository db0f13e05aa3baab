"""The event simulation's steady-phase skip (schedules/event_sim.py, skip_steady) against the plain
simulation: the same finishes to 1e-12 relative on random pipelines of every single-chunk schedule
and both p2p modes it simulates, and it does skip where the pipeline settles."""

import random

import pytest

from hethub.schedules import get_schedule
from hethub.schedules.event_sim import EventSim, skip_steady
from hethub.schedules.simulate import _simulate, simulate_pipeline_time

SCHEDULES = ("1f1b", "zb-h1", "gpipe")


def finishes(fwd, bwd, p2p, m, schedule, *, blocking, extrapolate):
    finish, _ = _simulate(fwd, bwd, p2p, m, schedule, 0.5, record=False, blocking=blocking, extrapolate=extrapolate)
    return finish


def assert_close(fast, plain):
    assert len(fast) == len(plain)
    for a, b in zip(fast, plain, strict=True):
        assert abs(a - b) <= 1e-12 * abs(b), (a, b)


def random_pipeline(rng: random.Random, p: int) -> tuple[list[float], list[float], list[float]]:
    """Stage times drawn from a few levels (equal stages are what planners build, and ties are where
    a steady state is slowest to settle), or all distinct; transfers from none to link-bound."""
    style = rng.choice(("levels", "distinct", "uniform"))
    if style == "uniform":
        f = rng.uniform(1e-3, 0.05)
        fwd = [f] * p
    elif style == "levels":
        levels = [rng.uniform(1e-3, 0.05) for _ in range(rng.randint(1, 3))]
        fwd = [rng.choice(levels) for _ in range(p)]
    else:
        fwd = [rng.uniform(1e-3, 0.05) for _ in range(p)]
    bwd = [f * rng.choice((2.0, rng.uniform(1.5, 3.0))) for f in fwd]
    scale = rng.choice((0.0, 0.01, 0.2, 1.5))  # transfers vs. a forward: none ... the link sets the pace
    p2p = [scale * rng.uniform(0.5, 1.0) * fwd[0] for _ in range(p - 1)]
    return fwd, bwd, p2p


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("blocking", [False, True])
def test_skip_equals_the_plain_simulation_on_random_pipelines(schedule, blocking):
    rng = random.Random(f"{schedule}-{blocking}")
    for _ in range(60):
        p = rng.randint(1, 24)
        m = rng.choice((rng.randint(1, 40), rng.randint(40, 300)))
        fwd, bwd, p2p = random_pipeline(rng, p)
        plain = finishes(fwd, bwd, p2p, m, schedule, blocking=blocking, extrapolate=False)
        fast = finishes(fwd, bwd, p2p, m, schedule, blocking=blocking, extrapolate=True)
        assert_close(fast, plain)


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("p2p_mode", ["async", "blocking"])
def test_the_public_entry_points_agree(schedule, p2p_mode):
    # simulate_pipeline (records, never skips) and simulate_pipeline_time (skips) give one finish.
    from hethub.schedules.simulate import simulate_pipeline

    rng = random.Random(schedule + p2p_mode)
    for _ in range(5):
        fwd, bwd, p2p = random_pipeline(rng, 12)
        kw = dict(fwd_s=fwd, bwd_s=bwd, p2p_s=p2p, num_micro_batches=200, schedule=schedule, p2p=p2p_mode)
        assert_close(simulate_pipeline_time(**kw), [st.finish_s for st in simulate_pipeline(**kw)])


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("blocking", [False, True])
def test_a_settled_pipeline_is_skipped(schedule, blocking):
    # Equal stages settle at once: most of the steady phase is jumped over, not simulated.
    p, m = 8, 200
    fwd, bwd, p2p = [0.01] * p, [0.02] * p, [0.001] * (p - 1)
    share = 0.5 if get_schedule(schedule).split_backward else 0.0  # as _simulate takes it
    sim = EventSim(fwd, bwd, p2p, m, schedule, share, record=False, blocking=blocking)
    skip_steady(sim)
    assert min(sim.nb) > m // 2
    assert sim.run([len(o) for o in sim.orders])
    plain = finishes(fwd, bwd, p2p, m, schedule, blocking=blocking, extrapolate=False)
    assert_close(sim.clock, plain)


def test_an_unsettled_pipeline_is_simulated_in_full():
    # One stage much faster than its neighbours drains its warm-up slack slowly: no repeat within m,
    # so nothing is skipped and the result is the plain simulation's, bit for bit.
    p, m = 24, 40
    fwd = [0.010] * p
    fwd[p // 2] = 0.0099
    bwd = [2 * f for f in fwd]
    p2p = [0.0] * (p - 1)
    assert finishes(fwd, bwd, p2p, m, "1f1b", blocking=False, extrapolate=True) == finishes(
        fwd, bwd, p2p, m, "1f1b", blocking=False, extrapolate=False)
