"""Speed spread: how much one core's speed wanders against another's (local emulation hosts).

On a shared virtual machine a core's speed is not steady, cores wander almost independently, and
they stay apart for a step and longer (it is not chunk-to-chunk noise, which is why windows of
several lengths are measured rather than single chunks). One rank averages that out; ranks that
meet at a collective (data-parallel replicas, the ranks of a TP stage) wait for the slowest of
them, which a prediction at mean speed misses. :mod:`hethub.emulation.stragglers`
replays a step with drawn speeds.

Measurement: one forked process per usable core (2 to 4) runs the same chunk of work (a forward +
backward of a stack of decoder layers, :func:`hethub.emulation.measure.wake.stack_chunk`) back to back for
``duration_s``, timed by thread CPU time; each window's mean chunk time gives that core's speed in
the window, for each window length of ``windows_s`` from the same chunks. Drift common to all
cores cancels in the log ratio of two processes' speeds in the same window: its variance is twice
the independent part's, ``sigma**2``.
"""

from __future__ import annotations

import math
import statistics
import time
from itertools import combinations

from hethub.comm.local_ranks import run_local_ranks
from hethub.emulation.host import usable_cores
from hethub.emulation.measure.wake import stack_chunk, synced_start
from hethub.emulation.stragglers import SpeedSpread
from hethub.spec.model import ModelSpec

WINDOWS_S = (0.1, 0.2, 0.4)


def _chunks(rank: int, spec: ModelSpec, mbs: int, seq_len: int, duration_s: float) -> list[tuple[float, float]]:
    """(start time from the common start, CPU seconds) of every chunk of a run that starts at the
    same instant on every rank."""
    del rank
    chunk = stack_chunk(spec, mbs=mbs, seq_len=seq_len)
    t0 = synced_start(chunk, lead_s=0.2)
    out = []
    while (now := time.monotonic()) < t0 + duration_s:
        out.append((now - t0, chunk()))
    return out


def _sigma(per_rank: list[list[tuple[float, float]]], *, window_s: float, duration_s: float) -> float:
    """The independent spread over windows of `window_s`: from the log ratios of every pair of ranks'
    mean chunk times in the same window (variance 2 sigma^2)."""
    n = int(duration_s / window_s)  # whole windows only
    means = []
    for chunks in per_rank:
        by: dict[int, list[float]] = {}
        for t, cpu in chunks:
            if int(t / window_s) < n:
                by.setdefault(int(t / window_s), []).append(cpu)
        means.append({k: statistics.fmean(v) for k, v in by.items()})
    variances = []
    for a, b in combinations(means, 2):
        common = sorted(set(a) & set(b))
        if len(common) < 3:
            raise RuntimeError(f"speed spread: only {len(common)} windows of {window_s} s in {duration_s} s; "
                               "a chunk of work takes longer than a window (use a longer duration)")
        variances.append(statistics.variance([math.log(a[k] / b[k]) for k in common]) / 2)
    return math.sqrt(statistics.fmean(variances))


def measure_speed_spread(spec: ModelSpec, *, mbs: int, seq_len: int, duration_s: float = 6.0,
                         windows_s: tuple[float, ...] = WINDOWS_S) -> tuple[SpeedSpread, ...]:
    """The independent log-normal spread of a core's speed, one per window length; () on one core."""
    procs = min(usable_cores(), 4)
    if procs < 2:
        return ()
    per_rank = run_local_ranks(procs, _chunks, spec, mbs, seq_len, duration_s)
    return tuple(SpeedSpread(sigma=_sigma(per_rank, window_s=w, duration_s=duration_s), window_s=w)
                 for w in windows_s)
