"""The pipeline executor's point-to-point messages: one lane per direction and kind, sends in flight.

Lanes: a rank's activations to a peer, and its gradients to a peer, each run on a communicator of
their own (``layout.Topology.p2p_lanes``, ``Communicator.create_p2p_lanes``). NCCL runs one
communicator's operations in the order a rank issues them, on a stream of its own, matches a pair's
sends and receives in that order, and completes a send larger than its internal buffering only
when the matching receive runs. On one shared communicator, a send queued ahead of a receive the
peer waits on hangs both ranks (send mb 2, then receive the gradient of mb 1, while the peer sends
that gradient before receiving mb 2); gloo buffers and hides it. On a lane, one stage sends in the
order it produces and the other receives in the order it consumes, which the registry's orders
make the same sequence for every schedule (virtual stages and their wrap hop included), and no
other message can queue in between. ``tests/unit/test_nccl_replay.py`` replays what this posts for
every schedule and plan shape under a model of NCCL's rules.

Overlap: op i + 1's receive is posted before op i runs, so its transfer overlaps op i's compute; op
i's sends are posted after it and never waited before the next op, so they overlap what follows
(the predictor's ``async`` p2p mode). A send's buffer is released at the op whose receive proves it
has arrived (``schedules.messages.send_releases``), where waiting never blocks, and every send left
is waited at the step's end.

Lifetimes (what the memory model's point-to-point term counts, ``schedules.messages.peak_buffer_bytes``):
a send buffer lives until its release op; a receive buffer from one op before its op until the op
consumes it (a forward's input then belongs to the saved activations).

Tags name (micro-batch, consumer chunk, direction); NCCL ignores them (order matches), gloo and
the bridge's host path match by them.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

import torch

from hethub.schedules import Op
from hethub.schedules.messages import send_releases

# The lanes of the two message kinds (layout.Topology.p2p_lanes).
FWD_LANE, BWD_LANE = "fwd", "bwd"


def fwd_tag(mb: int, chunk: int = 0, chunks: int = 1) -> int:
    """Tag of micro-batch ``mb``'s activation into model chunk ``chunk`` of the receiving stage (the
    last stage's chunk c sends to the first's chunk c + 1, so tags name the consumer's chunk)."""
    return 2 * (mb * chunks + chunk)


def bwd_tag(mb: int, chunk: int = 0, chunks: int = 1) -> int:
    """Tag of the gradient of that activation, sent back by the consuming chunk ``chunk``."""
    return 2 * (mb * chunks + chunk) + 1


def op_peers(ex: Any, op: str, chunk: int) -> tuple[int | None, tuple[int, ...]]:
    """(rank op ``op`` of chunk ``chunk`` receives from or None, ranks it sends to), for anything with
    the executor's ``place``, ``first``, ``last`` (and ``chunks``): a forward receives its input and
    sends its output; a backward receives its output gradient and sends its input gradient; W neither."""
    if op == "W":
        return None, ()
    pl = ex.place
    if getattr(ex, "chunks", 1) > 1:
        return pl.fwd_peers(chunk) if op == "F" else pl.bwd_peers(chunk)
    if op == "F":
        return (None if ex.first else pl.fwd_recv_from), (() if ex.last else pl.fwd_send_to)
    return (None if ex.last else pl.bwd_recv_from), (() if ex.first else pl.bwd_send_to)


@dataclass(frozen=True)
class Send:
    """One message an op sends: ``tensor`` to rank ``peer`` under ``tag``."""

    tensor: torch.Tensor
    peer: int
    tag: int


def stage_orders(ex: Any) -> list[tuple[Op, ...]]:
    """Every stage's op order in this pipeline as this step runs it (forward-only steps keep each
    stage's forwards), for ``send_releases``."""
    kinds = {op.kind for op in ex.ops}
    st = ex.place.stage
    return [tuple(op for op in ex.schedule.ops(stage=s, num_stages=st.num_stages,
                                               num_micro_batches=ex.place.num_micro_batches) if op.kind in kinds)
            for s in range(st.num_stages)]


