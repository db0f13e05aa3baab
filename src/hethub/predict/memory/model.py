"""Peak device memory of one stage's device, as named parts that add up to the peak.

A training step passes three moments where memory peaks; each adds its own transient bytes to the
state that persists across steps (weights, master copies, gradients, optimizer state):

* forward/backward: the activations of the schedule's in-flight micro-batches
  (:mod:`hethub.predict.memory.activations`), plus the largest working set one micro-batch adds on
  top (the loss's logits and their fp32 gradients at the head; one layer's recomputed activations
  under full recomputation; under selective recomputation one layer's re-run attention core on top
  of its gradients; one layer's gradients otherwise), plus the point-to-point buffers in flight
  (sends in flight until known complete, and the next op's receive:
  :mod:`hethub.predict.memory.p2p`);
* gradient sync: the gradients already lie in one contiguous buffer, which buckets reduce in place
  (``runtime/grad_buffer.py``): nothing more, except for groups whose holders differ in TP degree,
  whose buckets are built at full size (zeros outside this rank's shard) for the reduction, all of
  them in flight at once until the sync waits;
* optimizer step: AdamW's multi-tensor (foreach) path on GPUs allocates the square-root denominator
  for every parameter at once (4 bytes per fp32 parameter); on CPU it runs tensor by tensor.

The peak is the persistent state plus the largest of the three; the caching allocator reserves a
fraction more (fragmentation), and the process holds memory outside the allocator: the framework
context and the collective library's buffers per communicator (``spec/catalog.toml``).

Precision (Adam, bytes per parameter on this device): fp32 keeps fp32 weights (4), gradients (4) and
two moments (8). bf16-mixed keeps the parameters in bf16 (2), fp32 master weights (4,
``runtime/precision.MasterWeights``), fp32 gradients (4: the main-grad buffer,
``runtime/grad_buffer.py``, as Megatron's fp32 gradient accumulation) and two fp32 moments (8): 18 in
all. Under ZeRO-1 (:func:`sharded_memory`) a mixed-precision device keeps masters and moments for its
owned slice only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

from hethub.memo import Kept
from hethub.plan import Recompute
from hethub.predict.memory import activations as act
from hethub.schedules.messages import max_live_messages
from hethub.spec.kind import DeviceKind
from hethub.spec.model import ModelSpec

# Bytes per parameter of each persistent part, by precision (see the module docstring).
STATE_BYTES_PER_PARAM: dict[str, dict[str, int]] = {
    "fp32": {"weights": 4, "master_weights": 0, "grads": 4, "optimizer": 8},
    "bf16-mixed": {"weights": 2, "master_weights": 4, "grads": 4, "optimizer": 8},
    "fp16-mixed": {"weights": 2, "master_weights": 4, "grads": 4, "optimizer": 8},  # as bf16 (runtime/precision.py)
}
PHASES = ("forward_backward", "grad_sync", "optimizer_step")
# Parts in the order they are reported; StageMemory.parts gives them at the peak.
PARTS = ("weights", "master_weights", "grads", "optimizer", "activations", "fb_temporaries", "gathered_weights",
         "p2p_buffers", "grad_sync_buffer", "optimizer_temporaries", "fragmentation", "framework_context",
         "comm_buffers")


def act_bytes_for(precision: str) -> int:
    """Bytes per element of the activations a stage sends to the next (its boundary dtype)."""
    return 2 if precision in ("bf16-mixed", "fp16-mixed") else 4


def state_bytes_per_param(precision: str) -> dict[str, int]:
    try:
        return STATE_BYTES_PER_PARAM[precision]
    except KeyError:
        raise ValueError(f"unknown precision {precision!r}; use one of {', '.join(STATE_BYTES_PER_PARAM)}") from None


def layer_elems(model: ModelSpec, *, tp: int) -> int:
    """Elements of one decoder layer's parameters on one rank of a TP-``tp`` stage, as the runtime holds
    them: column-parallel weights and biases (wq, wk, wv, w1, w3) and row-parallel weights (wo, w2)
    split, norms and row-parallel biases replicated."""
    h, kv, f = model.hidden_size, model.kv_dim, model.ffn_hidden_size
    norms = 2 * h if model.arch == "llama" else 4 * h
    column_bias = (h + 2 * kv + f) if model.has_bias else (h + 2 * kv) if model.qkv_bias else 0
    row_bias = 2 * h if model.has_bias else 0
    return model.layer_matmul_params // tp + norms + column_bias // tp + row_bias


def stage_params(model: ModelSpec, *, layers: int, embedding: bool, head: bool, tp: int,
                 vocab_parallel: bool = True) -> float:
    """Parameters held by one device of a stage (TP splits matmuls, and embedding and head by
    vocabulary where ``vocab_parallel``; otherwise those are replicated). A tied head on the stage
    that holds the embedding uses the embedding's matrix: counted once."""
    per_layer = layer_elems(model, tp=tp)
    n = layers * per_layer
    vtp = tp if vocab_parallel else 1
    if embedding:
        n += model.embedding_elems(vtp)
    if head:
        n += model.final_norm_params + (0 if embedding and model.tied_embeddings else model.head_params / vtp)
    return n


