"""Measure the real layers: embedding, one decoder layer, head + loss, and their optimizer step.

Each part is the runtime's own module (:class:`hethub.runtime.model.StageModel` holding only that
part), called exactly as the pipeline executor calls a stage: forward on the received activations
(or token ids), backward with an output gradient (or from the loss), then the runtime's update
sequence (gradient division, global-norm clipping, AdamW step, zero_grad). Times are medians over
``repeats`` after ``warmup`` unmeasured repetitions, so first-call allocation and lazy
initialisation are excluded; the device is synchronised around every timed region.

With ``tp > 1`` this runs on every rank of a real TP group (see :mod:`hethub.profiler.runner`), so
the measured times contain the TP all-reduces, as the predictor expects of profiles.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from hethub.predict.profiles import LayerTimes
from hethub.profiler.tensor_memory import saved_for_backward, training_state_bytes
from hethub.runtime.context_parallel import CPContext
from hethub.runtime.grad_clip import clip_with_norm_, total_norm
from hethub.runtime.model import StageModel
from hethub.runtime.optim import OptimConfig, build_optimizer
from hethub.runtime.tensor_parallel import TPContext
from hethub.spec.model import ModelSpec


@dataclass(frozen=True)
class Repetitions:
    warmup: int = 3
    repeats: int = 10


@dataclass(frozen=True)
class PartResult:
    times: LayerTimes
    state_bytes: int  # weights + grads + optimizer state of the part
    saved_bytes: int  # activations autograd keeps for backward, one micro-batch
    # Of forward + backward time, the share this thread spent on a CPU (the rest: waiting in TP
    # collectives). The runtime's emulation of a slower kind slows exactly that share.
    cpu_fraction: float = 1.0


@dataclass(frozen=True)
class EntryResult:
    embedding: PartResult
    layer: PartResult
    head: PartResult
    peak_mem_bytes: int
    # Per-layer times of stacks of k > 1 decoder layers ((k, times / k), ..), where measured.
    layer_by_depth: tuple[tuple[int, LayerTimes], ...] = ()


class NoCollectives:
    """Stands in for the Communicator where one TP (or CP) rank runs alone: collectives are skipped
    but give their results' shapes (they change no saved tensor: a collective's output is a fresh
    tensor either way); a ring receive gets zeros."""

    def __init__(self, size: int = 1) -> None:
        self.size = size

    def all_reduce(self, tensor: torch.Tensor, **_: Any) -> torch.Tensor:
        return tensor

    def all_gather(self, tensor: torch.Tensor, *, dim: int = 0, **_: Any) -> torch.Tensor:
        return torch.cat([tensor] * self.size, dim=dim)

    def reduce_scatter(self, tensor: torch.Tensor, **_: Any) -> torch.Tensor:
        return tensor.chunk(self.size)[0].clone()

    def isend(self, tensor: torch.Tensor, **_: Any) -> Any:
        return _Done()

    def irecv(self, tensor: torch.Tensor, **_: Any) -> Any:
        tensor.zero_()
        return _Done()

    def barrier(self) -> None:
        return None


class _Done:
    def wait(self) -> None:
        return None


def tp_alone(size: int, *, rank: int = 0, sequence_parallel: bool = False) -> TPContext:
    """TP rank ``rank`` of a group of ``size``, run alone (:class:`NoCollectives`; TP 1 needs none)."""
    return TPContext(size=size, rank=rank, group=tuple(range(size)), sequence_parallel=sequence_parallel,
                     comm=NoCollectives(size) if size > 1 else None)  # type: ignore[arg-type]


def cp_alone(size: int, *, rank: int = 0) -> CPContext:
    """CP rank ``rank`` of ``size``, run alone: its ring's messages are zeros."""
    return CPContext(size=size, rank=rank, ring=tuple(range(size)),
                     comm=NoCollectives(size) if size > 1 else None)  # type: ignore[arg-type]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_s(samples: list[float]) -> float:
    return statistics.median(samples) if samples else 0.0


