"""Group layout and the hierarchical collectives for groups whose ranks span several native "islands".

An *island* is a set of ranks whose native backend can talk among itself (all NVIDIA ranks over
NCCL, all Ascend ranks over HCCL, every host-memory rank over gloo). A group of the runtime (a
data-parallel group, the world) may span islands; then an all-reduce runs the two-level algorithm
of NCCL's and Horovod's hierarchical all-reduce (:func:`hethub.islands.shard_segments`, generalised
to islands of unequal size):

1. a native reduce-scatter inside each island: each member ends with its island's partial sum of
   its shard;
2. each segment (a piece inside one shard of every island) is all-reduced over the bridge's
   transport among its owners, one member per island, all members exchanging their own segments
   at once (staged through host buffers in chunks for memory the transport cannot read);
3. a native all-gather inside each island.

Every member moves what a flat ring moves; over the bridge, a member of a k-rank island carries 1/k
of the buffer, where a leader-based scheme sends the whole buffer through one rank per island.

Reduce-scatters and all-gathers over such groups run the two-level schedule of
:mod:`hethub.islands` (native inside each island, only each owner's chunk over the bridge).

The gradient sync starts its reductions while the backward still runs (``runtime/grad_buffer.py``):
:class:`StartedAllReduce` and :class:`StartedReduce` (one owner's part of the two-level
reduce-scatter) post the native island step asynchronously when created and run the bridge step
when waited on, after the backward.

Every rank builds the same groups in the same order (``new_group`` is collective over the world),
including groups it is not a member of.

Exactness: a sum is the same in any order only when no rounding happens (integer-valued floats,
integers, max). For general floating-point data the hierarchical order differs from gloo's flat ring,
so results can differ from a plain all-reduce in the last bits; every rank still ends with identical
values (a segment's owners share the transport's result, their islands gather it).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from hethub.comm.backends import DEVICE_OF_BACKEND
from hethub.comm.reduce_scatter import all_gather_into, reduce_scatter_into
from hethub.comm.staging import HostPool
from hethub.comm.transport import Transport
from hethub.islands import HOST_BACKENDS, Exchange, Segment, exchange, padded_numel, shard_segments

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


# ---- host staging -----------------------------------------------------------------------------------
def _wait_copies(tensor: torch.Tensor) -> None:
    if tensor.is_cuda:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(tensor.device))
        event.synchronize()


# ---- the algorithms ---------------------------------------------------------------------------------
def bridged_all_reduce(tensor: torch.Tensor, *, group: Any, op: Any, chunk_bytes: int, pool: HostPool,
                       stage: bool, transport: Transport) -> None:
    """In-place all-reduce of a contiguous tensor among ``group`` (a group of ``transport``) in chunks
    of ``chunk_bytes``.

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
        works.append((transport.all_reduce(host[start:end], op=op, group=group), start, end))
    for work, start, end in works:
        work.wait()
        if stage:
            flat[start:end].copy_(host[start:end], non_blocking=flat.is_cuda)
    if stage:
        _wait_copies(flat)  # the buffer goes back to the pool: no copy may still read it
        pool.give(host, like=flat)


def hierarchical_all_reduce(tensor: torch.Tensor, *, route: Route, rank: int, op: Any, chunk_bytes: int,
                            pool: HostPool, stage_host: bool) -> None:
    """In-place all-reduce over a bridged route: island reduce-scatter, each segment among its owners
    over the bridge, island all-gather (module doc)."""
    StartedAllReduce(tensor, route=route, rank=rank, op=op, chunk_bytes=chunk_bytes, pool=pool,
                     stage_host=stage_host).wait()


# Bridge messages of gradient reductions carry this tag, apart from the pipeline's (which count up
# from 0 per micro-batch): a reduction may finish while a peer's pipeline messages are still about.
REDUCTION_TAG = 1 << 24