class _cached:
    """``functools.cached_property`` without its lock: Python 3.11's takes one on every first access,
    a large share of a new StageMemory's cost (the planner builds ~10^4 of them). What it caches is
    a pure function of the frozen fields, so a race could only compute it twice."""

    def __init__(self, fn: Callable[[Any], Any]) -> None:
        self.fn, self.name = fn, fn.__name__
        self.__doc__ = fn.__doc__

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if obj is None:
            return self
        value = obj.__dict__[self.name] = self.fn(obj)  # found there from now on, before this descriptor
        return value


@dataclass(frozen=True)
class StageMemory:
    """Bytes on one device of a stage at its predicted peak, by part. Transient parts of the moments
    that do not bind are kept (``phases``) but are not part of the peak."""

    weights_bytes: float
    master_weights_bytes: float
    grads_bytes: float
    optimizer_bytes: float
    activations_bytes: float  # in-flight micro-batches' saved tensors (forward/backward moment)
    fb_temporaries_bytes: float  # one micro-batch's working set on top (logits at the head, a layer)
    grad_sync_buffer_bytes: float
    optimizer_temporaries_bytes: float
    fragmentation_ratio: float = 0.0
    framework_context_bytes: float = 0.0
    comm_buffers_bytes: float = 0.0
    gathered_bytes: float = 0.0  # ZeRO-3: parameters gathered at once for their use (forward/backward moment)
    p2p_buffers_bytes: float = 0.0  # point-to-point buffers in flight (forward/backward moment)

    @property
    def persistent_bytes(self) -> float:
        return self.weights_bytes + self.master_weights_bytes + self.grads_bytes + self.optimizer_bytes

    @_cached
    def phases(self) -> dict[str, float]:
        """Transient bytes of each moment of the step (added to the persistent state)."""
        return {"forward_backward": self.activations_bytes + self.fb_temporaries_bytes + self.gathered_bytes
                + self.p2p_buffers_bytes,
                "grad_sync": self.grad_sync_buffer_bytes, "optimizer_step": self.optimizer_temporaries_bytes}

    @_cached
    def peak_phase(self) -> str:
        ph = self.phases
        return max(PHASES, key=lambda p: ph[p])  # ties go to the first (forward/backward)

    @_cached
    def allocated_bytes(self) -> float:
        """What the allocator hands out at the peak (``torch.cuda.max_memory_allocated``)."""
        return self.persistent_bytes + self.phases[self.peak_phase]

    @property
    def reserved_bytes(self) -> float:
        """What the caching allocator holds at the peak (``torch.cuda.max_memory_reserved``)."""
        return self.allocated_bytes * (1 + self.fragmentation_ratio)

    @_cached
    def parts(self) -> dict[str, float]:
        """The peak's parts; they add up to :attr:`total_bytes`."""
        peak = self.peak_phase
        fb, sync, step = (peak == p for p in PHASES)
        return {
            "weights": self.weights_bytes, "master_weights": self.master_weights_bytes, "grads": self.grads_bytes,
            "optimizer": self.optimizer_bytes,
            "activations": self.activations_bytes if fb else 0.0,
            "fb_temporaries": self.fb_temporaries_bytes if fb else 0.0,
            "gathered_weights": self.gathered_bytes if fb else 0.0,
            "p2p_buffers": self.p2p_buffers_bytes if fb else 0.0,
            "grad_sync_buffer": self.grad_sync_buffer_bytes if sync else 0.0,
            "optimizer_temporaries": self.optimizer_temporaries_bytes if step else 0.0,
            "fragmentation": self.allocated_bytes * self.fragmentation_ratio,
            "framework_context": self.framework_context_bytes, "comm_buffers": self.comm_buffers_bytes,
        }

    @_cached
    def total_bytes(self) -> float:
        """The device's predicted peak: allocator reserve at the peak plus what lives outside it. The sum
        of ``parts`` in their order, term for term (so bit for bit), without building the dicts: the
        planner reads it of ~10^5 memories."""
        fb = self.activations_bytes + self.fb_temporaries_bytes + self.gathered_bytes + self.p2p_buffers_bytes
        sync, step = self.grad_sync_buffer_bytes, self.optimizer_temporaries_bytes
        at_fb = fb >= sync and fb >= step  # peak_phase: ties go to the first phase
        at_sync = not at_fb and sync >= step
        allocated = self.persistent_bytes + (fb if at_fb else sync if at_sync else step)
        return sum((self.weights_bytes, self.master_weights_bytes, self.grads_bytes, self.optimizer_bytes,
                    self.activations_bytes if at_fb else 0.0, self.fb_temporaries_bytes if at_fb else 0.0,
                    self.gathered_bytes if at_fb else 0.0, self.p2p_buffers_bytes if at_fb else 0.0,
                    sync if at_sync else 0.0, step if not (at_fb or at_sync) else 0.0,
                    allocated * self.fragmentation_ratio, self.framework_context_bytes, self.comm_buffers_bytes))

    def binding_part(self) -> str:
        parts = self.parts
        return max(parts, key=lambda k: parts[k])

    def with_parts(self, **changes: float) -> StageMemory:
        """``dataclasses.replace(self, **changes)`` without its per-field work (the optimizer sharding
        makes one per stage of every plan the planner checks): the fields copied, ``changes`` over them,
        nothing cached carried over."""
        if not _FIELDS.issuperset(changes):
            raise TypeError(f"StageMemory has no field {sorted(set(changes) - _FIELDS)}")
        out = object.__new__(StageMemory)
        own = self.__dict__
        out.__dict__.update({f: own[f] for f in _FIELDS}, **changes)
        return out


