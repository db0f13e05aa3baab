"""The point-to-point buffer peak's shortcut (predict/memory/p2p.py): schedules whose order repeats
past the pipeline's depth walk fewer micro-batches, which must give the full walk's peak for every
count."""

from __future__ import annotations

import random

import pytest

from hethub.predict.memory.p2p import MessageBytes, _peak, p2p_buffer_bytes, walked_micro_batches


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