class StartedAllReduce:
    """A bridged all-reduce whose first step, the native reduce-scatter inside this rank's island, is
    posted (asynchronously) at construction; :meth:`wait` runs the rest (this rank's segments over
    the bridge, the island's all-gather). Ranks must wait on their started reductions in one order,
    the same on every rank (the gradient sync waits in bucket order), so the later steps pair up."""

    def __init__(self, tensor: torch.Tensor, *, route: Route, rank: int, op: Any, chunk_bytes: int,
                 pool: HostPool, stage_host: bool) -> None:
        local = route.local
        if local is None:
            raise RuntimeError(f"rank {rank} is not a member of group {route.members}")
        self.tensor, self.local, self.route, self.rank, self.op = tensor, local, route, rank, op
        self.chunk_bytes, self.pool, self.stage_host = chunk_bytes, pool, stage_host
        flat = tensor.reshape(-1) if tensor.is_contiguous() else tensor.contiguous().view(-1)
        self.padded = padded_numel(flat.numel(), [len(isl) for isl in route.islands])
        if self.padded == flat.numel():
            self.buf = flat  # reduced in place (a view of ``tensor`` when it is contiguous)
        else:
            self.buf = flat.new_zeros(self.padded)
            self.buf[:flat.numel()].copy_(flat)
        k = len(local.ranks)
        self.index = local.ranks.index(rank)
        shard_numel = self.padded // k
        # Host islands (gloo) run the island steps as rings of point-to-point messages in wait():
        # gloo's reduce-scatter and all-gather cost about a whole all-reduce each; its isend/irecv
        # move only the shard. Accelerator islands post the native reduce-scatter now.
        self.ring = k > 1 and local.backend in HOST_BACKENDS
        self.shard = self.buf[self.index * shard_numel:(self.index + 1) * shard_numel]
        self.first = None
        if k > 1 and not self.ring:
            self.native = self.buf.new_empty(shard_numel)
            self.first = reduce_scatter_into(self.native, self.buf, group=local.pg_for(self.buf), op=op,
                                             async_op=True)

    def wait(self) -> None:
        local, k = self.local, len(self.local.ranks)
        if self.ring:
            _ring_reduce_scatter(self.buf, ranks=local.ranks, index=self.index, op=self.op, group=local.host_pg)
        elif self.first is not None:
            self.first.wait()
            self.shard.copy_(self.native)
        route, transport = self.route, _transport(self.route)
        assert route.segment_pgs is not None
        stage = self.stage_host or self.buf.device.type not in transport.caps.device_types
        offset = self.index * self.shard.numel()
        for seg in route.segments:
            owners = segment_owners(seg, route.islands)
            if self.rank not in owners:
                continue
            start, end = seg.bounds(self.padded)
            bridged_all_reduce(self.shard[start - offset:end - offset], group=route.segment_pgs[owners], op=self.op,
                               chunk_bytes=self.chunk_bytes, pool=self.pool, stage=stage, transport=transport)
        if self.ring:
            _ring_all_gather(self.buf, ranks=local.ranks, index=self.index, group=local.host_pg)
        elif k > 1:
            all_gather_into(self.buf, self.shard.clone(), group=local.pg_for(self.buf))
        numel = self.tensor.numel()
        if self.buf.data_ptr() != self.tensor.data_ptr() or not self.tensor.is_contiguous():
            self.tensor.copy_(self.buf[:numel].view(self.tensor.shape))


def _combine(acc: torch.Tensor, other: torch.Tensor, *, op: Any, out: torch.Tensor) -> None:
    if op == dist.ReduceOp.MAX:
        torch.maximum(acc, other, out=out)
    else:
        torch.add(acc, other, out=out)


def _ring_reduce_scatter(buf: torch.Tensor, *, ranks: GroupKey, index: int, op: Any, group: Any) -> None:
    """Reduce ``buf`` (``len(ranks)`` equal chunks) over ``ranks`` so that chunk ``index`` holds the
    reduction on this member, as a ring of isend/irecv (each step one chunk to the next member); each
    chunk is reduced once, by its owner's ring order, so owners' results are final."""
    k = len(ranks)
    chunks = buf.view(k, -1)
    nxt, prev = ranks[(index + 1) % k], ranks[(index - 1) % k]
    outgoing = chunks[(index - 1) % k]
    incoming = torch.empty_like(outgoing)
    acc = torch.empty_like(outgoing) if k > 2 else None
    for step in range(k - 1):
        works = [dist.isend(outgoing, dst=nxt, tag=REDUCTION_TAG, group=group),
                 dist.irecv(incoming, src=prev, tag=REDUCTION_TAG, group=group)]
        for w in works:
            w.wait()
        target = (index - 2 - step) % k
        if step == k - 2:
            _combine(incoming, chunks[target], op=op, out=chunks[target])
        else:
            assert acc is not None
            _combine(incoming, chunks[target], op=op, out=acc)
            outgoing, acc = acc, outgoing if step > 0 else torch.empty_like(acc)


