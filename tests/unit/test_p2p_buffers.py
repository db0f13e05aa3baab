"""The point-to-point buffer peak's shortcut: schedules whose steady state repeats walk at most
``steady_from(p)`` micro-batches, which must give the full walk's peak for every count."""

from __future__ import annotations

import random

import pytest

from hethub.predict.memory.p2p import STEADY_SCHEDULES, MessageBytes, _peak, p2p_buffer_bytes, steady_from


@pytest.mark.parametrize("schedule", sorted(STEADY_SCHEDULES))
def test_steady_schedules_peak_is_the_full_walks(schedule: str) -> None:
    rng = random.Random(7)
    for p in (1, 2, 3, 4, 5, 7, 9, 12):
        # distinct sizes per message kind, so a miscounted buffer of any kind changes the peak
        msgs = MessageBytes(*[rng.choice([1.0, 3.0, 7.0, 13.0]) * (i + 1) for i in range(8)])
        for stage in range(p):
            for m in range(steady_from(p), 3 * p + 6):
                full = _peak(schedule, msgs, stage=stage, num_stages=p, num_micro_batches=m, chunks=1)
                got = p2p_buffer_bytes(schedule, msgs, stage=stage, num_stages=p, num_micro_batches=m)
                assert got == full, (schedule, p, stage, m)


def test_other_schedules_are_not_capped() -> None:
    # GPipe's peak keeps growing with the micro-batch count: the shortcut must not apply to it.
    msgs = MessageBytes(f_sent=1.0, f_received=1.0, b_sent=1.0, b_received=1.0)
    p = 3
    m = 4 * steady_from(p)
    assert "gpipe" not in STEADY_SCHEDULES
    assert (p2p_buffer_bytes("gpipe", msgs, stage=1, num_stages=p, num_micro_batches=m)
            > _peak("gpipe", msgs, stage=1, num_stages=p, num_micro_batches=steady_from(p), chunks=1))
