"""Runs one stage's share of a pipeline schedule (1F1B, GPipe, ZB-H1) over micro-batches with explicit p2p.

Why not ``torch.distributed.pipelining``: it assumes one rank per stage per pipeline group and
sends straight over c10d. Here adjacent stages may have different TP degrees (receiver q of a TP-b
stage reads from sender q % a of the TP-a stage before it; sender j gets its output gradient from
receiver j % b), and every message must go through our Communicator so a later bridge can route
it across device kinds. What is left is small: the op order (the schedule registry's, which the
predictor simulates: ``hethub.schedules``), isend, and irecv posted two ops ahead, with a tag per
micro-batch and direction, and waiting on all sends before the step ends. Between stages of equal
TP degree each rank sends only its slice of the (replicated) activation or gradient and the
receiving stage all-gathers it over its TP group (Megatron's scatter-gather; ``layout.split_hop``),
so the slow inter-stage link carries one copy, not one per TP rank.

Split backward (ZB-H1): B computes only the stage input's gradient and W the weight gradients later,
by explicit weight-gradient functions (``runtime/weight_grad.py``): every weight GEMM of the stage
queues its dW (and bias gradient) during B and W computes them, so B + W costs one backward (torch's
own split, ``torch.distributed.pipelining._backward``, measured ~1.5 backwards here: see that
module). Norm weights, the embedding and the weightless ops stay in B. The first stage has no input
gradient to send: its B runs the whole backward and its W is empty, which times the same because
ZB-H1 runs the first stage's W right after its B.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from hethub.comm.communicator import Communicator
from hethub.layout import RankPlace
from hethub.runtime import weight_grad
from hethub.runtime.model import StageModel
from hethub.runtime.slowdown import Emulator
from hethub.runtime.stage_messages import StageMessages
from hethub.runtime.timing import OpTimer
from hethub.schedules import Op, get_schedule


def fwd_tag(mb: int, chunk: int = 0, chunks: int = 1) -> int:
    """Tag of micro-batch ``mb``'s activation into model chunk ``chunk`` of the receiving stage (the
    last stage's chunk c sends to the first's chunk c + 1, so tags name the consumer's chunk)."""
    return 2 * (mb * chunks + chunk)


def bwd_tag(mb: int, chunk: int = 0, chunks: int = 1) -> int:
    """Tag of the gradient of that activation, sent back by the consuming chunk ``chunk``."""
    return 2 * (mb * chunks + chunk) + 1


@dataclass
class StepTrace:
    """Per-rank timing of one step, seconds relative to the step start."""

    events: list[dict[str, Any]] = field(default_factory=list)  # {"op","mb","start_s","end_s"}
    busy_s: float = 0.0  # compute incl. emulated sleep
    # Ops' (op, mb, chunk, start, end) marks on the device's timeline (runtime/timing.py), turned
    # into ``events`` and ``busy_s`` by :meth:`resolve` once they can be read without a stall.
    marks: list[tuple[str, int, int, Any, Any]] = field(default_factory=list)
    recv_wait_s: float = 0.0
    send_wait_s: float = 0.0
    # Most micro-batches whose saved activations were held at once (F until B, or W); with virtual
    # stages, (micro-batch, chunk) pairs.
    max_in_flight: int = 0

    def resolve(self, timer: OpTimer, t0: Any) -> None:
        """Read the marks (after the step's host synchronisation on a device) into events and busy time."""
        for op, mb, chunk, a, b in self.marks:
            start, end = timer.seconds(t0, a), timer.seconds(t0, b)
            self.busy_s += end - start
            event = {"op": op, "mb": mb, "start_s": round(start, 6), "end_s": round(end, 6)}
            if chunk:
                event["chunk"] = chunk
            self.events.append(event)
        self.marks = []