def measure_part(model: StageModel, *, make_input: Callable[[], tuple[torch.Tensor, torch.Tensor | None]],
                 device: torch.device, reps: Repetitions, barrier: Callable[[], None] = lambda: None,
                 clock: Callable[[], float] = time.perf_counter) -> PartResult:
    """Forward, backward and update times of one stage-part module (medians, seconds)."""
    optim = OptimConfig(total_steps=10**6)
    opt, sched = build_optimizer(model, optim)
    params = [p for _, p in sorted(model.named_parameters())]
    fwd: list[float] = []
    bwd: list[float] = []
    upd: list[float] = []
    cpu: list[float] = []  # thread CPU seconds of forward + backward
    saved = state = 0
    # Pass 0 only counts what autograd saves: its hooks cost ~10% of a forward, so it is never timed.
    for i in range(1 + reps.warmup + reps.repeats):
        x, targets = make_input()
        barrier()  # TP ranks start together, as they do inside a pipeline
        _sync(device)
        c0 = time.thread_time()
        t0 = clock()
        with saved_for_backward(exclude=params) if i == 0 else contextlib.nullcontext() as rec:
            out = model(x, targets)
            if targets is not None:
                float(out.detach())  # the executor reads the loss: a host sync it pays per micro-batch
        _sync(device)
        t1 = clock()
        c1 = time.thread_time()
        grad = None if targets is not None else torch.randn_like(out)
        barrier()
        _sync(device)
        c2 = time.thread_time()
        t2 = clock()
        torch.autograd.backward(out, grad_tensors=grad)
        _sync(device)
        t3 = clock()
        c3 = time.thread_time()
        if i == 0:
            saved = rec.nbytes
        del out, x, grad
        t4 = clock()
        _update(params, opt, sched, grad_clip=optim.grad_clip)
        _sync(device)
        t5 = clock()
        if i > reps.warmup:
            fwd.append(t1 - t0)
            bwd.append(t3 - t2)
            upd.append(t5 - t4)
            cpu.append((c1 - c0) + (c3 - c2))
        if i == 0:
            state = training_state_bytes(model, opt).total_bytes  # grads still allocated here
        # Zeroed in place, not dropped: the next backward then accumulates into existing gradients, as
        # every micro-batch after a step's first does in the runtime (~2% more than assigning them).
        opt.zero_grad(set_to_none=False)
    times = LayerTimes(_median_s(fwd), _median_s(bwd), _median_s(upd))
    fraction = 1.0
    if device.type == "cpu" and clock is not time.thread_time and times.fwd_s + times.bwd_s > 0:
        fraction = min(1.0, _median_s(cpu) / (times.fwd_s + times.bwd_s))
    return PartResult(times, state, saved, fraction)


def _update(params: list[torch.nn.Parameter], opt: torch.optim.Optimizer, sched: object, *, grad_clip: float) -> None:
    """What the runtime does with a stage's gradients after its last backward (less the DP sync)."""
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    for p, g in zip(params, grads, strict=True):
        p.grad = g
    torch._foreach_div_(grads, 2.0)
    clip_with_norm_(params, grad_clip, total_norm(grads))
    opt.step()
    sched.step()  # type: ignore[attr-defined]
    # zero_grad is left to the caller, after reading the state bytes.


def stack_depths(spec: ModelSpec, wanted: tuple[int, ...] = (2, 4, 8)) -> tuple[int, ...]:
    """Stack depths above 1 to measure for `spec`: `wanted` capped at the model's layer count."""
    return tuple(sorted({min(k, spec.num_layers) for k in wanted} - {1}))


def measure_entry(spec: ModelSpec, *, mbs: int, seq_len: int, tp: TPContext, device: torch.device,
                  reps: Repetitions, seed: int = 0, depths: tuple[int, ...] = ()) -> EntryResult:
    """All three parts at one micro-batch size on this rank of a TP group (size 1: no group).

    ``depths``: also time stacks of k decoder layers (k > 1) and keep their per-layer times, because
    a stage of many layers costs more per layer than one layer alone (its saved activations outgrow
    the caches)."""
    barrier: Callable[[], None] = (lambda: tp.comm.barrier()) if tp.comm is not None else (lambda: None)
    # One CPU thread and no TP group: the part's time is its thread's CPU time, which other load on a
    # shared machine does not inflate (the emulation sleeps by the same clock). Otherwise wall time:
    # worker threads, collectives' waits and accelerators all count.
    solo = device.type == "cpu" and tp.comm is None and torch.get_num_threads() == 1
    clock = time.thread_time if solo else time.perf_counter
    gen = torch.Generator().manual_seed(seed)
    h = spec.hidden_size

    def tokens() -> torch.Tensor:
        return torch.randint(0, spec.vocab_size, (mbs, seq_len), generator=gen).to(device)

    def hidden() -> torch.Tensor:
        # The executor receives activations into a fresh buffer that requires grad.
        return torch.randn(mbs, seq_len, h, generator=gen).to(device).requires_grad_(True)

    def part(layers: tuple[int, int], *, embedding: bool, head: bool) -> StageModel:
        return StageModel(spec, layers=layers, embedding=embedding, head=head, tp=tp, seed=seed).to(device)

    emb = measure_part(part((0, 0), embedding=True, head=False), make_input=lambda: (tokens(), None),
                       device=device, reps=reps, barrier=barrier, clock=clock)
    layer = measure_part(part((0, 1), embedding=False, head=False), make_input=lambda: (hidden(), None),
                         device=device, reps=reps, barrier=barrier, clock=clock)
    head = measure_part(part((0, 0), embedding=False, head=True), make_input=lambda: (hidden(), tokens()),
                        device=device, reps=reps, barrier=barrier, clock=clock)
    by_depth = []
    for k in sorted(set(depths) - {1}):
        t = measure_part(part((0, k), embedding=False, head=False), make_input=lambda: (hidden(), None),
                         device=device, reps=reps, barrier=barrier, clock=clock).times
        by_depth.append((k, LayerTimes(t.fwd_s / k, t.bwd_s / k, t.update_s / k)))
    if device.type == "cuda":
        peak = int(torch.cuda.max_memory_allocated(device))
    else:
        # No allocator statistics on CPU: the largest part's training state plus what its forward
        # keeps for backward, by storage accounting.
        peak = max(p.state_bytes + p.saved_bytes for p in (emb, layer, head))
    return EntryResult(emb, layer, head, peak, tuple(by_depth))
