"""The hierarchical reduce-scatter, all-gather, reduce and broadcast over groups that span islands:
the two-level schedule of :mod:`hethub.islands` (native inside each island, only each owner's chunk
over the bridge), the ZeRO stages' collectives (``runtime/zero.py``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from hethub.comm.reduce_scatter import reduce_scatter_into
from hethub.comm.routes import BROADCAST_TAG, REDUCTION_TAG, Route, bridge_transport
from hethub.comm.staging import HostPool


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


def _staged_p2p(flat: torch.Tensor, *, peer: int, send: bool, route: Route, pool: HostPool,
                stage_host: bool, tag: int = 0) -> tuple[Any, torch.Tensor | None]:
    """isend/irecv of a contiguous 1-D tensor over the route's transport (its group of all members),
    through a pooled host copy unless the transport reads the tensor's memory and ``stage_host`` is
    off. Returns (work, host copy or None); a received host copy must be copied into ``flat`` after
    the wait."""
    transport = bridge_transport(route)

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
        # The island's blocks in member order, a permuted copy of the buffer (predict/sync_sharded.py counts it).
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
