"""The hierarchical all-reduce for groups whose ranks span several native "islands".

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

Reduce-scatters, all-gathers, reduces and broadcasts over such groups run the two-level schedule of
:mod:`hethub.islands` (native inside each island, only each owner's chunk over the bridge:
``comm/island_exchange.py``); a group's route (its islands, segments and their process groups) is
built in ``comm/routes.py``. This module re-exports both for the bridge.

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

from typing import Any

import torch
import torch.distributed as dist

from hethub.comm.island_exchange import (
    StartedBroadcast,
    StartedReduce,
    hierarchical_all_gather,
    hierarchical_reduce_scatter,
)
from hethub.comm.reduce_scatter import all_gather_into, reduce_scatter_into
from hethub.comm.routes import REDUCTION_TAG, GroupKey, GroupMaker, Route, bridge_transport, build_route, segment_owners
from hethub.comm.staging import HostPool
from hethub.comm.transport import Transport
from hethub.islands import HOST_BACKENDS, padded_numel

# Re-exported: the bridge (comm/bridge.py) builds routes and runs every collective from here.
__all__ = ["DEFAULT_CHUNK_BYTES", "GroupMaker", "Route", "StartedAllReduce", "StartedBroadcast", "StartedReduce",
           "bridged_all_reduce", "build_route", "hierarchical_all_gather", "hierarchical_all_reduce",
           "hierarchical_reduce_scatter"]

DEFAULT_CHUNK_BYTES = 4 * 1024 * 1024  # big enough to amortise gloo's per-op latency, small enough to overlap


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
        route, transport = self.route, bridge_transport(self.route)
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