class PipelineExecutor:
    def __init__(self, model: StageModel, *, place: RankPlace, comm: Communicator, schedule: str, seq_len: int,
                 hidden_size: int, emulator: Emulator | None = None, act_dtype: torch.dtype = torch.float32,
                 device: torch.device | None = None, in_dtype: torch.dtype | None = None,
                 out_dtype: torch.dtype | None = None, wrap_dtype: torch.dtype | None = None,
                 timer: OpTimer | None = None) -> None:
        self.model, self.place, self.comm = model, place, comm
        st = place.stage
        self.first, self.last = st.stage == 0, st.stage == st.num_stages - 1
        # Virtual stages: this device runs chunks 0..v-1; chunk c of the first stage takes its input
        # from chunk c - 1 of the last (place.fwd_peers / bwd_peers route it).
        self.chunks = getattr(st, "num_chunks", 1)
        sched = get_schedule(schedule, chunks=self.chunks)
        self.split = sched.split_backward
        self.ops: tuple[Op, ...] = sched.ops(stage=st.stage, num_stages=st.num_stages,
                                             num_micro_batches=place.num_micro_batches)
        # What travels between stages (layout.Hop: whole tensors, TP slices, sequence slices).
        self.messages = StageMessages(place=place, comm=comm, micro_batch_size=place.micro_batch_size,
                                      seq_len=seq_len, hidden_size=hidden_size)
        self.emulator = emulator or Emulator()
        self.act_dtype, self.device = act_dtype, device or torch.device("cpu")
        # The dtypes of the two boundaries: what arrives from the previous stage (and its gradient goes
        # back in), what leaves for the next one (and its gradient comes back in). Per-kind precision
        # makes them differ: each is the sending stage's compute dtype (runtime/precision.py).
        self.in_dtype, self.out_dtype = in_dtype or act_dtype, out_dtype or act_dtype
        # What crosses from the last stage back to the first (its compute dtype), for chunks c > 0.
        self.wrap_dtype = wrap_dtype or act_dtype
        # The head stage back-propagates loss * loss_scale (fp16 dynamic loss scaling; 1 otherwise).
        self.loss_scale = 1.0
        self.timer = timer or OpTimer(self.device)

    def run(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]], *, t0: Any = None,
            ) -> tuple[torch.Tensor, StepTrace]:
        """Forward and backward every micro-batch in schedule order; gradients accumulate in the model.

        ``micro_batches[i]`` is (inputs, targets) of micro-batch i (only the first stage reads the
        inputs, only the last the targets). Returns this rank's summed loss (0 off the head stage), a
        float64 tensor left on the device (no host synchronisation per micro-batch), and the trace;
        ``t0``: the step's start mark (``self.timer``).
        """
        t0 = self.timer.mark() if t0 is None else t0
        trace = StepTrace()
        inputs: dict[tuple[int, int], torch.Tensor] = {}
        outputs: dict[tuple[int, int], torch.Tensor] = {}
        pending: list[tuple[Any, torch.Tensor]] = []  # (work, tensor kept alive until sent)
        recvs = _Receives(self, lookahead=RECV_LOOKAHEAD)
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        held: set[tuple[int, int]] = set()  # (micro-batch, chunk) whose graph this stage still holds
        deferred: dict[tuple[int, int], weight_grad.Deferred] = {}  # (micro-batch, chunk) -> its W's work
        # A split executor builds weight GEMMs whose B defers their weight gradients (weight_grad.py);
        # the first stage sends no input gradient, so its B is the whole backward (and its W empty).
        defers = self.split and not self.first
        recording = weight_grad.recording if defers else contextlib.nullcontext
        v = self.chunks
        for i, (op, mb, chunk) in enumerate(self.ops):
            got = recvs.take(i, trace)
            key = (mb, chunk)
            first, last = self.is_first(chunk), self.is_last(chunk)
            if op == "F":
                x = micro_batches[mb][0] if got is None else got.requires_grad_(True)
                # The model casts a received activation into its residual stream's dtype, if it is not
                # in it already (a 16-bit stage keeps a 16-bit message as it came).
                target = micro_batches[mb][1] if last else None
                start = self.timer.mark()
                with self.emulator.chunk(), recording():
                    out = self.model(x, target, chunk=chunk) if v > 1 else self.model(x, target)
                self._record(trace, "F", mb, start, t0, chunk)
                if last:
                    loss_sum += out.detach().double()
                else:
                    dests = self.peers("F", chunk)[1]
                    hop = self.place.wrap_hop if self.last else self.place.hop_out
                    payloads = self.messages.outgoing(out.detach().to(self.out_dtype), hop, dests=len(dests))
                    into = chunk + 1 if self.last else chunk  # the consumer's chunk (fwd_tag)
                    pending += [(self.comm.isend(payload, dst=d, tag=fwd_tag(mb, into, v)), payload)
                                for d, payload in zip(dests, payloads, strict=True)]
                    _let_sends_start()
                inputs[key], outputs[key] = x, out
                held.add(key)
                trace.max_in_flight = max(trace.max_in_flight, len(held))
            elif op == "W":
                start = self.timer.mark()
                work = deferred.pop(key, None)
                if work is not None:
                    with self.emulator.chunk():
                        work.run()
                self._record(trace, "W", mb, start, t0, chunk)
                held.discard(key)
            else:
                x, out = inputs.pop(key), outputs.pop(key)
                grad = None if got is None else got.to(out.dtype)
                start = self.timer.mark()
                with self.emulator.chunk():
                    if got is None and self.loss_scale != 1.0:
                        out = out * self.loss_scale
                    if defers:  # (B's recomputed forward, if any, builds what F built)
                        with weight_grad.deferring() as deferred[key]:
                            torch.autograd.backward(out, grad_tensors=grad)
                    else:
                        torch.autograd.backward(out, grad_tensors=grad)
                self._record(trace, "B", mb, start, t0, chunk)
                if not self.split:
                    held.discard(key)
                if not first:
                    dests = self.peers("B", chunk)[1]
                    hop = self.place.wrap_grad_hop if self.first else self.place.hop_grad_out
                    gs = self.messages.outgoing(x.grad.to(self.wrap_dtype if self.first else self.in_dtype), hop,
                                                dests=len(dests))
                    pending += [(self.comm.isend(g, dst=d, tag=bwd_tag(mb, chunk, v)), g)
                                for d, g in zip(dests, gs, strict=True)]
                    _let_sends_start()
        w = time.perf_counter()
        for work, _ in pending:
            work.wait()
        trace.send_wait_s = time.perf_counter() - w
        if not self.timer.device_events:
            trace.resolve(self.timer, t0)  # host marks read at once; device marks after the step's sync
        return loss_sum, trace

    def hop_into(self, op: str, chunk: int) -> Any:
        """The layout.Hop of what op ``op`` of chunk ``chunk`` receives (F: its input; B: its output's
        gradient), the wrap between the last and first stage included."""
        pl = self.place
        if op == "F":
            return pl.wrap_hop if self.first and chunk > 0 else pl.hop_in
        return pl.wrap_grad_hop if self.last and chunk < self.chunks - 1 else pl.hop_grad_in

    def is_first(self, chunk: int) -> bool:
        """Whether (this stage's) chunk ``chunk`` is the pipeline's first virtual stage (reads the data)."""
        return self.first and chunk == 0

    def is_last(self, chunk: int) -> bool:
        """Whether chunk ``chunk`` is the last virtual stage (computes the loss)."""
        return self.last and chunk == self.chunks - 1

    def peers(self, op: str, chunk: int) -> tuple[int | None, tuple[int, ...]]:
        """(rank op ``op`` of chunk ``chunk`` receives from or None, ranks it sends to): a forward
        receives its input and sends its output; a backward receives its output gradient and sends
        its input gradient; W neither."""
        return _op_peers(self, op, chunk)

    def _record(self, trace: StepTrace, op: str, mb: int, start: Any, t0: Any, chunk: int = 0) -> None:
        del t0  # marks are read relative to the step's start in StepTrace.resolve
        trace.marks.append((op, mb, chunk, start, self.timer.mark()))