def _ring_all_gather(buf: torch.Tensor, *, ranks: GroupKey, index: int, group: Any) -> None:
    """Every member's chunk ``index`` of ``buf`` copied into every member's ``buf``, as a ring of
    isend/irecv straight into place."""
    k = len(ranks)
    chunks = buf.view(k, -1)
    nxt, prev = ranks[(index + 1) % k], ranks[(index - 1) % k]
    for step in range(k - 1):
        works = [dist.isend(chunks[(index - step) % k], dst=nxt, tag=REDUCTION_TAG, group=group),
                 dist.irecv(chunks[(index - step - 1) % k], src=prev, tag=REDUCTION_TAG, group=group)]
        for w in works:
            w.wait()


class StartedReduce:
    """A sum of ``tensor`` over a bridged route onto member ``dst`` (in place there; other members'
    tensors are scratch), the hierarchical reduce-scatter of :mod:`hethub.islands` for one owner:
    each island reduces natively onto its proxy for ``dst`` (``dst`` itself in its own island),
    posted at construction; :meth:`wait` sends every other island's partial sum from its proxy to
    ``dst`` over the bridge, and ``dst`` adds them in island order (the same sum on every run). Waits
    in one order on every rank, as for :class:`StartedAllReduce`.

    ``eager``: the bridge's messages are posted at construction too (a proxy first waits for its
    island's reduce), so a member waiting for the sum needs no other member to have waited: ZeRO-2
    finishes its oldest reduction while later micro-batches still run, at points that differ per
    member (``runtime/zero_grads.py``)."""

    def __init__(self, tensor: torch.Tensor, *, route: Route, rank: int, dst: int, pool: HostPool,
                 stage_host: bool, eager: bool = False) -> None:
        local, ex = route.local, route.exchange
        if local is None:
            raise RuntimeError(f"rank {rank} is not a member of group {route.members}")
        if not tensor.is_contiguous():
            raise ValueError("a started reduce needs a contiguous tensor (it is reduced in place)")
        self.tensor, self.route, self.rank, self.dst, self.pool, self.stage_host = tensor, route, rank, dst, pool, \
            stage_host
        me = ex.island_index(rank)
        self.root = ex.proxy(dst, me)
        self.first = (dist.reduce(tensor, dst=self.root, group=local.pg_for(tensor), async_op=True)
                      if len(local.ranks) > 1 else None)
        self.posted: list[tuple[torch.Tensor | None, Any, torch.Tensor | None]] | None = None
        if eager:
            self._post()

    def _post(self) -> None:
        """The island step done, post the bridge's messages: (part received or None, work, host copy)."""
        ex, flat = self.route.exchange, self.tensor.view(-1)
        if self.first is not None:
            self.first.wait()
        mine = ex.island_index(self.rank)
        self.posted = []
        if self.rank == self.dst:
            for i in (i for i in range(len(ex.islands)) if i != mine):
                part = flat.new_empty(flat.numel())
                work, host = _staged_p2p(part, peer=ex.proxy(self.dst, i), send=False, route=self.route,
                                         pool=self.pool, stage_host=self.stage_host, tag=REDUCTION_TAG)
                self.posted.append((part, work, host))
        elif self.rank == self.root:
            work, host = _staged_p2p(flat, peer=self.dst, send=True, route=self.route, pool=self.pool,
                                     stage_host=self.stage_host, tag=REDUCTION_TAG)
            self.posted.append((None, work, host))

    def wait(self) -> None:
        if self.posted is None:
            self._post()
        assert self.posted is not None
        flat = self.tensor.view(-1)
        for part, work, host in self.posted:
            work.wait()
            if part is None:
                if host is not None:
                    self.pool.give(host, like=flat)
                continue
            if host is not None:
                part.copy_(host)
                self.pool.give(host, like=part)
            flat.add_(part)  # island order: the same sum on every run
        self.posted = []


