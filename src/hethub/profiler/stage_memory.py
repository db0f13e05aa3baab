"""What one rank of a plan's stage really holds at its peak, by storage accounting (any device).

The rank's module is the runtime's (:class:`StageModel`, with its TP shard); training state is read
after one AdamW step; activations are the storages autograd saves for backward while the stage
holds the schedule's peak number of micro-batches in flight (``Schedule.in_flight``), each
forwarded as the pipeline executor does. TP collectives are skipped (they do not change what is
saved: the all-reduce's output is a fresh tensor either way). In mixed precision the stage runs under
CPU autocast with its residual stream in the compute dtype, as the Trainer builds it; parameters'
cast copies are counted apart from the activations (``weight_copy_bytes``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from hethub.plan import Plan
from hethub.profiler.layers import cp_alone, tp_alone
from hethub.profiler.tensor_memory import StateBytes, saved_for_backward, storage_bytes, training_state_bytes
from hethub.runtime.model import StageModel
from hethub.runtime.optim import OptimConfig, build_optimizer
from hethub.runtime.precision import autocast, compute_dtype
from hethub.schedules import get_schedule


@dataclass(frozen=True)
class MeasuredMemory:
    state: StateBytes
    activations_bytes: int
    in_flight: int
    weight_copy_bytes: int = 0  # parameters' compute-dtype copies the forwards saved (mixed precision)

    @property
    def total_bytes(self) -> int:
        return self.state.total_bytes + self.activations_bytes


def measure_stage_memory(plan: Plan, *, pipeline: int, stage: int, tp_rank: int = 0, seed: int = 0,
                         precision: str = "fp32") -> MeasuredMemory:
    torch.manual_seed(seed)
    pipe = plan.pipelines[pipeline]
    st = pipe.stages[stage]
    tp = tp_alone(st.tp, rank=tp_rank, sequence_parallel=st.sequence_parallel)
    model = StageModel(plan.model, layers=st.layers, embedding=st.embedding, head=st.head, tp=tp,
                       recompute=st.recompute, seed=seed, attention=plan.attention_of(st.kind), chunks=st.chunks,
                       compute_dtype=compute_dtype(precision), cp=cp_alone(st.cp), rope_len=plan.seq_len)
    opt, _ = build_optimizer(model, OptimConfig())
    sched = get_schedule(plan.schedule, chunks=st.num_chunks)
    in_flight = sched.in_flight(stage=stage, num_stages=len(pipe.stages), num_micro_batches=pipe.num_micro_batches)
    mbs, s, v = pipe.micro_batch_size, plan.seq_len, plan.model.vocab_size
    # A received activation is this rank's share: s / cp tokens, 1/tp of them under sequence parallelism.
    held = s // st.cp // (st.tp if st.sequence_parallel else 1)
    if st.num_chunks > 1:
        return _chunked(model, opt, st=st, sched=sched, stage=stage, pipe=pipe, seq_len=s, in_flight=in_flight,
                        precision=precision)
    # Model state (parameters, RoPE tables) is not activation memory.
    exclude = [*model.parameters(), *model.buffers()]
    outs = []
    with autocast(torch.device("cpu"), precision), \
            saved_for_backward(exclude=exclude, weights=model.parameters()) as rec:
        for _ in range(in_flight):
            x = (torch.randint(0, v, (mbs, s)) if st.embedding
                 else torch.randn(mbs, held, plan.model.hidden_size).requires_grad_(True))
            outs.append(model(x, torch.randint(0, v, (mbs, s)) if st.head else None))
    acts = rec.nbytes
    for out in outs:
        torch.autograd.backward(out, grad_tensors=None if st.head else torch.ones_like(out))
    opt.step()
    return MeasuredMemory(state=training_state_bytes(model, opt), activations_bytes=acts, in_flight=in_flight,
                          weight_copy_bytes=rec.copy_bytes)


@dataclass(frozen=True)
class RankMemory:
    """One rank's parts measured while the runtime trains (storage accounting; any device)."""

    rank: int
    pipeline: int
    stage: int
    weights_bytes: int  # the parameters and any separate fp32 masters (mixed precision)
    grads_bytes: int
    optimizer_bytes: int
    activations_peak_bytes: int  # saved tensors held at once, over the schedule
    grad_sync_buffer_bytes: int  # gradient-reduction buffers beside the gradient buffer, all in flight at once
    weight_copies_bytes: int = 0  # parameters' compute-dtype copies saved at once (mixed precision)
    p2p_buffers_bytes: int = 0  # point-to-point buffers held at once (the executor's trace)


