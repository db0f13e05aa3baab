"""Emulating a slower device kind on CPU (labelled as emulation wherever reported).

After each compute chunk (one micro-batch forward or backward) a rank of a kind with
``emulated_slowdown`` k sleeps (k-1) times the CPU time the chunk used. CPU time of this thread
(``time.thread_time``) rather than wall time, so outside load on a shared machine does not inflate
the sleep (thread limits or CPU affinity would scale with that load instead). Sleeping never
touches tensors, so numerics are unchanged. The predictor's model of this sleep is
``hethub.emulation.contention``.

A *drift* (``--emulate-slowdown``: a rank or kind that turns slower during a run) sleeps a further
(d-1) times the chunk's CPU time and its kind's sleep together: the emulated device is then d times
slower than its kind.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass


class Emulator:
    def __init__(self, slowdown: float = 1.0) -> None:
        if slowdown < 1:
            raise ValueError(f"emulated slowdown must be >= 1, got {slowdown}")
        self.slowdown = slowdown
        self.drift = 1.0  # set by --emulate-slowdown from its step on
        self.slept_s = 0.0
        self.cpu_s = 0.0  # CPU time of all chunks: against their wall time, it shows descheduling

    @property
    def active(self) -> bool:
        return self.slowdown != 1.0

    @contextmanager
    def chunk(self) -> Iterator[None]:
        t0 = time.thread_time()
        yield
        cpu = time.thread_time() - t0
        self.cpu_s += cpu
        if self.active or self.drift != 1.0:
            pause = (self.slowdown * self.drift - 1.0) * cpu
            time.sleep(pause)
            self.slept_s += pause


@dataclass(frozen=True)
class SlowdownAt:
    """``--emulate-slowdown RANK_OR_KIND:FACTOR@STEP``: from step ``step`` on, the ranks named (one
    rank by number, or every rank of a kind) run ``factor`` times slower than before (``Emulator.drift``:
    a drifting or throttled device, for testing online re-balancing on CPU)."""

    target: str  # a rank number or a kind name
    factor: float
    step: int

    def __str__(self) -> str:
        return f"{self.target}:{self.factor:g}@{self.step}"

    def applies(self, *, rank: int, kind: str, step: int) -> bool:
        return step >= self.step and (self.target == str(rank) or self.target == kind)


def parse_slowdown(text: str) -> SlowdownAt:
    """argparse type of ``--emulate-slowdown``."""
    target, _, rest = text.partition(":")
    factor, _, step = rest.partition("@")
    try:
        out = SlowdownAt(target=target.strip(), factor=float(factor), step=int(step))
    except ValueError:
        out = None
    if out is None or not out.target or not out.factor >= 1 or out.step < 0:
        raise argparse.ArgumentTypeError(f"expected RANK_OR_KIND:FACTOR@STEP (a rank number or a kind name, a "
                                         f"factor >= 1, a step >= 0), e.g. 3:2@10 or cpu-slow:1.5@0; got {text!r}")
    return out


def slowdown_at(specs: Iterable[SlowdownAt], *, rank: int, kind: str, step: int) -> float:
    """The extra factor ``specs`` put on this rank at ``step`` (1 when none applies; several multiply)."""
    out = 1.0
    for s in specs:
        if s.applies(rank=rank, kind=kind, step=step):
            out *= s.factor
    return out