_FIELDS = frozenset(f.name for f in fields(StageMemory))

# stage_memory's terms of the stage's shape alone (its parameters, and what a layer keeps with and
# without its recomputation) by model (id, pinned) and shape: the planner prices ~10^4 stages, mostly
# a few shapes under many in-flight counts and sync shapes.
_SHAPE_TERMS = Kept(20_000)


def stage_memory(
    model: ModelSpec, *, layers: int, embedding: bool, head: bool, tp: int, mbs: int, seq_len: int,
    recompute: Recompute | str | bool, precision: str, in_flight: int, vocab_parallel: bool = True,
    attention: str = "flash",
    kind: DeviceKind | None = None, synced: bool = False, mixed_sync: bool = False, communicators: int = 1,
    sync_bucket_params: float | None = None, sequence_parallel: bool = False, cp: int = 1,
    p2p_bytes: float | None = None,
) -> StageMemory:
    """Peak memory of one device of a stage (see the module docstring for the parts).

    ``recompute``: the stage's :class:`~hethub.plan.Recompute` mode (a bool means full or none).
    ``in_flight``: micro-batches whose activations the stage holds at its peak under the schedule.
    ``kind``: supplies the framework reserve, fragmentation and whether the optimizer step runs
    multi-tensor (accelerators) or tensor by tensor (CPU); None counts none of them (bare tensors).
    ``synced``: the stage's gradients are reduced with other holders; ``mixed_sync``: some group's
    holders differ in TP degree (its buckets are built at full size for the reduction).
    ``sync_bucket_params``: parameters (on this device) of those mixed groups; None: all of the
    stage's.
    ``communicators``: collective-library communicators this device joins (each holds buffers).
    ``sequence_parallel``, ``cp``: the stage's sequence and context parallelism (the seq_len is the
    whole sequence's; a device holds seq_len / cp tokens of each).
    ``p2p_bytes``: the stage's point-to-point buffers in flight (:func:`~hethub.predict.memory.p2p.p2p_buffer_bytes`
    for a plan's stage, which ``PlanCosts.p2p_bytes`` prices); None: an upper bound for callers that
    know neither the stage's neighbours nor its position in the order yet (the planner's search),
    ``schedules.messages.max_live_messages(in_flight)`` whole messages in this precision's boundary
    dtype (a neighbour of a wider dtype sends wider messages), each a small fraction of one
    micro-batch's activations.
    """
    recompute = Recompute.of(recompute)
    sp = sequence_parallel and tp > 1
    params, full_layer, kept_layer = _SHAPE_TERMS.get(
        (id(model), layers, embedding, head, tp, vocab_parallel, seq_len, attention, precision, recompute, sp, cp),
        lambda: (stage_params(model, layers=layers, embedding=embedding, head=head, tp=tp,
                              vocab_parallel=vocab_parallel),
                 act.layer_bytes_per_token(model, tp=tp, seq_len=seq_len, attention=attention, precision=precision,
                                           recompute=False, sp=sp, cp=cp),
                 act.layer_bytes_per_token(model, tp=tp, seq_len=seq_len, attention=attention, precision=precision,
                                           recompute=recompute, sp=sp, cp=cp)),
        pin=(model,))
    per = state_bytes_per_param(precision)
    tokens = mbs * seq_len / cp if cp > 1 else mbs * seq_len
    vtp = tp if vocab_parallel else 1
    per_mb = layers * kept_layer
    if embedding:
        per_mb += act.embedding_bytes_per_token(model, vocab_tp=vtp)
    if head:
        per_mb += act.head_bytes_per_token(model, vocab_tp=vtp, precision=precision, tp=tp, sp=sp)
    acts = in_flight * (tokens * per_mb + (act.head_bytes_per_micro_batch(vocab_tp=vtp) if head else 0.0))
    # One micro-batch's working set beyond what is kept (estimates, docs/predictor.md): the loss's
    # logits at the head; under full recomputation the re-run layer's full activations and their
    # gradients; under selective one layer's gradients (about its kept activations) plus what its
    # re-run core saves (the part selective does not keep); else one layer's gradients.
    work = 0.0
    if layers:
        rerun = {Recompute.NONE: 0.0, Recompute.SELECTIVE: full_layer - kept_layer, Recompute.FULL: full_layer}
        work = tokens * (full_layer + rerun[recompute])
    if head:
        work = max(work, tokens * act.head_transient_bytes_per_token(model, vocab_tp=vtp, precision=precision))
    grads = params * per["grads"]
    sync = 0.0
    if synced and mixed_sync:  # full-size buckets of the groups mixing TP degrees (same-TP ones: in place)
        bucket = params if sync_bucket_params is None else sync_bucket_params
        sync = bucket * per["grads"] * tp
    gpu_like = kind is not None and kind.device_type != "cpu"
    if gpu_like:
        step_tmp = params * 4  # foreach AdamW: sqrt(exp_avg_sq) for every fp32 parameter at once
    else:
        step_tmp = _largest_tensor(model, embedding=embedding, head=head, tp=tp, vtp=vtp) * 4 * 2
        step_tmp = min(step_tmp, params * 4 * 2)
    return StageMemory(
        weights_bytes=params * per["weights"], master_weights_bytes=params * per["master_weights"],
        grads_bytes=grads, optimizer_bytes=params * per["optimizer"], activations_bytes=acts,
        fb_temporaries_bytes=work, grad_sync_buffer_bytes=sync, optimizer_temporaries_bytes=step_tmp,
        fragmentation_ratio=kind.fragmentation if kind is not None else 0.0,
        framework_context_bytes=kind.context_bytes if kind is not None else 0.0,
        comm_buffers_bytes=kind.comm_buffer_bytes * communicators if kind is not None else 0.0,
        p2p_buffers_bytes=(max_live_messages(in_flight) * tokens * model.hidden_size * act_bytes_for(precision)
                           if p2p_bytes is None else p2p_bytes),
    )


