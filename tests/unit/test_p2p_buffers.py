"""The point-to-point buffer peak's shortcut (predict/memory/p2p.py): schedules whose order repeats
past the pipeline's depth walk fewer micro-batches, which must give the full walk's peak for every
count."""

from __future__ import annotations

import random

import pytest

from hethub.memo import reference_path
from hethub.predict.memory.p2p import (
    MessageBytes,
    _held_terms,
    _peak,
    held_terms,
    p2p_buffer_bytes,
    peak_micro_batches,
    walked_micro_batches,
)


@pytest.mark.parametrize(("schedule", "chunks"), [("1f1b", 1), ("zb-h1", 1), ("interleaved", 1)])
def test_the_shortcut_gives_the_full_walks_peak(schedule: str, chunks: int) -> None:
    rng = random.Random(7)
    for p in (1, 2, 3, 4, 5, 7, 9):
        # distinct sizes per message kind, so a miscounted buffer of any kind changes the peak
        msgs = MessageBytes(*[rng.choice([1.0, 3.0, 7.0, 13.0]) * (i + 1) for i in range(8)])
        for stage in range(p):
            for m in range(1, 4 * p + 10):
                if walked_micro_batches(schedule, num_stages=p, num_micro_batches=m, chunks=chunks) == m:
                    continue
                full = _peak(schedule, msgs, stage=stage, num_stages=p, num_micro_batches=m, chunks=chunks)
                got = p2p_buffer_bytes(schedule, msgs, stage=stage, num_stages=p, num_micro_batches=m, chunks=chunks)
                assert got == full, (schedule, chunks, p, stage, m)


def test_gpipe_walks_every_micro_batch() -> None:
    # GPipe's peak keeps growing with the micro-batch count: no shortcut may apply to it.
    msgs = MessageBytes(f_sent=1.0, f_received=1.0, b_sent=1.0, b_received=1.0)
    assert walked_micro_batches("gpipe", num_stages=3, num_micro_batches=40, chunks=1) == 40
    assert (p2p_buffer_bytes("gpipe", msgs, stage=1, num_stages=3, num_micro_batches=40)
            > p2p_buffer_bytes("gpipe", msgs, stage=1, num_stages=3, num_micro_batches=10))


@pytest.mark.parametrize("chunks", [2, 3])
def test_interleaving_with_chunks_walks_every_micro_batch(chunks: int) -> None:
    # Its peak follows no fixed period in the count (sends released as soon as they are known complete).
    assert all(walked_micro_batches("interleaved", num_stages=p, num_micro_batches=m, chunks=chunks) == m
               for p in (2, 4, 6) for m in range(1, 4 * p + 10))


# The counts' form (held_terms, with the micro-batch count's class) against the full replay, on every
# stage of every pipeline shape up to 4 stages (6 in the slow tier), 4 chunks and 6p + 8 micro-batches.
SHAPES = [("1f1b", 1), ("zb-h1", 1), ("gpipe", 1), ("interleaved", 1), ("interleaved", 2), ("interleaved", 3),
          ("interleaved", 4)]


@pytest.mark.parametrize(("schedule", "chunks"), SHAPES)
def test_held_terms_give_the_replays_peak(schedule: str, chunks: int) -> None:
    _check_held_terms(schedule, chunks, max_stages=4)


@pytest.mark.slow
@pytest.mark.parametrize(("schedule", "chunks"), SHAPES)
def test_held_terms_give_the_replays_peak_to_six_stages(schedule: str, chunks: int) -> None:
    _check_held_terms(schedule, chunks, max_stages=6)


def _check_held_terms(schedule: str, chunks: int, *, max_stages: int) -> None:
    rng = random.Random(11)
    for p in range(1, max_stages + 1):
        if chunks > 1 and p == 1:
            continue
        # integer sizes, distinct per message kind (any miscount changes the peak), and one set with a
        # fraction: the replay adds in another order, so the two agree to rounding there
        sizes = [MessageBytes(*[rng.choice([1.0, 3.0, 7.0, 13.0, 29.0]) * (i + 1) for i in range(8)])
                 for _ in range(3)]
        odd = MessageBytes(*[rng.uniform(1.0, 50.0) for _ in range(8)])
        for m in range(1, 6 * p + 9 if schedule != "gpipe" else 2 * p + 4):
            for stage in range(p):
                terms = held_terms(schedule, stage=stage, num_stages=p, num_micro_batches=m, chunks=chunks)
                for msgs in sizes:
                    full = _peak(schedule, msgs, stage=stage, num_stages=p, num_micro_batches=m, chunks=chunks)
                    got = terms.peak_bytes(msgs, first=stage == 0, last=stage == p - 1)
                    assert got == full, (schedule, chunks, p, stage, m, msgs)
                full = _peak(schedule, odd, stage=stage, num_stages=p, num_micro_batches=m, chunks=chunks)
                got = terms.peak_bytes(odd, first=stage == 0, last=stage == p - 1)
                assert got == pytest.approx(full, rel=1e-12), (schedule, chunks, p, stage, m)


def test_the_interleaved_count_class_is_periodic_from_3p() -> None:
    assert peak_micro_batches("interleaved", num_stages=4, num_micro_batches=11, chunks=2) == 11
    assert peak_micro_batches("interleaved", num_stages=4, num_micro_batches=12, chunks=2) == 12
    assert peak_micro_batches("interleaved", num_stages=4, num_micro_batches=17, chunks=2) == 13
    assert peak_micro_batches("1f1b", num_stages=4, num_micro_batches=17, chunks=1) == 6
    assert peak_micro_batches("gpipe", num_stages=4, num_micro_batches=17, chunks=1) == 17


def test_reference_path_replays() -> None:
    msgs = MessageBytes(*[float(3 * i + 1) for i in range(8)])
    fast = p2p_buffer_bytes("interleaved", msgs, stage=1, num_stages=4, num_micro_batches=21, chunks=2)
    with reference_path():
        slow = p2p_buffer_bytes("interleaved", msgs, stage=1, num_stages=4, num_micro_batches=21, chunks=2)
    assert fast == slow == _peak("interleaved", msgs, stage=1, num_stages=4, num_micro_batches=21, chunks=2)


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved"])
def test_a_1f1b_stages_counts_depend_on_its_tail_only(schedule: str) -> None:
    # held_terms answers from the shortest pipeline with the same tail; the walk of the stage's own shape
    # must give the same counts
    for p in range(1, 11):
        for stage in range(p):
            for m in range(1, 3 * p + 6):
                walked = peak_micro_batches(schedule, num_stages=p, num_micro_batches=m, chunks=1)
                own = _held_terms(schedule, stage=stage, num_stages=p, num_micro_batches=walked, chunks=1)
                assert held_terms(schedule, stage=stage, num_stages=p, num_micro_batches=m, chunks=1) == own, (
                    p, stage, m)
