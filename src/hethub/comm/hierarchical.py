"""Group layout and the hierarchical all-reduce for groups whose ranks span several native "islands".

An *island* is a set of ranks whose native backend can talk among itself (all NVIDIA ranks over
NCCL, all Ascend ranks over HCCL, every host-memory rank over gloo). A group of the runtime (a
data-parallel group, the world) may span islands; then an all-reduce runs in three steps:

1. reduce inside each island onto its leader (lowest rank) with the native backend;
2. all-reduce among the leaders through the bridge: each chunk is copied to host memory (pinned for
   CUDA) and all-reduced over gloo asynchronously, so the copy of chunk i+1 overlaps the network
   transfer of chunk i, and results are copied back as their chunks complete;
3. broadcast inside each island from its leader.

Every rank builds the same groups in the same order (``new_group`` is collective over the world),
including groups it is not a member of.

Exactness: a sum is the same in any order only when no rounding happens (integer-valued floats,
integers, max). For general floating-point data the hierarchical order differs from gloo's flat ring,
so results can differ from a plain all-reduce in the last bits; every rank still ends with identical
values (leaders share gloo's result, islands receive their leader's).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from hethub.comm.backends import DEVICE_OF_BACKEND

GroupKey = tuple[int, ...]
DEFAULT_CHUNK_BYTES = 4 * 1024 * 1024  # big enough to amortise gloo's per-op latency, small enough to overlap


class GroupMaker:
    """Creates process groups once per (ranks, backend), in call order, which every rank must share.

    Returns None for the default group (all ranks, the world's backend); torch reads None as it.
    """

    def __init__(self, *, world_size: int, world_backend: str, timeout: timedelta | None) -> None:
        self.world_size = world_size
        self.world_backend = world_backend
        self._timeout = timeout
        self._cache: dict[tuple[GroupKey, str], Any] = {}

    def get(self, ranks: Iterable[int], backend: str) -> Any:
        key = tuple(sorted(ranks))
        if len(key) == self.world_size and backend == self.world_backend:
            return None
        if (key, backend) not in self._cache:
            kw = {"timeout": self._timeout} if self._timeout else {}
            self._cache[(key, backend)] = dist.new_group(ranks=list(key), backend=backend, **kw)
        return self._cache[(key, backend)]


@dataclass(frozen=True)
class IslandPart:
    """The ranks of one island inside a group, with a native group and a host (gloo) group over them.

    Both groups are None for an island of one rank (nothing to reduce) and for the default group.
    """

    ranks: GroupKey
    backend: str
    native_pg: Any
    host_pg: Any

    @property
    def leader(self) -> int:
        return self.ranks[0]

    def pg_for(self, tensor: torch.Tensor) -> Any:
        # Every member of an island passes tensors on the same device type for the same call (same
        # kind, same code), so this choice is the same on all of them.
        return self.native_pg if tensor.device.type == DEVICE_OF_BACKEND.get(self.backend) else self.host_pg


@dataclass(frozen=True)
class Route:
    """How one group's collectives run, seen from this rank."""

    members: GroupKey
    islands: tuple[GroupKey, ...]  # each island's ranks in this group, ordered by first rank
    local: IslandPart | None  # this rank's island; None when this rank is not a member
    leaders_pg: Any  # gloo over the islands' leaders (bridged groups only)
    host_pg: Any  # gloo over all members, for gathers of staged tensors (bridged groups only)

    @property
    def bridged(self) -> bool:
        return len(self.islands) > 1


def build_route(members: Sequence[int], *, rank: int, island_of_rank: Sequence[str],
                backend_of_island: Mapping[str, str], groups: GroupMaker) -> Route:
    key = tuple(sorted(members))
    by_island: dict[str, list[int]] = {}
    for r in key:
        by_island.setdefault(island_of_rank[r], []).append(r)
    parts: dict[str, IslandPart] = {}
    for name, ranks in by_island.items():
        backend = backend_of_island[name]
        native = host = None
        if len(ranks) > 1:
            native = groups.get(ranks, backend)
            host = native if backend == "gloo" else groups.get(ranks, "gloo")
        parts[name] = IslandPart(ranks=tuple(ranks), backend=backend, native_pg=native, host_pg=host)
    leaders_pg = host_pg = None
    if len(by_island) > 1:
        leaders_pg = groups.get([p.leader for p in parts.values()], "gloo")
        host_pg = groups.get(key, "gloo")
    local = parts[island_of_rank[rank]] if rank in key else None
    return Route(members=key, islands=tuple(p.ranks for p in parts.values()), local=local,
                 leaders_pg=leaders_pg, host_pg=host_pg)


# ---- host staging -----------------------------------------------------------------------------------
class HostPool:
    """Reusable host staging buffers, taken for one transfer and given back when it is done.

    Fresh host allocations are slow (pinned ones very slow; even pageable ones pay a page fault per
    4 KiB on first touch, which on a small VM costs more than the copy itself), and the same sizes
    recur every step (activations, gradient buckets). Memory held: one buffer per size per transfer
    in flight at once.
    """

    def __init__(self) -> None:
        self._free: dict[tuple[torch.dtype, int, bool], list[torch.Tensor]] = {}

    def take(self, like: torch.Tensor) -> torch.Tensor:
        """A 1-D host buffer with ``like``'s dtype and number of elements (pinned when it is CUDA)."""
        free = self._free.get((like.dtype, like.numel(), like.is_cuda))
        if free:
            return free.pop()
        return torch.empty(like.numel(), dtype=like.dtype, device="cpu", pin_memory=like.is_cuda)

    def give(self, buf: torch.Tensor, *, like: torch.Tensor) -> None:
        """Return ``buf``, taken for ``like``, once nothing reads or writes it any more."""
        self._free.setdefault((like.dtype, like.numel(), like.is_cuda), []).append(buf)


def _wait_copies(tensor: torch.Tensor) -> None:
    if tensor.is_cuda:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(tensor.device))
        event.synchronize()


