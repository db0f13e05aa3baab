"""``line_releases`` (a pipeline without virtual stages) and ``ring_releases`` (any) give exactly
``send_releases``' vector-clock answer, for every registered schedule's order on every stage of every
pipeline shape tried."""

from __future__ import annotations

import pytest

from hethub.schedules import get_schedule
from hethub.schedules.messages import known_starts, line_releases, ring_releases, send_releases


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1", "gpipe", "interleaved"])
def test_line_releases_equal_the_vector_clocks(schedule: str) -> None:
    sched = get_schedule(schedule)
    for p in range(1, 9):
        for m in range(1, 3 * p + 5):
            orders = [sched.ops(stage=s, num_stages=p, num_micro_batches=m) for s in range(p)]
            known = known_starts(orders)
            for s in range(p):
                assert line_releases(orders, s) == send_releases(orders, s, known=known), (schedule, p, m, s)


def test_a_release_can_come_only_at_the_steps_end() -> None:
    # GPipe: the last stage's backwards reach stage 0 only after all its forwards, so stage 0 learns of
    # its first forward's consumption late; the last backward's send is never known complete (None).
    sched = get_schedule("gpipe")
    orders = [sched.ops(stage=s, num_stages=3, num_micro_batches=4) for s in range(3)]
    rel = line_releases(orders, 1)
    assert rel == send_releases(orders, 1)
    assert None in rel.values()


@pytest.mark.parametrize(("schedule", "chunks"), [("interleaved", 2), ("interleaved", 3), ("interleaved", 4),
                                                  ("1f1b", 1), ("zb-h1", 1)])
def test_ring_releases_equal_the_vector_clocks(schedule: str, chunks: int) -> None:
    sched = get_schedule(schedule, chunks=chunks)
    for p in range(1, 7):
        for m in range(1, 3 * p + 5):
            orders = [sched.ops(stage=s, num_stages=p, num_micro_batches=m) for s in range(p)]
            known = known_starts(orders, chunks=chunks)
            assert ring_releases(orders, chunks=chunks) == [send_releases(orders, s, chunks=chunks, known=known)
                                                            for s in range(p)], (schedule, chunks, p, m)
