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

Overlap: op i + 1's receive is posted right after op i's is taken, before op i runs, so its transfer
overlaps op i's compute; op i's sends are posted after it and never waited on before they are
complete, so they overlap what follows (the predictor's ``async`` p2p mode).

Lifetimes (what the memory model's point-to-point term counts, ``schedules.messages.peak_buffer_bytes``):
a send larger than NCCL's buffering completes when the peer runs the matching receive, which it
posts one op ahead, so it is complete once the peer has started the op before the one that
consumes it and the transfer is over. Before and after every op the sends observed complete
(``Work.is_completed``, a query that never blocks; under NCCL it reads the send's event) are waited
on, which returns at once, and dropped, so their memory goes back to the allocator; the rest are
waited on at the step's end. gloo's send works report completion only once waited on
(``Communicator.send_completes_alone``): there a send is waited on after the op from which the
stage knows, from what it received, that the peer posted the receive
(``schedules.messages.send_releases``), which costs at most the rest of the transfer. A receive
buffer lives from just after the previous op's receive arrived until its op consumes it (a
forward's input then belongs to the saved activations), so a rank never holds two receives that
wait.

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
    stage's forwards; this stage's own as its executor holds it, which re-balancing may reorder),
    for ``send_releases``."""
    kinds = {op.kind for op in ex.ops}
    st = ex.place.stage
    orders = [tuple(op for op in ex.schedule.ops(stage=s, num_stages=st.num_stages,
                                                 num_micro_batches=ex.place.num_micro_batches) if op.kind in kinds)
              for s in range(st.num_stages)]
    orders[st.stage] = tuple(ex.ops)
    return orders


@dataclass
class _InFlight:
    """A posted send: its work, its buffer, the op index from which this rank knows the peer posted
    the matching receive (None: not before the step's end) and whether its work reports completion
    by itself (``Communicator.send_completes_alone``)."""

    work: Any
    tensor: torch.Tensor
    known_at: int | None
    reports: bool


class Exchange:
    """One step's messages of one rank: :meth:`take` op i's receive, then :meth:`post_receive` op
    i + 1's; :meth:`release` before and after op i, :meth:`send` its sends; :meth:`finish` at the
    step's end."""

    def __init__(self, ex: Any, trace: Any) -> None:
        self.ex, self.trace = ex, trace
        self.posted: dict[int, tuple[Any, torch.Tensor, Any]] = {}  # op index -> (work, buffer, hop)
        index = {op: i for i, op in enumerate(ex.ops)}
        releases = send_releases(stage_orders(ex), ex.place.stage.stage, chunks=ex.chunks)
        self.known_at = {op: None if rel is None else index[rel] for op, rel in releases.items()}
        self.in_flight: list[_InFlight] = []  # sends not yet handed back, in posting order

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
        """Op i's received tensor (whole: pieces are all-gathered here), or None."""
        if i not in self.posted:
            return None
        work, buf, hop = self.posted.pop(i)
        w = time.perf_counter()
        work.wait()
        got = self.ex.messages.arrived(buf, hop)
        if got is not buf:
            self.ex.buffers.track(got)
        self.trace.recv_wait_s += time.perf_counter() - w
        return got

    def send(self, op: Op, sends: list[Send]) -> None:
        """Post ``op``'s sends, each on its lane, kept (and their buffers alive) until released."""
        if not sends:
            return
        ex = self.ex
        lane = FWD_LANE if op.kind == "F" else BWD_LANE
        known_at = self.known_at.get(op)
        self.in_flight += [
            _InFlight(ex.comm.isend(s.tensor, dst=s.peer, tag=s.tag, lane=lane), s.tensor, known_at,
                      ex.comm.send_completes_alone(s.peer, device=s.tensor.device, lane=lane)) for s in sends]
        ex.buffers.track(*(s.tensor for s in sends))
        _let_sends_start()

    def release(self, *, ran: int | None = None) -> None:
        """Hand back every send that is complete: observed so (``Work.is_completed``, a query that
        never blocks; under NCCL it queries the send's event), or, on a backend whose sends report
        completion only once waited on (gloo), known so: once op ``ran`` (just run) has reached the
        send's release op, the peer has posted the matching receive, and waiting costs at most the
        rest of the transfer. Waiting on a complete send returns at once (under NCCL it also lets
        the allocator reuse the buffer on the compute stream); nothing keeps the buffer after it."""
        done, pending = [], []
        for s in self.in_flight:
            known = not s.reports and ran is not None and s.known_at is not None and ran >= s.known_at
            (done if known or s.work.is_completed() else pending).append(s)
        self.in_flight = pending
        self._wait(done)

    def finish(self) -> None:
        """Wait for every send still in flight (the step's end)."""
        self._wait(self.in_flight)
        self.in_flight = []

    def _wait(self, sends: list[_InFlight]) -> None:
        w = time.perf_counter()
        for s in sends:
            s.work.wait()
        self.trace.send_wait_s += time.perf_counter() - w


def _let_sends_start() -> None:
    """Give up the core once after posting sends. gloo moves the data on a helper thread, which the
    scheduler wakes on this (busy) core; without a yield it may wait a whole time slice behind the
    next forward or backward while the receiver idles (hand-offs of 1-10 ms seen in traces on a
    2-core host, well under 1 ms with it)."""
    if hasattr(os, "sched_yield"):
        os.sched_yield()
