"""Speed spread: how much one core's speed wanders against another's (local emulation hosts).

On a shared virtual machine a core's speed is not steady: over 0.1 s windows a fixed chunk of work
took 10-15 % more or less CPU time from window to window here, and two cores wander almost
independently (correlation 0.2-0.4). One rank averages that out over a step; ranks that meet at a
collective (data-parallel replicas, the ranks of a TP stage) wait for the slowest of them, which a
prediction at mean speed misses. :mod:`hethub.predict.stragglers` replays a step with drawn speeds.

Measurement: one forked process per usable core (2 to 4) runs the same chunk of work (a forward +
backward of a stack of decoder layers, :func:`hethub.profile.wake.stack_chunk`) back to back for
``duration_s``, timed by thread CPU time; each window's mean chunk time gives that core's speed in
the window. Drift common to all cores cancels in the log ratio of two processes' speeds in the same
window: its variance is twice the independent part's, ``sigma**2``.
"""

from __future__ import annotations

import math
import statistics
import time
from itertools import combinations

import torch
import torch.distributed as dist

from hethub.predict.stragglers import SpeedSpread
from hethub.profile.wake import stack_chunk
from hethub.runtime.local_ranks import run_local_ranks
from hethub.spec.cluster import usable_cores
from hethub.spec.model import ModelSpec

WINDOW_S = 0.1


def _windows(rank: int, spec: ModelSpec, mbs: int, seq_len: int, duration_s: float,
             window_s: float) -> dict[int, float]:
    """Mean chunk CPU seconds per window of a run that starts at the same instant on every rank."""
    del rank
    chunk = stack_chunk(spec, mbs=mbs, seq_len=seq_len)
    for _ in range(3):
        chunk()  # warm-up
    start = torch.tensor([time.monotonic() + 0.2], dtype=torch.float64)  # one host: one monotonic clock
    dist.all_reduce(start, op=dist.ReduceOp.MAX)
    t0 = float(start)
    while time.monotonic() < t0:
        pass
    cpu: dict[int, list[float]] = {}
    while (now := time.monotonic()) < t0 + duration_s:
        cpu.setdefault(int((now - t0) / window_s), []).append(chunk())
    return {k: statistics.fmean(v) for k, v in cpu.items()}


def measure_speed_spread(spec: ModelSpec, *, mbs: int, seq_len: int, duration_s: float = 4.0,
                         window_s: float = WINDOW_S) -> SpeedSpread | None:
    """The independent log-normal spread of a core's speed over windows of `window_s`; None on one core."""
    procs = min(usable_cores(), 4)
    if procs < 2:
        return None
    per_rank = run_local_ranks(procs, _windows, spec, mbs, seq_len, duration_s, window_s)
    variances = []
    for a, b in combinations(per_rank, 2):
        common = sorted(set(a) & set(b))[:-1]  # the last window is cut short
        if len(common) < 3:
            raise RuntimeError(f"speed spread: only {len(common)} windows of {window_s} s in {duration_s} s; "
                               "a chunk of work takes longer than a window (use a longer duration or window)")
        variances.append(statistics.variance([math.log(a[k] / b[k]) for k in common]) / 2)
    return SpeedSpread(sigma=math.sqrt(statistics.fmean(variances)), window_s=window_s)