# ---- the algorithms ---------------------------------------------------------------------------------
def bridged_all_reduce(tensor: torch.Tensor, *, group: Any, op: Any, chunk_bytes: int, pool: HostPool,
                       stage: bool) -> None:
    """In-place all-reduce of a contiguous tensor among ``group`` (gloo) in chunks of ``chunk_bytes``.

    With ``stage`` (always for device tensors) each chunk is copied to a host buffer first, so the
    device-to-host copy of the next chunk overlaps the transfer of this one; host tensors can be
    reduced in place.
    """
    flat = tensor.view(-1)
    host = pool.take(flat) if stage else flat
    step = max(1, chunk_bytes // max(1, flat.element_size()))
    works = []
    for start in range(0, flat.numel(), step):
        end = min(flat.numel(), start + step)
        if stage:
            host[start:end].copy_(flat[start:end], non_blocking=flat.is_cuda)
            _wait_copies(flat)  # gloo reads host memory directly: this chunk must have landed
        works.append((dist.all_reduce(host[start:end], op=op, group=group, async_op=True), start, end))
    for work, start, end in works:
        work.wait()
        if stage:
            flat[start:end].copy_(host[start:end], non_blocking=flat.is_cuda)
    if stage:
        _wait_copies(flat)  # the buffer goes back to the pool: no copy may still read it
        pool.give(host, like=flat)


def hierarchical_all_reduce(tensor: torch.Tensor, *, route: Route, rank: int, op: Any, chunk_bytes: int,
                            pool: HostPool, stage_host: bool) -> None:
    """In-place all-reduce over a bridged route: island reduce, leaders over the bridge, broadcast."""
    local = route.local
    if local is None:
        raise RuntimeError(f"rank {rank} is not a member of group {route.members}")
    work = tensor if tensor.is_contiguous() else tensor.contiguous()
    if len(local.ranks) > 1:
        dist.reduce(work, dst=local.leader, op=op, group=local.pg_for(work))
    if rank == local.leader:
        bridged_all_reduce(work, group=route.leaders_pg, op=op, chunk_bytes=chunk_bytes, pool=pool,
                           stage=stage_host or work.device.type != "cpu")
    if len(local.ranks) > 1:
        dist.broadcast(work, src=local.leader, group=local.pg_for(work))
    if work is not tensor:
        tensor.copy_(work)
