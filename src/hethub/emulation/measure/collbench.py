"""Measure the all-reduce of p local ranks of this host, the way the runtime's gradient sync does it.

On a local emulation host (every rank a process of one machine, gloo over loopback) an all-reduce
is bound by CPU work: the ring's reductions and copies, plus the gradient sync's own flattening
into one buffer and copying back. The ring model over the measured point-to-point link sees none of
that CPU work, so ``hethub bench comm`` also measures this directly, for each participant count, and
the predictor uses it for gradient-sync groups and world barriers of that many ranks
(the cluster file's ``[[host_allreduce]]``, applied by hethub.emulation.host).

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
from dataclasses import replace

import torch

from hethub.comm.buffers import unflatten_into
from hethub.comm.communicator import Communicator
from hethub.comm.linkbench import MAX_BYTES, MIB, MIN_BYTES, TIMEOUT, measure_links, message_sizes, repetitions
from hethub.comm.local_ranks import run_local_ranks
from hethub.predict.links import LinkFit, LinksProfile, fit_alpha_beta
from hethub.spec.cluster import Cluster

HOST_ALLREDUCE_SIZES = tuple(message_sizes(max_bytes=16 * MIB))  # 4 KiB .. 16 MiB per rank


def allreduce_once_s(comm: Communicator, halves: list[torch.Tensor]) -> float:
    comm.barrier()
    start = time.perf_counter()
    flat = torch.cat([h.reshape(-1) for h in halves])
    comm.all_reduce(flat)
    unflatten_into(flat, halves)
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


def measure_host_links(cluster: Cluster, *, min_bytes: int = MIN_BYTES, max_bytes: int = MAX_BYTES,
                       show_progress: bool = True) -> LinksProfile:
    """What ``hethub bench comm`` measures: every link class of `cluster` and, on a local emulation
    cluster (``host_cores`` set, every rank a process here), the host's all-reduce among 2..N ranks
    at the sizes of HOST_ALLREDUCE_SIZES within [min_bytes, max_bytes]."""
    profile = measure_links(cluster, max_bytes=max_bytes, min_bytes=min_bytes, show_progress=show_progress)
    if cluster.host is None:
        return profile
    sizes = [n for n in HOST_ALLREDUCE_SIZES if min_bytes <= n <= max_bytes] or [min_bytes]
    return replace(profile, host_allreduce=measure_host_allreduce(range(2, cluster.num_devices + 1), sizes=sizes))
