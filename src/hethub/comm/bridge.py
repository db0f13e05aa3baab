"""A Communicator that spans vendors: native backends inside each island, a host/gloo bridge between.

Ranks are grouped into *islands* whose native library can talk among itself. Inside an island,
point-to-point and collectives use that island's backend (nccl, hccl, gloo, ...). Across islands,
tensors are staged in host memory (pinned for CUDA) and moved over gloo (TCP), then copied onto the
receiving device: every vendor's torch can reach host memory and gloo, none can reach another
vendor's collective library. All-reduces, reduce-scatters and all-gathers over groups that span
islands are hierarchical (see :mod:`hethub.comm.hierarchical` and :mod:`hethub.islands`). The
runtime calls the same methods as on :class:`Communicator` and never learns which path a message
took.

Islands: with ``force_bridge`` every kind is its own island (how CPU tests emulate two vendors);
otherwise kinds share an island when they share a backend and, for accelerator backends, a vendor
(A100 and V100 share NCCL; an NVIDIA and an AMD GPU both say "nccl" but NCCL and RCCL do not
interoperate, so they are bridged).

Point-to-point through the bridge moves the sender's tensor as-is: both ends must agree on shape
and dtype, as with torch.distributed; the receiver's copy lands on the receiver's device.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from hethub.comm.backends import DEVICE_OF_BACKEND
from hethub.comm.communicator import DONE, Communicator, GroupKey, Lane, group_name, lane_name
from hethub.comm.hierarchical import (
    DEFAULT_CHUNK_BYTES,
    GroupMaker,
    Route,
    StartedAllReduce,
    StartedBroadcast,
    StartedReduce,
    build_route,
    hierarchical_all_gather,
    hierarchical_all_reduce,
    hierarchical_reduce_scatter,
)
from hethub.comm.recording import Channel
from hethub.comm.reduce_scatter import reduce_scatter_into
from hethub.comm.staging import (
    HostPool,
    StagedWork,
    TorchStreams,
    direct_recv,
    direct_send,
    pair_chunk_bytes,
    staged_recv,
    staged_send,
)
from hethub.comm.transport_choice import make_transport, transport_name
from hethub.errors import RuntimeSetupError
from hethub.islands import HOST_BACKENDS as _HOST_BACKENDS
from hethub.islands import island_of_kind

__all__ = ["BridgedCommunicator", "StagedWork", "island_of_kind"]
_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}


class BridgedCommunicator(Communicator):
    def __init__(self, *, kind_of_rank: Sequence[str], backend_of_kind: Mapping[str, str],
                 timeout: timedelta | None = None, force_bridge: bool = False,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES, vendor_of_kind: Mapping[str, str] | None = None,
                 stage_host: bool | None = None, transport: str = "gloo",
                 p2p_chunk_bytes: int | None = None) -> None:
        """``transport``: what moves bytes between islands (``comm/transport.py``; the environment's
        HETHUB_BRIDGE_TRANSPORT wins, so a test suite re-runs on another transport unedited).
        ``p2p_chunk_bytes``: the smallest chunk a point-to-point message across islands is cut into,
        for every pair; by default each pair's rule (``staging.pair_chunk_bytes``: chunks where
        either end is a device with streams). Both ends of a pair must agree."""
        super().__init__(timeout=timeout)
        if len(kind_of_rank) != self.world_size:
            raise RuntimeSetupError(f"the bridge was given kinds for {len(kind_of_rank)} ranks but the job has "
                                    f"{self.world_size}. Fix: pass one kind per rank (plan device order).")
        missing = sorted(set(kind_of_rank) - set(backend_of_kind))
        if missing:
            raise RuntimeSetupError(f"no backend chosen for kinds {missing}. Fix: pass backend_of_kind for every "
                                    "kind (see hethub.comm.factory.make_communicator).")
        if chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
        vendors = vendor_of_kind or {}
        self.kind_of_rank = tuple(kind_of_rank)
        self.force_bridge = force_bridge
        self.chunk_bytes = chunk_bytes
        self.p2p_chunk_bytes = p2p_chunk_bytes
        # Host tensors need no staging to ride gloo. Emulation (force_bridge) stages them anyway, so
        # CPU tests run the copy path and its cost shows up in benchmarks as it would on a device.
        self.stage_host = force_bridge if stage_host is None else stage_host
        self.island_of_rank = tuple(
            island_of_kind(k, backend=backend_of_kind[k], vendor=vendors.get(k), force_bridge=force_bridge)
            for k in kind_of_rank)
        self.backend_of_island = {i: backend_of_kind[k] for i, k in zip(self.island_of_rank, kind_of_rank,
                                                                           strict=True)}
        self._maker = GroupMaker(world_size=self.world_size, world_backend=str(dist.get_backend()),
                                 timeout=timeout)
        # The control plane (barriers, object gathers) rides gloo over the world: the default group
        # when the world is gloo, else its own. Cross-island data rides the transport (comm/transport.py).
        self._bridge_pg = self._maker.get(range(self.world_size), "gloo")
        self.transport = make_transport(transport_name(transport), self._maker.get)
        self._bridge_world = self.transport.group(range(self.world_size))
        self._routes: dict[tuple[GroupKey, str], Route] = {}
        self._streams = TorchStreams()
        self._pool = HostPool(self._streams)
        # The world is a group too (all_reduce with group=None); building it also creates each
        # island's group over all its ranks, which same-island point-to-point uses.
        self.create_groups([range(self.world_size)])
        island = self.island_of_rank[self.rank]
        mates = [r for r, i in enumerate(self.island_of_rank) if i == island]
        self._island_pg = self._maker.get(mates, self.backend_of_island[island]) if len(mates) > 1 else None

    # ---- description -----------------------------------------------------------------------------
    @property
    def bridged(self) -> bool:
        return len(set(self.island_of_rank)) > 1

    def describe(self) -> dict[str, Any]:
        """Islands, their backends and ranks: what logs and benchmarks print."""
        islands: dict[str, dict[str, Any]] = {}
        for r, (i, k) in enumerate(zip(self.island_of_rank, self.kind_of_rank, strict=True)):
            entry = islands.setdefault(i, {"backend": self.backend_of_island[i], "kinds": [], "ranks": []})
            entry["ranks"].append(r)
            if k not in entry["kinds"]:
                entry["kinds"].append(k)
        return {"bridged": self.bridged, "force_bridge": self.force_bridge, "chunk_bytes": self.chunk_bytes,
                "stage_host": self.stage_host, "transport": self.transport.caps.name, "islands": islands}

    # ---- groups ----------------------------------------------------------------------------------
    def create_groups(self, groups: Iterable[Sequence[int]], *, channel: str = "") -> None:
        for ranks in groups:
            key = tuple(sorted(ranks))
            if (key, channel) not in self._routes:
                self._routes[(key, channel)] = build_route(key, rank=self.rank, island_of_rank=self.island_of_rank,
                                                           backend_of_island=self.backend_of_island,
                                                           groups=self._maker, transport=self.transport,
                                                           channel=channel)

    def _route(self, group: Sequence[int] | None, channel: str = "") -> Route:
        key = tuple(range(self.world_size)) if group is None else tuple(sorted(group))
        try:
            return self._routes[(key, channel)]
        except KeyError:
            raise RuntimeError(f"group {key} (channel {channel!r}) was not created; list it in create_groups on "
                               "every rank") from None

    def _same_island(self, peer: int) -> bool:
        return self.island_of_rank[peer] == self.island_of_rank[self.rank]

    def _p2p_pg(self, tensor: torch.Tensor, src: int, dst: int, lane: str | None) -> Any:
        """Same-island p2p: the lane's (or without one the island's) native group for its device, else
        gloo (host tensors, matched by tag)."""
        native = DEVICE_OF_BACKEND.get(self.backend_of_island[self.island_of_rank[self.rank]])
        if tensor.device.type != native:
            return self._bridge_pg
        return self._island_pg if lane is None else self._lane_pg(src, dst, lane)

    def _new_lane(self, lane: Lane) -> Any:
        """A lane inside an island is a group of the island's backend; one across islands rides the
        bridge (gloo, matched by tag), so it needs no group of its own."""
        src, dst, _ = lane
        if self.island_of_rank[src] != self.island_of_rank[dst]:
            return self._bridge_pg
        return self._maker.get((src, dst), self.backend_of_island[self.island_of_rank[src]], channel=lane_name(*lane))

    def _chunk_bytes(self, peer: int) -> int:
        """This pair's smallest chunk (``p2p_chunk_bytes``, else ``staging.pair_chunk_bytes`` of the
        two ranks' device types, which both ends read from the same kinds and backends)."""
        if self.p2p_chunk_bytes is not None:
            return self.p2p_chunk_bytes
        a, b = (DEVICE_OF_BACKEND.get(self.backend_of_island[self.island_of_rank[r]], "cpu") for r in (self.rank, peer))
        return pair_chunk_bytes(a, b)

    def _staged(self, tensor: torch.Tensor) -> bool:
        return (tensor.device.type not in self.transport.caps.device_types or self.stage_host
                or not tensor.is_contiguous())

    # ---- point to point --------------------------------------------------------------------------
    def isend(self, tensor: torch.Tensor, *, dst: int, tag: int, lane: str | None = None) -> Any:
        data = tensor.contiguous()
        if self._same_island(dst):
            return dist.isend(data, dst=dst, tag=tag, group=self._p2p_pg(data, self.rank, dst, lane))
        chunk = self._chunk_bytes(dst)
        if not self._staged(data):
            # Memory the transport reads; like any isend, the caller keeps it unchanged until wait().
            return direct_send(data, dst=dst, tag=tag, group=self._bridge_world, transport=self.transport,
                               min_chunk_bytes=chunk)
        return staged_send(data, dst=dst, tag=tag, group=self._bridge_world, transport=self.transport,
                           pool=self._pool, streams=self._streams, min_chunk_bytes=chunk)

    def recv(self, tensor: torch.Tensor, *, src: int, tag: int) -> torch.Tensor:
        self.irecv(tensor, src=src, tag=tag).wait()
        return tensor

    def _ordered_p2p(self, peer: int, *, device: torch.device) -> bool:
        """Whether p2p with ``peer`` runs on a native accelerator group (NCCL-like: issue order)."""
        if not self._same_island(peer):
            return False  # across islands: gloo
        backend = self.backend_of_island[self.island_of_rank[self.rank]]
        return backend not in _HOST_BACKENDS and device.type == DEVICE_OF_BACKEND.get(backend)

    def p2p_channel(self, src: int, dst: int, *, device: torch.device, lane: str | None = None) -> Channel:
        """Same island, on the island's device: the lane's native group, or without one the island's
        (NCCL: issue order). Anything through gloo, the bridge's host path included, matches by tag."""
        peer = dst if src == self.rank else src
        if not self._ordered_p2p(peer, device=device):
            return Channel("bridge", ordered=False)
        if lane is not None:
            return Channel(lane_name(src, dst, lane), ordered=True)
        mates = tuple(r for r, i in enumerate(self.island_of_rank) if i == self.island_of_rank[self.rank])
        return Channel(group_name(mates, world_size=self.world_size), ordered=True)

    def irecv(self, tensor: torch.Tensor, *, src: int, tag: int, lane: str | None = None) -> Any:
        if self._same_island(src):
            return dist.irecv(tensor, src=src, tag=tag, group=self._p2p_pg(tensor, src, self.rank, lane))
        chunk = self._chunk_bytes(src)
        if not self._staged(tensor):
            return direct_recv(tensor, src=src, tag=tag, group=self._bridge_world, transport=self.transport,
                               min_chunk_bytes=chunk)
        return staged_recv(tensor, src=src, tag=tag, group=self._bridge_world, transport=self.transport,
                           pool=self._pool, streams=self._streams, min_chunk_bytes=chunk)

    # ---- collectives -----------------------------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor, *, group: Sequence[int] | None = None,
                   op: str = "sum") -> torch.Tensor:
        route = self._route(group)
        if len(route.members) == 1:
            return tensor
        rop = _OPS[op]
        if route.bridged:
            hierarchical_all_reduce(tensor, route=route, rank=self.rank, op=rop, chunk_bytes=self.chunk_bytes,
                                    pool=self._pool, stage_host=self.stage_host)
        else:
            assert route.local is not None
            dist.all_reduce(tensor, op=rop, group=route.local.pg_for(tensor))
        return tensor

    def start_all_reduce(self, tensor: torch.Tensor, *, group: Sequence[int]) -> Any:
        """As :meth:`Communicator.start_all_reduce`; across islands the island's native reduce starts
        now and the bridge step runs at ``wait()`` (:class:`StartedAllReduce`)."""
        route = self._route(group)
        if len(route.members) == 1:
            return DONE
        if route.bridged:
            return StartedAllReduce(tensor, route=route, rank=self.rank, op=_OPS["sum"], chunk_bytes=self.chunk_bytes,
                                    pool=self._pool, stage_host=self.stage_host)
        assert route.local is not None
        return dist.all_reduce(tensor, group=route.local.pg_for(tensor), async_op=True)

    def start_reduce(self, tensor: torch.Tensor, *, group: Sequence[int], dst: int, eager: bool = False) -> Any:
        """As :meth:`Communicator.start_reduce`; across islands each island reduces natively onto its
        proxy for ``dst`` now and the proxies' partial sums cross the bridge at ``wait()``
        (:class:`StartedReduce`)."""
        route = self._route(group)
        if len(route.members) == 1:
            return DONE
        if route.bridged:
            return StartedReduce(tensor, route=route, rank=self.rank, dst=dst, pool=self._pool,
                                 stage_host=self.stage_host, eager=eager)
        assert route.local is not None
        return dist.reduce(tensor, dst=dst, group=route.local.pg_for(tensor), async_op=True)

    def start_broadcast(self, tensor: torch.Tensor, *, group: Sequence[int], src: int, channel: str = "") -> Any:
        """As :meth:`Communicator.start_broadcast`; across islands ``src`` sends its tensor once to its
        proxy in every other island and each island broadcasts natively (:class:`StartedBroadcast`)."""
        route = self._route(group, channel)
        if len(route.members) == 1:
            return DONE
        if route.bridged:
            return StartedBroadcast(tensor, route=route, rank=self.rank, src=src, pool=self._pool,
                                    stage_host=self.stage_host)
        assert route.local is not None
        return dist.broadcast(tensor, src=src, group=route.local.pg_for(tensor), async_op=True)

    def reduce_scatter(self, tensor: torch.Tensor, *, group: Sequence[int],
                       sizes: Sequence[int] | None = None) -> torch.Tensor:
        """As :meth:`Communicator.reduce_scatter`. Inside one island: the native reduce-scatter. Across
        islands: native inside each island, then only each owner's chunk over the bridge
        (:func:`hierarchical_reduce_scatter`, priced the same way by ``predict/sync_sharded.py``)."""
        route = self._route(group)
        k = len(route.members)
        if k == 1:
            return tensor
        if route.bridged:
            return hierarchical_reduce_scatter(tensor, route=route, rank=self.rank, pool=self._pool,
                                               stage_host=self.stage_host, sizes=sizes)
        assert route.local is not None
        out = torch.empty(tensor.numel() // k, dtype=tensor.dtype, device=tensor.device)
        reduce_scatter_into(out, tensor.contiguous(), group=route.local.pg_for(tensor))
        return out

    def all_gather(self, tensor: torch.Tensor, *, group: Sequence[int], dim: int = 0,
                   sizes: Sequence[int] | None = None) -> torch.Tensor:
        """As :meth:`Communicator.all_gather`; across islands each member's tensor crosses the bridge
        once per other island, then each island gathers natively (:func:`hierarchical_all_gather`)."""
        route = self._route(group)
        if len(route.members) == 1:
            return tensor
        if not route.bridged:
            assert route.local is not None
            parts = [torch.empty_like(tensor) for _ in route.members]
            dist.all_gather(parts, tensor.contiguous(), group=route.local.pg_for(tensor))
            return torch.cat(parts, dim=dim)
        rows = hierarchical_all_gather(tensor, route=route, rank=self.rank, pool=self._pool,
                                       stage_host=self.stage_host, sizes=sizes)
        return torch.cat([r.view(tensor.shape) for r in rows], dim=dim)

    def gather_objects(self, obj: Any, *, dst: int) -> list[Any] | None:
        out: list[Any] | None = [None] * self.world_size if self.rank == dst else None
        dist.gather_object(obj, out, dst=dst, group=self._bridge_pg)
        return out

    def barrier(self) -> None:
        dist.barrier(group=self._bridge_pg)
