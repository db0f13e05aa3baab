"""Measure the link classes of a cluster with local gloo ranks and fit alpha-beta models.

For each class the cluster has (intra-node per kind, inter-node per kind, cross-kind), two forked
ranks ping-pong messages from 4 KiB up to ``max_bytes`` (powers of 4) through the path that class
takes at run time: a direct send for same-kind links, the staged host/gloo bridge for cross-kind.
One-way time is half the fastest round trip: the host is shared (other processes, two cores), and
the fastest trip is the one least disturbed by them, i.e. the link's own cost.

What this measures is the machine it runs on: here every rank is a local process, so every class
is TCP loopback (plus the bridge's staging copy for cross-kind). Measuring a real cluster's fabric
needs ranks placed on the real devices; the profile format is the same.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

from hethub.comm.bridge import BridgedCommunicator
from hethub.comm.communicator import Communicator
from hethub.comm.local_ranks import run_local_ranks
from hethub.predict.links import CROSS_KIND, LinkFit, LinksProfile, fit_alpha_beta
from hethub.spec.cluster import Cluster

KIB, MIB = 1024, 1024 * 1024
MIN_BYTES = 4 * KIB
MAX_BYTES = 256 * MIB
LOOPBACK_NOTE = ("measured on one host: every rank is a local process, so every link class is TCP loopback "
                 "(cross-kind adds the bridge's host staging); this is this machine's honest number, "
                 "not a real cluster's fabric")
TIMEOUT = timedelta(seconds=120)


@dataclass(frozen=True)
class LinkClass:
    name: str  # profile key: intra_node:<kind>, inter_node:<kind> or cross_kind
    bridged: bool  # does run-time traffic of this class go through the bridge


def link_classes(cluster: Cluster) -> list[LinkClass]:
    """The classes of link the cluster file describes, in file order."""
    out = []
    for kind in cluster.kind_names:
        groups = [g for g in cluster.groups if g.kind == kind]
        if any(g.devices_per_node > 1 for g in groups):
            out.append(LinkClass(f"intra_node:{kind}", bridged=False))
        if sum(g.num_nodes for g in groups) > 1:
            out.append(LinkClass(f"inter_node:{kind}", bridged=False))
    if len(cluster.kind_names) > 1:
        out.append(LinkClass(CROSS_KIND, bridged=True))
    return out


def message_sizes(*, min_bytes: int = MIN_BYTES, max_bytes: int = MAX_BYTES) -> list[int]:
    sizes, n = [], min_bytes
    while n <= max_bytes:
        sizes.append(n)
        n *= 4
    return sizes


def repetitions(nbytes: int) -> int:
    """Fewer round trips for big messages: about 64 MiB moved per size, 2 to 30 round trips."""
    return max(2, min(30, (64 * MIB) // nbytes))


# ---- local ranks ------------------------------------------------------------------------------------
# ---- measuring --------------------------------------------------------------------------------------
def ping_pong_s(comm: Communicator, *, rank: int, nbytes: int, reps: int, tag: int = 0) -> float:
    """One-way time of ``nbytes`` between ranks 0 and 1: half the fastest of ``reps`` round trips."""
    buf = torch.zeros(nbytes, dtype=torch.uint8)
    peer = 1 - rank
    rtts = []
    for i in range(reps + 1):  # the first round trip warms up connections and allocators
        start = time.perf_counter()
        if rank == 0:
            comm.isend(buf, dst=peer, tag=tag).wait()
            comm.recv(buf, src=peer, tag=tag)
        else:
            comm.recv(buf, src=peer, tag=tag)
            comm.isend(buf, dst=peer, tag=tag).wait()
        if i:
            rtts.append(time.perf_counter() - start)
    return min(rtts) / 2


@contextmanager
def _progress(total: int, desc: str, *, enabled: bool) -> Iterator[Any]:
    try:
        from hethub.progress import progress
    except ImportError:  # progress reporting is optional
        enabled = False
    if not enabled:
        yield None
        return
    with progress(total, desc=desc, unit="sizes") as bar:
        yield bar


def _bench_worker(rank: int, classes: list[LinkClass], sizes: list[int], show: bool) -> dict[str, list]:
    direct = Communicator(timeout=TIMEOUT)
    # Two emulated kinds with the bridge forced: the path cross-kind traffic takes at run time.
    bridged = BridgedCommunicator(kind_of_rank=["a", "b"], backend_of_kind={"a": "gloo", "b": "gloo"},
                                  timeout=TIMEOUT, force_bridge=True)
    out: dict[str, list] = {}
    with _progress(len(classes) * len(sizes), "bench comm", enabled=show and rank == 0) as bar:
        for lc in classes:
            comm = bridged if lc.bridged else direct
            samples = []
            for nbytes in sizes:
                samples.append((nbytes, ping_pong_s(comm, rank=rank, nbytes=nbytes, reps=repetitions(nbytes))))
                if bar is not None and rank == 0:
                    bar.update()
            out[lc.name] = samples
    return out


def measure_links(cluster: Cluster, *, max_bytes: int = MAX_BYTES, min_bytes: int = MIN_BYTES,
                  show_progress: bool = True) -> LinksProfile:
    """Measure every link class of ``cluster`` on this host and fit each one."""
    classes = link_classes(cluster)
    if not classes:
        raise ValueError(f"cluster {cluster.name!r} has a single device: it has no links to measure")
    sizes = message_sizes(min_bytes=min_bytes, max_bytes=max_bytes)
    start = time.perf_counter()
    measured = run_local_ranks(2, _bench_worker, classes, sizes, show_progress,
                               collective_timeout_s=TIMEOUT.total_seconds())[0]
    fits = {}
    for name, samples in measured.items():
        latency_s, bw = fit_alpha_beta(samples)
        fits[name] = LinkFit(latency_s=latency_s, bw_bytes_per_s=bw, samples=tuple(samples))
    meta = {"host": socket.gethostname(), "torch": torch.__version__, "transport": "gloo/tcp loopback",
            "ranks": 2, "seconds": round(time.perf_counter() - start, 2),
            "method": "fastest round trip / 2 per size; alpha-beta by least squares on relative error"}
    return LinksProfile(cluster=cluster.name, links=fits, note=LOOPBACK_NOTE, meta=meta)