class StartedBroadcast:
    """Member ``src``'s ``tensor`` copied into every member's over a bridged route: ``src`` sends it to
    its proxy in every other island over the bridge and broadcasts it natively in its own island,
    posted at construction (the other islands' proxies post their receives then); :meth:`wait` runs
    each other island's native broadcast from its proxy. Waits in one order on every rank, as for
    :class:`StartedAllReduce`."""

    def __init__(self, tensor: torch.Tensor, *, route: Route, rank: int, src: int, pool: HostPool,
                 stage_host: bool) -> None:
        local, ex = route.local, route.exchange
        if local is None:
            raise RuntimeError(f"rank {rank} is not a member of group {route.members}")
        if not tensor.is_contiguous():
            raise ValueError("a started broadcast needs a contiguous tensor (it is written in place)")
        self.tensor, self.local, self.pool = tensor, local, pool
        flat = tensor.view(-1)
        mine, home = ex.island_index(rank), ex.island_index(src)
        self.root = src if mine == home else ex.proxy(src, mine)
        self.sends: list[tuple[Any, torch.Tensor | None]] = []
        self.recv: tuple[Any, torch.Tensor | None] | None = None
        self.native: Any = None
        if rank == src:
            self.sends = [_staged_p2p(flat, peer=ex.proxy(src, i), send=True, route=route, pool=pool,
                                      stage_host=stage_host, tag=BROADCAST_TAG)
                          for i in range(len(ex.islands)) if i != home]
        elif rank == self.root:
            self.recv = _staged_p2p(flat, peer=src, send=False, route=route, pool=pool,
                                    stage_host=stage_host, tag=BROADCAST_TAG)
        if mine == home and len(local.ranks) > 1:
            self.native = dist.broadcast(tensor, src=src, group=local.pg_for(tensor), async_op=True)

    def wait(self) -> None:
        flat = self.tensor.view(-1)
        for work, host in self.sends:
            work.wait()
            if host is not None:
                self.pool.give(host, like=flat)
        if self.recv is not None:
            work, host = self.recv
            work.wait()
            if host is not None:
                flat.copy_(host)
                self.pool.give(host, like=flat)
        if self.native is not None:
            self.native.wait()
        elif len(self.local.ranks) > 1:  # another island's: from its proxy, once that has the data
            dist.broadcast(self.tensor, src=self.root, group=self.local.pg_for(self.tensor))


# Bridge messages of parameter broadcasts (ZeRO-3's gathers), apart from reductions' and the pipeline's.
BROADCAST_TAG = 1 << 23


# ---- the sharded (reduce-scatter / all-gather) exchange ---------------------------------------------
def _transport(route: Route) -> Transport:
    if route.transport is None:
        raise RuntimeError(f"group {route.members} spans islands but its route has no transport")
    return route.transport


def _staged_p2p(flat: torch.Tensor, *, peer: int, send: bool, route: Route, pool: HostPool,
                stage_host: bool, tag: int = 0) -> tuple[Any, torch.Tensor | None]:
    """isend/irecv of a contiguous 1-D tensor over the route's transport (its group of all members),
    through a pooled host copy unless the transport reads the tensor's memory and ``stage_host`` is
    off. Returns (work, host copy or None); a received host copy must be copied into ``flat`` after
    the wait."""
    transport = _transport(route)

    def move(buf: torch.Tensor) -> Any:
        if send:
            return transport.isend(buf, dst=peer, tag=tag, group=route.host_pg)
        return transport.irecv(buf, src=peer, tag=tag, group=route.host_pg)

    if flat.device.type in transport.caps.device_types and not stage_host:
        return move(flat), None
    host = pool.take(flat)
    if send:
        host.copy_(flat)  # blocking for device tensors: on the host when this returns
    return move(host), host


