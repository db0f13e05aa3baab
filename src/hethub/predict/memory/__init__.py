"""Per-device memory of a pipeline stage, by named part: the one memory model that the predictor,
the planner and the reports use (see :mod:`.model` for the parts, :mod:`.activations` for the
per-layer formula, :mod:`.capacity` for the headroom). How many micro-batches are in flight is the
schedule's rule (:meth:`hethub.schedules.Schedule.in_flight`); callers pass its count as ``in_flight``."""

from __future__ import annotations

from hethub.predict.memory.capacity import (
    DEFAULT_MEM_HEADROOM,
    check_headroom,
    describe_peak,
    over_capacity_message,
    usable_bytes,
)
from hethub.predict.memory.model import (
    PARTS,
    PHASES,
    STATE_BYTES_PER_PARAM,
    StageMemory,
    act_bytes_for,
    layer_elems,
    sharded_memory,
    stage_memory,
    stage_params,
    state_bytes_per_param,
    zero23_memory,
)
from hethub.predict.memory.p2p import MessageBytes, message_bytes, p2p_buffer_bytes
from hethub.spec.model import ModelSpec

# hethub's runtime splits the embedding and the head by vocabulary across a stage's TP group, as
# Megatron does, except where the TP degree does not divide the vocabulary: that stage replicates
# them (see ``runtime_vocab_parallel``). The predictor passes this so its memory matches the runtime.
RUNTIME_VOCAB_PARALLEL = True

__all__ = [
    "DEFAULT_MEM_HEADROOM",
    "PARTS",
    "PHASES",
    "RUNTIME_VOCAB_PARALLEL",
    "STATE_BYTES_PER_PARAM",
    "MessageBytes",
    "StageMemory",
    "act_bytes_for",
    "check_headroom",
    "describe_peak",
    "layer_elems",
    "message_bytes",
    "over_capacity_message",
    "p2p_buffer_bytes",
    "runtime_vocab_parallel",
    "sharded_memory",
    "stage_memory",
    "stage_params",
    "state_bytes_per_param",
    "usable_bytes",
    "zero23_memory",
]


def runtime_vocab_parallel(model: ModelSpec, tp: int) -> bool:
    """Whether the runtime splits a TP-``tp`` stage's embedding and head by vocabulary (mirrors
    ``hethub.runtime.tensor_parallel.vocab_parallel``; no torch import here)."""
    return RUNTIME_VOCAB_PARALLEL and model.vocab_tp(tp) == tp
