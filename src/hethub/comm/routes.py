"""Group layout for groups whose ranks span several native "islands" (``comm/hierarchical.py`` runs
their collectives): the process groups every rank creates in one order, each island's part of a group,
and a group's route (its islands, the bridge's segments and their groups), seen from one rank."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from hethub.comm.backends import DEVICE_OF_BACKEND
from hethub.comm.transport import Transport
from hethub.islands import Exchange, Segment, exchange, shard_segments

GroupKey = tuple[int, ...]
# Bridge messages of gradient reductions carry this tag, apart from the pipeline's (which count up
# from 0 per micro-batch): a reduction may finish while a peer's pipeline messages are still about.
REDUCTION_TAG = 1 << 24
# Bridge messages of parameter broadcasts (ZeRO-3's gathers), apart from reductions' and the pipeline's.
BROADCAST_TAG = 1 << 23


class GroupMaker:
    """Creates process groups once per (ranks, backend), in call order, which every rank must share.

    Returns None for the default group (all ranks, the world's backend); torch reads None as it.
    """

    def __init__(self, *, world_size: int, world_backend: str, timeout: timedelta | None) -> None:
        self.world_size = world_size
        self.world_backend = world_backend
        self._timeout = timeout
        self._cache: dict[tuple[GroupKey, str, str], Any] = {}

    def get(self, ranks: Iterable[int], backend: str, channel: str = "") -> Any:
        """The group over ``ranks`` on ``backend``; another ``channel`` is another group of the same
        ranks (its collectives ordered apart, ``comm/communicator.py``)."""
        key = tuple(sorted(ranks))
        if len(key) == self.world_size and backend == self.world_backend and not channel:
            return None
        if (key, backend, channel) not in self._cache:
            kw = {"timeout": self._timeout} if self._timeout else {}
            self._cache[(key, backend, channel)] = dist.new_group(ranks=list(key), backend=backend, **kw)
        return self._cache[(key, backend, channel)]


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
    host_pg: Any  # the transport's group of all members: the sharded exchange's p2p (bridged groups only)
    exchange: Exchange  # the hierarchical reduce-scatter / all-gather schedule (hethub.islands)
    transport: Transport | None = None  # what moves bytes between islands (comm/transport.py)
    segments: tuple[Segment, ...] = ()  # the all-reduce's bridge step (hethub.islands.shard_segments)
    segment_pgs: Mapping[GroupKey, Any] | None = None  # the transport's group of each segment's owners

    @property
    def bridged(self) -> bool:
        return len(self.islands) > 1


def build_route(members: Sequence[int], *, rank: int, island_of_rank: Sequence[str],
                backend_of_island: Mapping[str, str], groups: GroupMaker, transport: Transport,
                channel: str = "") -> Route:
    key = tuple(sorted(members))
    by_island: dict[str, list[int]] = {}
    for r in key:
        by_island.setdefault(island_of_rank[r], []).append(r)
    parts: dict[str, IslandPart] = {}
    for name, ranks in by_island.items():
        backend = backend_of_island[name]
        native = host = None
        if len(ranks) > 1:
            native = groups.get(ranks, backend, channel)
            host = native if backend == "gloo" else groups.get(ranks, "gloo", channel)
        parts[name] = IslandPart(ranks=tuple(ranks), backend=backend, native_pg=native, host_pg=host)
    host_pg = None
    islands = tuple(p.ranks for p in parts.values())
    segments: tuple[Segment, ...] = ()
    segment_pgs: dict[GroupKey, Any] = {}
    if len(by_island) > 1:
        host_pg = transport.group(key, channel=channel)
        segments = shard_segments([len(isl) for isl in islands])
        for seg in segments:  # every rank, in one order: group creation is collective over the world
            owners = segment_owners(seg, islands)
            if owners not in segment_pgs:
                segment_pgs[owners] = transport.group(owners, channel=channel)
    local = parts[island_of_rank[rank]] if rank in key else None
    return Route(members=key, islands=islands, local=local, host_pg=host_pg,
                 exchange=exchange(key, {r: island_of_rank[r] for r in key}), transport=transport,
                 segments=segments, segment_pgs=segment_pgs)


def segment_owners(seg: Segment, islands: Sequence[GroupKey]) -> GroupKey:
    """The ranks that all-reduce ``seg`` over the bridge: its owner in each island."""
    return tuple(sorted(isl[j] for isl, j in zip(islands, seg.owners, strict=True)))


def bridge_transport(route: Route) -> Transport:
    if route.transport is None:
        raise RuntimeError(f"group {route.members} spans islands but its route has no transport")
    return route.transport
