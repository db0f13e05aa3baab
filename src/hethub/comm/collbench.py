"""Measure the all-reduce of p local ranks of this host, the way the runtime's gradient sync does it.

On a local emulation host (every rank a process of one machine, gloo over loopback) an all-reduce
is bound by CPU work: the ring's reductions and copies, plus the gradient sync's own flattening
into one buffer and copying back. The ring model over the measured point-to-point link misses that
by ~3x here, so ``hethub bench comm`` also measures this directly, for each participant count, and
the predictor uses it for gradient-sync groups and world barriers of that many ranks
(``Cluster.host_allreduce``).

Each sample: all ranks meet at a barrier (the runtime's loss all-reduce precedes the sync), then
time ``cat`` of two gradient halves into a flat buffer, ``all_reduce`` and a copy back (what
``GradSync`` does per bucket of parameters with the same holders). The per-size time is the median
over samples (the typical cost, not the best case: every step of training pays it), and the
slowest rank's median counts, because the collective ends when it does.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

import torch

from hethub.comm.communicator import Communicator
from hethub.comm.linkbench import TIMEOUT, repetitions
from hethub.predict.links import LinkFit, fit_alpha_beta
from hethub.runtime.local_ranks import run_local_ranks

KIB, MIB = 1024, 1024 * 1024
HOST_ALLREDUCE_SIZES = tuple(4 * KIB * 4**i for i in range(7))  # 4 KiB .. 16 MiB per rank


def allreduce_once_s(comm: Communicator, halves: list[torch.Tensor]) -> float:
    comm.barrier()
    start = time.perf_counter()
    flat = torch.cat([h.reshape(-1) for h in halves])
    comm.all_reduce(flat)
    offset = 0
    for h in halves:
        h.copy_(flat[offset:offset + h.numel()].view_as(h))
        offset += h.numel()
    return time.perf_counter() - start


def _worker(rank: int, sizes: Sequence[int]) -> list[tuple[int, float]]:
    comm = Communicator(timeout=TIMEOUT)
    out = []
    for nbytes in sizes:
        n = max(2, nbytes // 4)
        halves = [torch.ones(n // 2), torch.ones(n - n // 2)]
        reps = max(5, repetitions(nbytes) // 2)  # a collective moves its bytes twice
        times = [allreduce_once_s(comm, halves) for _ in range(reps + 1)][1:]  # the first warms up
        out.append((4 * n, statistics.median(times)))
    return out


def measure_host_allreduce(participants: Sequence[int], *,
                           sizes: Sequence[int] = HOST_ALLREDUCE_SIZES) -> dict[int, LinkFit]:
    """Fitted all-reduce time by participant count, on this host's local gloo ranks."""
    fits = {}
    for p in participants:
        if p < 2:
            raise ValueError(f"an all-reduce needs at least 2 participants, got {p}")
        per_rank = run_local_ranks(p, _worker, tuple(sizes), collective_timeout_s=TIMEOUT.total_seconds())
        samples = [(n, max(r[i][1] for r in per_rank)) for i, (n, _) in enumerate(per_rank[0])]
        latency_s, bw = fit_alpha_beta(samples)
        # No measurable per-byte cost gives an infinite fit; plans embed the cluster as plain JSON.
        fits[p] = LinkFit(latency_s=latency_s, bw_bytes_per_s=min(bw, 1e15), samples=tuple(samples))
    return fits