def sharded_memory(mem: StageMemory, *, moment_elems: float, master_elems: float, precision: str,
                   kind: DeviceKind | None) -> StageMemory:
    """``mem`` (a stage's unsharded memory) under ZeRO-1 (``runtime/zero.py``, shard sizes from
    ``predict/sharding.py``): the device keeps AdamW moments for ``moment_elems`` elements only, and
    their fp32 master copies (:func:`sharded_master_bytes`). The optimizer step's scratch shrinks with
    the slice (multi-tensor AdamW on accelerators); on CPU it runs piece by piece, at most the slice.
    Gradient bytes are unchanged, also under ZB-H1: its split weight pass (``runtime/weight_grad.py``)
    hands hooked parameters' gradients to autograd's accumulation, so ZeRO-1's hooks move them to
    the fp32 ``main_grad`` and drop the 16-bit ``.grad`` as in a whole backward."""
    per = state_bytes_per_param(precision)
    gpu_like = kind is not None and kind.device_type != "cpu"
    step_tmp = moment_elems * 4 if gpu_like else min(mem.optimizer_temporaries_bytes, moment_elems * 4 * 2)
    return mem.with_parts(optimizer_bytes=moment_elems * per["optimizer"],
                   master_weights_bytes=sharded_master_bytes(precision, moment_elems=moment_elems,
                                                             master_elems=master_elems),
                   optimizer_temporaries_bytes=step_tmp)