class Exchange:
    """One step's messages of one rank: :meth:`post_receive` one op ahead, :meth:`take` before an op,
    :meth:`send` after it, :meth:`finish` at the step's end."""

    def __init__(self, ex: Any, trace: Any) -> None:
        self.ex, self.trace = ex, trace
        self.posted: dict[int, tuple[Any, torch.Tensor, Any]] = {}  # op index -> (work, buffer, hop)
        orders = stage_orders(ex)
        orders[ex.place.stage.stage] = tuple(ex.ops)
        self.releases = send_releases(orders, ex.place.stage.stage, chunks=ex.chunks)
        self.in_flight: dict[Op | None, list[tuple[Any, torch.Tensor]]] = {}  # by release op

    def post_receive(self, j: int) -> None:
        """Post op j's receive (if it has one) on its lane."""
        ex = self.ex
        if j >= len(ex.ops):
            return
        op, mb, chunk = ex.ops[j]
        src = op_peers(ex, op, chunk)[0]
        if src is None:
            return  # the first virtual stage's F, the last's B, W
        v = ex.chunks
        if op == "F":
            tag, lane = fwd_tag(mb, chunk, v), FWD_LANE
            dtype = ex.wrap_dtype if ex.first and chunk > 0 else ex.in_dtype
        else:  # from the consumer's chunk
            tag, lane = bwd_tag(mb, chunk + 1 if ex.last else chunk, v), BWD_LANE
            dtype = ex.out_dtype
        hop = ex.hop_into(op, chunk)
        buf = torch.empty(ex.messages.recv_shape(hop), dtype=dtype, device=ex.device)
        self.posted[j] = (ex.comm.irecv(buf, src=src, tag=tag, lane=lane), buf, hop)
        ex.buffers.track(buf)

    def take(self, i: int) -> torch.Tensor | None:
        """Op i's received tensor (whole: pieces are all-gathered here), or None; then the sends op i's
        receive proves arrived are released."""
        got = None
        if i in self.posted:
            work, buf, hop = self.posted.pop(i)
            w = time.perf_counter()
            work.wait()
            got = self.ex.messages.arrived(buf, hop)
            if got is not buf:
                self.ex.buffers.track(got)
            self.trace.recv_wait_s += time.perf_counter() - w
        self._release(self.in_flight.pop(self.ex.ops[i], []))
        return got

    def send(self, op: Op, sends: list[Send]) -> None:
        """Post ``op``'s sends, each on its lane, kept (and their buffers alive) until released."""
        if not sends:
            return
        lane = FWD_LANE if op.kind == "F" else BWD_LANE
        works = [(self.ex.comm.isend(s.tensor, dst=s.peer, tag=s.tag, lane=lane), s.tensor) for s in sends]
        self.in_flight.setdefault(self.releases.get(op), []).extend(works)
        self.ex.buffers.track(*(s.tensor for s in sends))
        _let_sends_start()

    def finish(self) -> None:
        """Wait for every send still in flight (the step's end)."""
        for works in self.in_flight.values():
            self._release(works)
        self.in_flight = {}

    def _release(self, works: list[tuple[Any, torch.Tensor]]) -> None:
        w = time.perf_counter()
        for work, _ in works:
            work.wait()
        self.trace.send_wait_s += time.perf_counter() - w


def _let_sends_start() -> None:
    """Give up the core once after posting sends. gloo moves the data on a helper thread, which the
    scheduler wakes on this (busy) core; without a yield it may wait a whole time slice behind the
    next forward or backward while the receiver idles (hand-offs of 1-10 ms seen in traces on a
    2-core host, well under 1 ms with it)."""
    if hasattr(os, "sched_yield"):
        os.sched_yield()
