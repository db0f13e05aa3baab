"""Runs one stage's share of a pipeline schedule (1F1B, GPipe, ZB-H1) over micro-batches with explicit p2p.

Why not ``torch.distributed.pipelining``: it assumes one rank per stage per pipeline group and
sends straight over c10d. Here adjacent stages may have different TP degrees (receiver q of a TP-b
stage reads from sender q % a of the TP-a stage before it; sender j gets its output gradient from
receiver j % b), and every message must go through our Communicator so a later bridge can route
it across device kinds. What is left is small: the op order (the schedule registry's, which the
predictor simulates: ``hethub.schedules``) and its messages, each on the lane of its direction and
kind, receives posted one op ahead and sends left in flight (``runtime/p2p.py``: NCCL-safe for
every order). Between stages of equal
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

A stage output, once sent, keeps only its autograd node (Megatron's ``deallocate_output_tensor``):
backward needs the output's grad_fn, not its values, so its memory goes back once its send is
released instead of when its backward runs.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

from hethub.comm.communicator import Communicator
from hethub.layout import RankPlace
from hethub.runtime import weight_grad
from hethub.runtime.model import StageModel
from hethub.runtime.p2p import Exchange, Send, bwd_tag, fwd_tag, op_peers
from hethub.runtime.slowdown import Emulator
from hethub.runtime.stage_messages import StageMessages
from hethub.runtime.timing import OpTimer
from hethub.schedules import Op, get_schedule

__all__ = ["PipelineExecutor", "StepTrace", "bwd_tag", "fwd_tag"]


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
    # Most point-to-point buffers holding memory at once, and their bytes, counted when each batch
    # is posted: send buffers, sent stage outputs not yet freed, receives not yet consumed (LiveBuffers).
    max_p2p_buffers: int = 0
    max_p2p_bytes: int = 0

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


class LiveBuffers:
    """Weak references to one step's point-to-point tensors, to count those still holding memory
    (distinct storages; a freed stage output keeps a one-element placeholder, which does not count).
    A received input, once its forward has run, is a saved activation and is no longer counted."""

    def __init__(self) -> None:
        self.refs: list[weakref.ref[torch.Tensor]] = []

    def track(self, *tensors: torch.Tensor) -> None:
        self.refs += [weakref.ref(t) for t in tensors]

    def release(self, t: torch.Tensor) -> None:
        self.refs = [r for r in self.refs if r() is not t]

    def live(self) -> tuple[int, int]:
        """(buffers, bytes) still holding memory: distinct storages of the tracked tensors alive."""
        alive = [t for r in self.refs if (t := r()) is not None]
        self.refs = [weakref.ref(t) for t in alive]
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in alive
                    if t.untyped_storage().nbytes() > t.element_size()}
        return len(storages), sum(storages.values())


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
        self.schedule = sched = get_schedule(schedule, chunks=self.chunks)
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
        st = _Step(trace=StepTrace(), t0=t0, micro_batches=micro_batches,
                   loss_sum=torch.zeros((), dtype=torch.float64, device=self.device))
        self.buffers = LiveBuffers()
        link = Exchange(self, st.trace)
        link.post_receive(0)
        for i, op in enumerate(self.ops):
            got = link.take(i)
            link.post_receive(i + 1)  # its transfer overlaps this op
            link.release()  # complete sends go back, before the op and after it (runtime/p2p.py)
            sends = self._run_op(op, got, st)
            link.release(ran=i)
            link.send(op, sends)  # in flight while the next ops run (runtime/p2p.py)
            for out in st.to_free:  # posted: the outputs' values are no longer needed
                _free_output(out)
            st.to_free = []
            n, nbytes = self.buffers.live()
            st.trace.max_p2p_buffers = max(st.trace.max_p2p_buffers, n)
            st.trace.max_p2p_bytes = max(st.trace.max_p2p_bytes, nbytes)
        link.finish()
        if not self.timer.device_events:
            st.trace.resolve(self.timer, t0)  # host marks read at once; device marks after the step's sync
        return st.loss_sum, st.trace

    def _run_op(self, op: Op, got: torch.Tensor | None, st: _Step) -> list[Send]:
        """Run one op on its received tensor (None: nothing received); what it sends."""
        kind, mb, chunk = op
        key = (mb, chunk)
        if kind == "F":
            return self._forward(key, got, st)
        if kind == "W":
            start = self.timer.mark()
            work = st.deferred.pop(key, None)
            if work is not None:
                with self.emulator.chunk():
                    work.run()
            self._record(st.trace, "W", mb, start, st.t0, chunk)
            st.held.discard(key)
            return []
        return self._backward(key, got, st)

    def _forward(self, key: tuple[int, int], got: torch.Tensor | None, st: _Step) -> list[Send]:
        mb, chunk = key
        grad = torch.is_grad_enabled()  # False in evaluation: nothing is kept for a backward
        x = st.micro_batches[mb][0] if got is None else got.requires_grad_(grad)
        self.buffers.release(x)  # a saved activation from here on
        # The model casts a received activation into its residual stream's dtype, if it is not in it
        # already (a 16-bit stage keeps a 16-bit message as it came).
        last = self.is_last(chunk)
        target = st.micro_batches[mb][1] if last else None
        start = self.timer.mark()
        # A split executor builds weight GEMMs whose B defers their weight gradients (weight_grad.py);
        # the first stage sends no input gradient, so its B is the whole backward (and its W empty).
        defers = self.split and not self.first
        with self.emulator.chunk(), (weight_grad.recording() if defers else contextlib.nullcontext()):
            out = self.model(x, target, chunk=chunk) if self.chunks > 1 else self.model(x, target)
        self._record(st.trace, "F", mb, start, st.t0, chunk)
        if grad:
            st.inputs[key], st.outputs[key] = x, out
            st.held.add(key)
            st.trace.max_in_flight = max(st.trace.max_in_flight, len(st.held))
        if last:
            st.loss_sum += out.detach().double()
            return []
        dests = self.peers("F", chunk)[1]
        hop = self.place.wrap_hop if self.last else self.place.hop_out
        payloads = self.messages.outgoing(out.detach().to(self.out_dtype), hop, dests=len(dests))
        st.to_free.append(out)
        self.buffers.track(out)  # until freed (its placeholder does not count)
        into = chunk + 1 if self.last else chunk  # the consumer's chunk (fwd_tag)
        return [Send(t, d, fwd_tag(mb, into, self.chunks)) for d, t in zip(dests, payloads, strict=True)]

    def _backward(self, key: tuple[int, int], got: torch.Tensor | None, st: _Step) -> list[Send]:
        mb, chunk = key
        x, out = st.inputs.pop(key), st.outputs.pop(key)
        grad = None if got is None else got.to(out.dtype)
        if got is not None:  # consumed here (a split backward's W may keep it: W's state, not a buffer)
            self.buffers.release(got)
        start = self.timer.mark()
        with self.emulator.chunk():
            if got is None and self.loss_scale != 1.0:
                out = out * self.loss_scale
            if self.split and not self.first:  # (B's recomputed forward, if any, builds what F built)
                with weight_grad.deferring() as st.deferred[key]:
                    _run_backward(out, grad)
            else:
                _run_backward(out, grad)
        self._record(st.trace, "B", mb, start, st.t0, chunk)
        if not self.split:
            st.held.discard(key)
        if self.is_first(chunk):
            return []
        # Detached from x, which a split backward's W may keep: the buffer then lives only until sent.
        dx, x.grad = x.grad, None
        dests = self.peers("B", chunk)[1]
        hop = self.place.wrap_grad_hop if self.first else self.place.hop_grad_out
        gs = self.messages.outgoing(dx.to(self.wrap_dtype if self.first else self.in_dtype), hop, dests=len(dests))
        return [Send(g, d, bwd_tag(mb, chunk, self.chunks)) for d, g in zip(dests, gs, strict=True)]

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
        return op_peers(self, op, chunk)

    def _record(self, trace: StepTrace, op: str, mb: int, start: Any, t0: Any, chunk: int = 0) -> None:
        del t0  # marks are read relative to the step's start in StepTrace.resolve
        trace.marks.append((op, mb, chunk, start, self.timer.mark()))



@dataclass
class _Step:
    """What one step of the executor keeps between ops."""

    trace: StepTrace
    t0: Any
    micro_batches: list[tuple[torch.Tensor, torch.Tensor]]
    loss_sum: torch.Tensor
    inputs: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    outputs: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    held: set[tuple[int, int]] = field(default_factory=set)  # (micro-batch, chunk) whose graph is held
    deferred: dict[tuple[int, int], weight_grad.Deferred] = field(default_factory=dict)  # W's work
    to_free: list[torch.Tensor] = field(default_factory=list)  # outputs the step sent (or a peerless TP rank would)


def _free_output(out: torch.Tensor) -> None:
    """Free a sent stage output's values, keeping its autograd node (Megatron's
    ``deallocate_output_tensor``): the tensor's data becomes a one-element placeholder. Skipped when
    backward needs the values themselves: an output that is a leaf or a view (a stage whose chunk
    passes its input through, say)."""
    if out.grad_fn is None or out._base is not None:
        return
    out.data = torch.empty((1,), dtype=out.dtype, device=out.device)


def _run_backward(out: torch.Tensor, grad: torch.Tensor | None) -> None:
    """``torch.autograd.backward(out, grad)`` through the engine, without the check that ``grad``
    has ``out``'s shape: a freed output keeps a placeholder (Megatron-LM's ``custom_backward``)."""
    if grad is None:
        torch.autograd.backward(out)
        return
    torch.autograd.graph._engine_run_backward((out,), (grad,), False, False, (), allow_unreachable=True,
                                              accumulate_grad=True)
