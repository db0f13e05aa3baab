"""The pipeline executor's point-to-point messages: after each op one batch, NCCL-safe by construction.

After op i of its schedule a rank posts one batch (``Communicator.batch_isend_irecv``) of everything
op i sends (a forward's output, a backward's input gradient, to every rank that needs it) and the
receive op i + 1 needs, and waits for the whole batch before op i + 1 runs: Megatron-LM's
``send_forward_recv_backward`` / ``send_backward_recv_forward`` and torch's ``Schedule1F1B``,
generalised to any registered order (GPipe, ZB-H1's W ops, interleaved chunks and their wrap hops).

Why: NCCL runs a rank's operations on one communicator in the order issued, matches a pair's sends
and receives in that order, and completes a send larger than its internal buffering only when the
matching receive runs. Sends posted on their own ahead of a receive the peer is waiting on (send
mb 2, then receive the gradient of mb 1, while the peer sends that gradient before receiving mb 2)
hang both ranks; gloo buffers and hides it. Inside one batch (one NCCL group) the operations
progress together, so no completion depends on a backend buffering a send, and one batch per op
with a wait before the next op keeps each pair's batches in the same order on both sides.
``tests/unit/test_nccl_replay.py`` replays what this posts for every schedule and plan shape
(TP hops, uneven replicas, interleaved chunks, bridged hops) under a model of NCCL's rules.

Not yet for virtual stages: per-op batches waited before the next op hang interleaved pipelines of
2 stages with 4+ micro-batches (and 3 stages with 6+) on any backend. There the two stages'
messages cross in both directions between the same ranks (the wrap hop beside the backward hop)
and each side would wait for its own send before receiving what the other sends first; Megatron
exchanges both directions of a 1F1B pair in one batch, which the registry's interleaved order does
not line up across ranks. So interleaved stages keep sends in their own batches, not waited before
the next op (gloo-safe, as before; under NCCL the replay test's known failures list where it
hangs). The fix to come: a communicator per direction of each rank pair, on which each side's
sends and receives already run in one order.

Lifetimes (what the memory model's point-to-point term counts: ``predict/memory``): a send buffer
lives until its batch completes, before the next op runs; a receive buffer until its op consumes it
(a forward's input then belongs to the saved activations). So besides the held activations a rank
holds at most one op's sends and one receive.

Tags name (micro-batch, consumer chunk, direction); NCCL ignores them (order matches), gloo and
the bridge's host path match by them.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from hethub.comm.communicator import P2P


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


class Exchange:
    """One step's messages of one rank: :meth:`post` after each op, :meth:`take` before the next."""

    def __init__(self, ex: Any, trace: Any) -> None:
        self.ex, self.trace = ex, trace
        self.batch: Any = None
        self.recv: P2P | None = None
        self.hop: Any = None
        # Virtual stages keep the earlier order for now: sends in batches of their own, not waited
        # before the next op (released once complete, all waited at the step's end), since waiting
        # for them per op hangs interleaved pipelines of 2-3 stages on any backend (module doc).
        self.detached = getattr(ex, "chunks", 1) > 1
        self.in_flight: list[Any] = []

    def _receive(self, j: int) -> tuple[P2P, Any] | None:
        """The receive op j needs and its layout.Hop (a TP slice is all-gathered on arrival), or None."""
        ex = self.ex
        op, mb, chunk = ex.ops[j]
        src = op_peers(ex, op, chunk)[0]
        if src is None:
            return None  # the first virtual stage's F, the last's B, W
        v = getattr(ex, "chunks", 1)
        if op == "F":
            tag = fwd_tag(mb, chunk, v)
            dtype = ex.wrap_dtype if ex.first and chunk > 0 else ex.in_dtype
        else:  # from the consumer's chunk
            tag = bwd_tag(mb, chunk + 1 if ex.last else chunk, v)
            dtype = ex.out_dtype
        hop = ex.hop_into(op, chunk)
        buf = torch.empty(ex.messages.recv_shape(hop), dtype=dtype, device=ex.device)
        return P2P("recv", buf, src, tag), hop

    def post(self, sends: list[P2P], *, next_op: int) -> None:
        """One batch: ``sends`` (what the op just run sends) and op ``next_op``'s receive, if any."""
        recv = self._receive(next_op) if next_op < len(self.ex.ops) else None
        self.recv, self.hop = recv if recv is not None else (None, None)
        self.ex.buffers.track(*(o.tensor for o in sends))
        if self.detached:
            done = [b for b in self.in_flight if b.is_completed()]
            for b in done:
                b.wait()  # returns at once; releases the buffers (the bridge's back to its pool)
            self.in_flight = [b for b in self.in_flight if b not in done]
            if sends:
                self.in_flight.append(self.ex.comm.batch_isend_irecv(sends))
            sends = []
        ops = sends + ([self.recv] if self.recv is not None else [])
        self.batch = self.ex.comm.batch_isend_irecv(ops) if ops else None
        if self.recv is not None:
            self.ex.buffers.track(self.recv.tensor)

    def finish(self) -> None:
        """Wait for the sends still in flight (virtual stages) at the step's end."""
        w = time.perf_counter()
        for b in self.in_flight:
            b.wait()
        self.in_flight = []
        self.trace.send_wait_s += time.perf_counter() - w

    def take(self) -> torch.Tensor | None:
        """Wait for the batch posted last (its sends done, their buffers released); its received
        tensor (whole: a TP slice is all-gathered here), or None."""
        if self.batch is None:
            return None
        w = time.perf_counter()
        self.batch.wait()
        buf = None if self.recv is None else self.recv.tensor
        self.batch = self.recv = None
        if buf is not None and self.hop.dest_gathers:
            buf = self.ex.messages.arrived(buf, self.hop)
            self.ex.buffers.track(buf)
        waited = time.perf_counter() - w
        if buf is None:
            self.trace.send_wait_s += waited
        else:
            self.trace.recv_wait_s += waited
        return buf
