"""Per-device memory of a pipeline stage: weights, gradients, optimizer state, activations in flight.

How many micro-batches are in flight is the schedule's rule (:meth:`hethub.schedules.Schedule.in_flight`);
callers pass its count as ``in_flight``."""

from __future__ import annotations

from dataclasses import dataclass

from hethub.spec.model import ModelSpec

# Usable share of device memory: allocator fragmentation and the runtime's context take the rest.
USABLE_FRACTION = 0.92
# hethub's runtime splits the embedding and the head by vocabulary across a stage's TP group, as
# Megatron does, except where the TP degree does not divide the vocabulary: that stage replicates
# them (see ``runtime_vocab_parallel``). The predictor passes this so its memory matches the runtime.
RUNTIME_VOCAB_PARALLEL = True


def runtime_vocab_parallel(model: ModelSpec, tp: int) -> bool:
    """Whether the runtime splits a TP-``tp`` stage's embedding and head by vocabulary (mirrors
    ``hethub.runtime.tensor_parallel.vocab_parallel``; no torch import here)."""
    return RUNTIME_VOCAB_PARALLEL and model.vocab_size % tp == 0


@dataclass(frozen=True)
class StageMemory:
    weights_bytes: float
    grads_bytes: float
    optimizer_bytes: float
    activations_bytes: float

    @property
    def total_bytes(self) -> float:
        return self.weights_bytes + self.grads_bytes + self.optimizer_bytes + self.activations_bytes


def act_bytes_for(precision: str) -> int:
    return 2 if precision in ("bf16-mixed", "fp16-mixed") else 4


def stage_params(model: ModelSpec, *, layers: int, embedding: bool, head: bool, tp: int,
                 vocab_parallel: bool = True) -> float:
    """Parameters held by one device of a stage (TP splits matmuls, and embedding and head by
    vocabulary where ``vocab_parallel``; otherwise those are replicated)."""
    h = model.hidden_size
    per_layer = model.layer_matmul_params / tp + (model.layer_params - model.layer_matmul_params)
    n = layers * per_layer
    vtp = tp if vocab_parallel else 1
    if embedding:
        n += model.vocab_size * h / vtp + (model.embedding_params - model.vocab_size * h)
    if head:
        n += model.head_params / vtp + model.final_norm_params
    return n


def stage_memory(
    model: ModelSpec, *, layers: int, embedding: bool, head: bool, tp: int, mbs: int, seq_len: int,
    recompute: bool, precision: str, in_flight: int, vocab_parallel: bool = True,
) -> StageMemory:
    params = stage_params(model, layers=layers, embedding=embedding, head=head, tp=tp, vocab_parallel=vocab_parallel)
    per_param = ModelSpec.state_bytes_per_param(precision)
    ab = act_bytes_for(precision)
    tokens = mbs * seq_len
    per_layer = model.layer_activation_bytes_per_token(tp=tp, recompute=recompute, act_bytes=ab)
    acts = in_flight * tokens * layers * per_layer
    if recompute and layers:
        # Backward re-runs one layer's forward at a time, holding its full activations transiently.
        acts += tokens * model.layer_activation_bytes_per_token(tp=tp, recompute=False, act_bytes=ab)
    if embedding:
        acts += in_flight * tokens * model.hidden_size * ab
    if head:
        # The loss saves its logits (and softmax) for backward, so every micro-batch in flight on
        # the head stage holds them: one under 1F1B (the last stage), all m under GPipe.
        acts += in_flight * tokens * model.head_activation_bytes_per_token(tp=tp if vocab_parallel else 1,
                                                                           act_bytes=ab)
    return StageMemory(
        weights_bytes=params * per_param["weights"],
        grads_bytes=params * per_param["grads"],
        optimizer_bytes=params * per_param["optimizer"],
        activations_bytes=acts,
    )