def measure_rank_memory(plan: Plan, *, rank: int, comm: Any, steps: int = 3, seed: int = 0,
                        precision: str | None = None) -> RankMemory:
    """Train ``steps`` steps of ``plan`` as rank ``rank`` (the runtime's Trainer, on CPU) and account
    each part: parameters, gradients (after backward), AdamW state (after the step), the saved
    tensors autograd holds at once during forward/backward (live tracking through the real schedule),
    the parameters' cast copies among them, and the float buffers the gradient sync reduces beside
    its gradient buffer (buckets reduced in place count nothing; they are all started before the
    sync waits, so they add up), and the point-to-point buffers the executor holds at once (its
    trace). ``precision``: train every rank in it (CPU autocast); None: the
    plan's CPU precision (fp32). Call on every rank of an initialised process group
    (``hethub.comm.local_ranks.run_local_ranks``)."""
    from hethub.profiler.tensor_memory import LiveSavedTensors
    from hethub.runtime.trainer import Trainer, TrainerConfig

    cfg = TrainerConfig(seed=seed, precision=precision, cpu_autocast=precision is not None)
    trainer = Trainer(plan, rank=rank, comm=comm, cfg=cfg)
    tracker = LiveSavedTensors(exclude=[*trainer.model.parameters(), *trainer.model.buffers()],
                               weights=trainer.model.parameters())
    sync_max = [0]
    sync = trainer.grad_sync
    inner = sync.comm
    own = sync.buffer.data.untyped_storage().data_ptr()
    step_bytes: dict[int, int] = {}  # storage -> bytes, of this step's reductions

    class _Recording:  # sees what the gradient sync reduces, forwards everything
        def __getattr__(self, name: str) -> Any:
            return getattr(inner, name)

        def _see(self, tensor: torch.Tensor) -> None:
            storage = tensor.untyped_storage()
            if tensor.is_floating_point() and storage.data_ptr() != own:
                step_bytes[storage.data_ptr()] = storage.nbytes()

        def start_all_reduce(self, tensor: torch.Tensor, **kw: Any) -> Any:
            self._see(tensor)
            return inner.start_all_reduce(tensor, **kw)

        def start_reduce(self, tensor: torch.Tensor, **kw: Any) -> Any:
            self._see(tensor)
            return inner.start_reduce(tensor, **kw)

    sync.comm = _Recording()
    g = torch.Generator().manual_seed(seed)
    grads = p2p = 0
    for _ in range(steps):
        batch = torch.randint(0, plan.model.vocab_size, (plan.global_batch, plan.seq_len + 1), generator=g)
        with tracker.active():
            _, trace = trainer.forward_backward(batch)
        p2p = max(p2p, trace.max_p2p_bytes)
        grads = max(grads, training_state_bytes(trainer.model).grads_bytes)
        trainer.sync_grads()
        sync_max[0] = max(sync_max[0], sum(step_bytes.values()))
        step_bytes.clear()
        trainer.clip_and_update()
    state = training_state_bytes(trainer.model, trainer.optimizer)
    # fp32 master copies beside 16-bit parameters (runtime/precision.py; ZeRO-1's owned slices of them).
    if trainer.zero is not None:
        masters = trainer.zero.state_bytes(trainer.optimizer)[1]
    else:
        masters = storage_bytes(m for m, p in zip(trainer.masters.masters, trainer.masters.params, strict=True)
                                if m is not p) if trainer.masters is not None else 0
    st = trainer.place.stage
    return RankMemory(rank=rank, pipeline=st.pipeline, stage=st.stage, weights_bytes=state.weights_bytes + masters,
                      grads_bytes=grads, optimizer_bytes=state.optimizer_bytes,
                      activations_peak_bytes=tracker.peak_bytes, grad_sync_buffer_bytes=sync_max[0],
                      weight_copies_bytes=tracker.copy_peak_bytes, p2p_buffers_bytes=p2p)


def _chunked(model: StageModel, opt: Any, *, st: Any, sched: Any, stage: int, pipe: Any, seq_len: int,
             in_flight: int, precision: str) -> MeasuredMemory:
    """Virtual stages: what one micro-batch's forward of each chunk saves (the embedding with chunk
    0, the head with the last), then the schedule's order walked with those sizes: the peak of
    what is held at once (``Interleaved.peak_held``)."""
    mbs, vocab, hidden = pipe.micro_batch_size, model.spec.vocab_size, model.spec.hidden_size
    exclude = [*model.parameters(), *model.buffers()]
    last = st.num_chunks - 1
    sizes = []
    for c in range(st.num_chunks):
        with autocast(torch.device("cpu"), precision), \
                saved_for_backward(exclude=exclude, weights=model.parameters()) as rec:
            x = (torch.randint(0, vocab, (mbs, seq_len)) if st.embedding and c == 0
                 else torch.randn(mbs, seq_len, hidden).requires_grad_(True))
            out = model(x, torch.randint(0, vocab, (mbs, seq_len)) if st.head and c == last else None, chunk=c)
        sizes.append(float(rec.nbytes))
        head = st.head and c == last
        torch.autograd.backward(out, grad_tensors=None if head else torch.ones_like(out))
    opt.step()
    peak = sched.peak_held(stage=stage, num_stages=len(pipe.stages), num_micro_batches=pipe.num_micro_batches,
                           chunk_weights=sizes)
    return MeasuredMemory(state=training_state_bytes(model, opt), activations_bytes=round(peak), in_flight=in_flight)