def zero23_memory(mem: StageMemory, *, stage: int, moment_elems: float, grad_bytes: float, whole_weight_bytes: float,
                  gathered_bytes: float, round_bytes: float) -> StageMemory:
    """``mem`` (under ZeRO-1, :func:`sharded_memory`) under ZeRO-2 or 3 (``runtime/zero_grads.py``; the
    bytes from ``predict/zero23_bytes.zero23_rank_bytes``): the gradients are the fp32 shard of the owned
    elements; the rounds of per-micro-batch reductions in flight (a bound: buckets at their largest)
    live while the backward runs and at the sync. ZeRO-3 keeps only the parameters of groups it does
    not gather, gathers the others per use (``gathered_bytes``, at their peak) and keeps an fp32 master
    of every owned element, also in fp32 (the parameter it would view is freed)."""
    out = mem.with_parts(grads_bytes=grad_bytes, grad_sync_buffer_bytes=round_bytes,
                  fb_temporaries_bytes=mem.fb_temporaries_bytes + round_bytes)
    if stage == 3:
        out = out.with_parts(weights_bytes=whole_weight_bytes, gathered_bytes=gathered_bytes,
                      master_weights_bytes=moment_elems * 4)
    return out


def sharded_master_bytes(precision: str, *, moment_elems: float, master_elems: float) -> float:
    """fp32 master bytes a ZeRO-1 rank keeps (``runtime/zero.py``). In mixed precision the parameters
    are stored in the compute dtype and every owned element has its master (``moment_elems``): the
    masters are sharded with the moments. In fp32 the parameters are their own masters; only the
    ``master_elems`` owned in buckets whose holders differ in TP degree (the rank may not hold those
    parameters) get a copy."""
    if state_bytes_per_param(precision)["master_weights"]:
        return moment_elems * 4
    return master_elems * 4


def _largest_tensor(model: ModelSpec, *, embedding: bool, head: bool, tp: int, vtp: int) -> float:
    """Elements of the stage's largest parameter tensor (a per-tensor optimizer step's scratch)."""
    h = model.hidden_size
    big = max(model.ffn_hidden_size * h / tp, h * h / tp)
    if embedding or head:
        big = max(big, model.embedding_parts[0] / vtp)
    return big