def hierarchical_reduce_scatter(tensor: torch.Tensor, *, route: Route, rank: int, pool: HostPool,
                                stage_host: bool, sizes: Sequence[int] | None = None) -> torch.Tensor:
    """Sum a 1-D ``tensor`` of ``len(route.members)`` equal chunks over a bridged route; return this
    member's chunk (a new tensor). Native reduce-scatter of each island's blocks, then each proxy sends
    its proxied partial sums to their owners over the bridge (:mod:`hethub.islands`). ``sizes``: each
    member's real chunk length (the rest is padding, left out of the bridge's messages; it comes
    back as this island's partial sums)."""
    local, ex = route.local, route.exchange
    if local is None:
        raise RuntimeError(f"rank {rank} is not a member of group {route.members}")
    chunks = tensor.contiguous().view(len(ex.members), -1)
    index = {m: i for i, m in enumerate(ex.members)}
    real = {m: chunks.shape[1] if sizes is None else int(sizes[i]) for i, m in enumerate(ex.members)}
    slots = ex.slots[rank]
    me = ex.island_index(rank)
    # Receives are posted first, so that proxies which need no island step (one-rank islands) can
    # send while this island reduces (the overlap ``Exchange.pass_time_s`` prices).
    partials = [chunks.new_empty(real[rank]) for _ in range(len(ex.islands) - 1)]
    recvs = [_staged_p2p(part, peer=ex.proxy(rank, i), send=False, route=route, pool=pool,
                         stage_host=stage_host)
             for part, i in zip(partials, (i for i in range(len(ex.islands)) if i != me), strict=True)]
    island = local.ranks
    if len(island) > 1:
        # The island's blocks in member order, a permuted copy of the buffer (predict/sync.py counts it).
        buf = chunks.new_zeros(len(island) * slots, chunks.shape[1])
        for j, m in enumerate(island):
            for t, owner in enumerate(ex.blocks[m]):
                buf[j * slots + t] = chunks[index[owner]]
        block = chunks.new_empty(slots, chunks.shape[1])
        reduce_scatter_into(block.view(-1), buf.view(-1), group=local.pg_for(tensor))
        del buf
        rows = list(block.unbind(0))
    else:  # alone in its island: the block is the buffer's own rows, no copy
        rows = [chunks[index[owner]] for owner in ex.blocks[rank]]
    sends = [(rows[t][:real[owner]], *_staged_p2p(rows[t][:real[owner]], peer=owner, send=True,
                                                  route=route, pool=pool, stage_host=stage_host))
             for t, owner in enumerate(ex.blocks[rank]) if t > 0]
    out = rows[0].clone()
    for part, (work, host) in zip(partials, recvs, strict=True):
        work.wait()
        if host is not None:
            part.copy_(host)
            pool.give(host, like=part)
        out[:real[rank]].add_(part)  # other islands' partial sums, in island order: the same on every run
    for sent, work, host in sends:
        work.wait()
        if host is not None:
            pool.give(host, like=sent)
    return out


def hierarchical_all_gather(tensor: torch.Tensor, *, route: Route, rank: int, pool: HostPool,
                            stage_host: bool, sizes: Sequence[int] | None = None) -> torch.Tensor:
    """Every member's ``tensor`` (equal shapes), as rows of a ``(len(members), numel)`` tensor in member
    order: each owner sends its chunk to its proxy in every other island over the bridge, then each
    island all-gathers its blocks natively (:mod:`hethub.islands`). ``sizes``: each member's real
    length of its 1-D chunk; only that crosses the bridge (the rest of a proxied row is zeros)."""
    local, ex = route.local, route.exchange
    if local is None:
        raise RuntimeError(f"rank {rank} is not a member of group {route.members}")
    flat = tensor.contiguous().view(-1)
    real = {m: flat.numel() if sizes is None else int(sizes[i]) for i, m in enumerate(ex.members)}
    slots = ex.slots[rank]
    me = ex.island_index(rank)
    mine = flat[:real[rank]]
    sends = [_staged_p2p(mine, peer=ex.proxy(rank, i), send=True, route=route, pool=pool,
                         stage_host=stage_host) for i in range(len(ex.islands)) if i != me]
    block = flat.new_zeros(slots, flat.numel())
    block[0] = flat
    recvs = [(block[t][:real[owner]], *_staged_p2p(block[t][:real[owner]], peer=owner, send=False,
                                                   route=route, pool=pool, stage_host=stage_host))
             for t, owner in enumerate(ex.blocks[rank]) if t > 0]
    for row, work, host in recvs:
        work.wait()
        if host is not None:
            row.copy_(host)
            pool.give(host, like=row)
    for work, host in sends:
        work.wait()
        if host is not None:
            pool.give(host, like=mine)
    island = local.ranks
    if len(island) > 1:
        parts = [torch.empty_like(block) for _ in island]
        dist.all_gather(parts, block, group=local.pg_for(tensor))
    else:
        parts = [block]
    out = flat.new_empty(len(ex.members), flat.numel())
    index = {m: i for i, m in enumerate(ex.members)}
    for m, part in zip(island, parts, strict=True):
        for t, owner in enumerate(ex.blocks[m]):
            out[index[owner]] = part[t]
    return out
