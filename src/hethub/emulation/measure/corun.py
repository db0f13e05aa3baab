"""Co-run slowdown: how much more CPU time a rank's work takes while the host's other cores compute too.

A profile times each layer in one process on an otherwise idle host. In a plan with several ranks
they compute at the same time, one per core, and on this 2-core VM the same work then takes more
*thread CPU time* (the cores share what the guest cannot see: the physical core's other hardware
thread, caches, memory bandwidth). Small micro-batches suffer most, larger ones hardly; the ranking
bench's in-step figures that showed it are in docs/accuracy.md.

Measurement, per micro-batch size, on one forked process per usable core (2 to 4): all run the
same chunk (a forward + backward of a stack of decoder layers, as the wake penalty and speed spread
do) in alternating phases, every process busy in one phase and only rank 0 in the next, and rank 0
times its chunks by thread CPU time. The factor is the median chunk of the busy phases over that of
the alone phases: the phases alternate every few tenths of a second, so the host's slower drift
(its speed moves by tens of percent over minutes) hits both alike.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

from hethub.comm.local_ranks import run_local_ranks
from hethub.emulation.host import usable_cores
from hethub.emulation.measure.wake import stack_chunk, synced_start
from hethub.spec.model import ModelSpec

PHASE_S = 0.3


def _phased(rank: int, spec: ModelSpec, sizes: tuple[int, ...], seq_len: int, phases: int,
            ) -> dict[int, tuple[list[float], list[float]]]:
    """Per micro-batch size, rank 0's chunk CPU seconds in the all-busy and in the alone phases (other
    ranks return empty lists). Chunks that cross a phase boundary are dropped."""
    out: dict[int, tuple[list[float], list[float]]] = {}
    for mbs in sizes:
        chunk = stack_chunk(spec, mbs=mbs, seq_len=seq_len)
        t0 = synced_start(chunk, lead_s=0.1)
        together: list[float] = []
        alone: list[float] = []
        last_wall = 0.0
        while (now := time.monotonic() - t0) < phases * PHASE_S:
            phase, left = int(now / PHASE_S), PHASE_S - now % PHASE_S
            if phase % 2 == 1 and rank != 0:
                time.sleep(left)  # rank 0's alone phase
                continue
            if rank != 0 and left < last_wall:
                time.sleep(left)  # would run into the alone phase
                continue
            w0 = time.monotonic()
            cpu = chunk()
            last_wall = time.monotonic() - w0
            if rank == 0 and int((time.monotonic() - t0) / PHASE_S) == phase and phase > 0:
                (together if phase % 2 == 0 else alone).append(cpu)
        out[mbs] = (together, alone)
    return out


def measure_corun(spec: ModelSpec, *, mbs: Sequence[int], seq_len: int, phases: int = 16,
                  ) -> tuple[tuple[int, float], ...]:
    """((micro-batch size, co-run factor), ...) by size: thread CPU time of a chunk while every usable
    core (up to 4) computes, over the same chunk alone; () on one core."""
    procs = min(usable_cores(), 4)
    if procs < 2:
        return ()
    sizes = tuple(sorted(set(mbs)))
    rank0 = run_local_ranks(procs, _phased, spec, sizes, seq_len, phases)[0]
    out = []
    for m in sizes:
        together, alone = rank0[m]
        if not together or not alone:
            raise RuntimeError(f"co-run: no whole chunk of micro-batch {m} fitted a {PHASE_S} s phase "
                               f"({len(together)} busy, {len(alone)} alone); use fewer layers or a smaller size")
        out.append((m, max(1.0, statistics.median(together) / statistics.median(alone))))
    return tuple(out)