def _op_peers(ex: Any, op: str, chunk: int) -> tuple[int | None, tuple[int, ...]]:
    """PipelineExecutor.peers, for anything with its ``place``, ``first``, ``last`` (and ``chunks``)."""
    if op == "W":
        return None, ()
    pl = ex.place
    if getattr(ex, "chunks", 1) > 1:
        return pl.fwd_peers(chunk) if op == "F" else pl.bwd_peers(chunk)
    if op == "F":
        return (None if ex.first else pl.fwd_recv_from), (() if ex.last else pl.fwd_send_to)
    return (None if ex.last else pl.bwd_recv_from), (() if ex.first else pl.bwd_send_to)


def _let_sends_start() -> None:
    """Give up the core once after posting sends. gloo moves the data on a helper thread, which the
    scheduler wakes on this (busy) core; without a yield it may wait a whole time slice behind the
    next forward or backward while the receiver idles (hand-offs of 1-10 ms seen in traces on a
    2-core host, well under 1 ms with it)."""
    if hasattr(os, "sched_yield"):
        os.sched_yield()


# Receives posted ahead of the op that needs them. A blocking recv posted only when the op starts
# waits for a handshake with the sender, whose progress thread competes with its busy compute:
# measured 1-7 ms per hand-off on a 2-core host, where a pre-posted irecv has the data waiting.
# Two ops ahead covers 1F1B's alternation and GPipe's runs; each posted receive holds one buffer.
# Where a pair of ranks runs its messages in the order posted (NCCL), a receive is never posted
# ahead of a send to the same peer that an earlier op makes: the peer may need that send before it
# can send what we wait for (stage s+1 needs F(i+1) before it sends B(i)'s gradient), which would
# deadlock; the per-peer order then stays exactly that of receiving at each op's start.
RECV_LOOKAHEAD = 2


