"""Emulating a slower device kind on CPU (labelled as emulation wherever reported).

After each compute chunk (one micro-batch forward or backward) a rank of a kind with
``emulated_slowdown`` k sleeps (k-1) times the CPU time the chunk used. CPU time of this thread
(``time.thread_time``) rather than wall time, so outside load on a shared machine does not inflate
the sleep (thread limits or CPU affinity would scale with that load instead). Sleeping never
touches tensors, so numerics are unchanged. The predictor's model of this sleep is
``hethub.emulation.contention``.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager


class Emulator:
    def __init__(self, slowdown: float = 1.0) -> None:
        if slowdown < 1:
            raise ValueError(f"emulated slowdown must be >= 1, got {slowdown}")
        self.slowdown = slowdown
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
        if self.active:
            pause = (self.slowdown - 1.0) * cpu
            time.sleep(pause)
            self.slept_s += pause