class _Receives:
    """The receives of one step's ops, each posted ``lookahead`` ops before its op runs."""

    def __init__(self, ex: PipelineExecutor, *, lookahead: int) -> None:
        self.ex, self.lookahead = ex, lookahead
        self.posted: dict[int, tuple[Any, torch.Tensor]] = {}
        self.next = 0

    def _source(self, j: int) -> tuple[int, int] | None:
        """(peer, tag) op j receives from, or None."""
        ex = self.ex
        op, mb, chunk = ex.ops[j]
        src = _op_peers(ex, op, chunk)[0]
        if src is None:
            return None  # the first virtual stage's F, the last's B, W
        v = getattr(ex, "chunks", 1)
        if op == "F":
            return src, fwd_tag(mb, chunk, v)
        return src, bwd_tag(mb, chunk + 1 if ex.last else chunk, v)  # from the consumer's chunk

    def _hop(self, j: int) -> Any:
        op, _, chunk = self.ex.ops[j]
        return self.ex.hop_into(op, chunk)

    def _sends_to(self, k: int) -> tuple[int, ...]:
        op, _, chunk = self.ex.ops[k]
        return _op_peers(self.ex, op, chunk)[1]

    def _may_post(self, j: int, *, now: int) -> bool:
        src = self._source(j)
        if src is None or not self.ex.comm.p2p_in_issue_order(src[0], device=self.ex.device):
            return True
        return all(src[0] not in self._sends_to(k) for k in range(now, j))

    def _post(self, j: int) -> None:
        src = self._source(j)
        if src is None:
            return
        ex = self.ex
        op, _, chunk = ex.ops[j]
        dtype = (ex.wrap_dtype if ex.first and chunk > 0 else ex.in_dtype) if op == "F" else ex.out_dtype
        buf = torch.empty(ex.messages.recv_shape(self._hop(j)), dtype=dtype, device=ex.device)
        self.posted[j] = (ex.comm.irecv(buf, src=src[0], tag=src[1]), buf)

    def take(self, i: int, trace: StepTrace) -> torch.Tensor | None:
        """Op i's received tensor (None if it receives nothing), waiting for it if it has not arrived."""
        while self.next < min(len(self.ex.ops), i + 1 + self.lookahead) and self._may_post(self.next, now=i):
            self._post(self.next)
            self.next += 1
        if i not in self.posted:
            return None
        work, buf = self.posted.pop(i)
        w = time.perf_counter()
        work.wait()
        buf = self.ex.messages.arrived(buf, self._hop(i))
        trace.recv_wait_s += time.perf_counter() - w
        return buf
