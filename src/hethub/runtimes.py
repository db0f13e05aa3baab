"""Runtime profiles: what the runtime that trains a plan overlaps and fuses (``training.runtime``).

The same plan runs at different speeds under different training runtimes, because they overlap and
fuse different work. A profile names those properties once; the predictor prices a plan under its
runtime's profile (predict/comm.py, predict/sync.py, the schedule simulation) and the plan validator
refuses what the runtime cannot run. Each property carries the code it describes.

Properties:

* ``p2p``: how stages send (:data:`hethub.schedules.P2P_MODES`): "async" (post the send, go on),
  "blocking" (the sender waits for delivery), "lockstep" (DeepSpeed's rendezvous order). A plan's
  ``training.p2p`` overrides it (e.g. Megatron without ``overlap_p2p_comm``).
* ``dp_overlap``: the data-parallel gradient reduction starts in buckets during the last backward
  (:func:`hethub.predict.sync.exposed_sync_groups`); False: it starts after the whole schedule.
* ``tp_wgrad_overlap``: the all-reduce of a column-parallel layer's input gradient runs while the
  layer's weight-gradient GEMM computes (so only the part longer than that GEMM is exposed).
* ``attentions``: the attention kernels the runtime runs ("flash", "math", "fused": a fused
  scale-mask-softmax between two score GEMMs).

hethub's own entry describes exactly what ``runtime/`` does (tests/unit/test_runtime_profiles.py
reads that code where it can). Pure: the planner and ``hethub predict`` use it without torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from hethub.schedules import LOCKSTEP

# The attention kernels any runtime may offer; the catalog's per-kind default is one of the first two.
ATTENTION_KINDS = ("flash", "math", "fused")


@dataclass(frozen=True)
class RuntimeProfile:
    name: str
    p2p: str
    dp_overlap: bool
    tp_wgrad_overlap: bool
    attentions: tuple[str, ...]
    # Where each property comes from (the runtime's code), by property name.
    sources: tuple[tuple[str, str], ...]

    def source(self, prop: str) -> str:
        return dict(self.sources)[prop]

    def describe(self) -> dict[str, object]:
        """Each property with its value and source (``hethub predict --json``: sources.runtime)."""
        values = {"p2p": self.p2p, "dp_overlap": self.dp_overlap, "tp_wgrad_overlap": self.tp_wgrad_overlap,
                  "attentions": list(self.attentions)}
        return {"name": self.name, **{k: {"value": v, "source": self.source(k)} for k, v in values.items()}}


HETHUB = RuntimeProfile(
    name="hethub", p2p="async", dp_overlap=True, tp_wgrad_overlap=False, attentions=("flash", "math"),
    sources=(
        ("p2p", "runtime/p2p.py: each message isend on its lane and on to the next op, receives posted one op "
                "ahead, a send waited for only once complete: Work.is_completed before and after each op, on gloo "
                "the op from which the stage knows its receive was posted (schedules/messages.py send_releases), "
                "the rest at the step's end"),
        ("dp_overlap", "runtime/grad_buffer.py: ~40M-element buckets all-reduced as their gradients become final "
                       "in the last micro-batch's backward, in reverse layer order"),
        ("tp_wgrad_overlap", "runtime/tensor_parallel.py: each TP all-reduce is waited for where it is issued; "
                             "nothing computes beside it"),
        ("attentions", "runtime/model.py: scaled_dot_product_attention with the memory-efficient (flash) kernel "
                       "or the written-out math path; no fused scale-mask-softmax"),
    ))

MEGATRON = RuntimeProfile(
    name="megatron", p2p="async", dp_overlap=True, tp_wgrad_overlap=True, attentions=("flash", "math", "fused"),
    sources=(
        ("p2p", "Megatron-LM megatron/core/pipeline_parallel/schedules.py with config.overlap_p2p_comm: sends "
                "posted and waited for before the op that needs the buffer (set training.p2p = 'blocking' for "
                "its default batched, waited send_forward_recv_backward)"),
        ("dp_overlap", "Megatron-LM megatron/core/distributed/distributed_data_parallel.py with overlap_grad_reduce: "
                       "bucketed reduce-scatter/all-reduce started by backward hooks"),
        ("tp_wgrad_overlap", "Megatron-LM megatron/core/tensor_parallel/layers.py "
                             "LinearWithGradAccumulationAndAsyncCommunication: the input gradient's all-reduce is "
                             "launched async before the weight-gradient GEMM and waited for after it"),
        ("attentions", "Megatron-LM megatron/core/fusions/fused_softmax.py FusedScaleMaskSoftmax (one kernel for "
                       "scale, mask and softmax), and flash attention through Transformer Engine"),
    ))

DEEPSPEED = RuntimeProfile(
    name="deepspeed", p2p=LOCKSTEP, dp_overlap=False, tp_wgrad_overlap=False, attentions=("flash", "math", "fused"),
    sources=(
        ("p2p", "DeepSpeed deepspeed/runtime/pipe/engine.py, schedule.py: blocking dist.send / dist.recv in "
                "TrainSchedule's lock-step order"),
        ("dp_overlap", "DeepSpeed deepspeed/runtime/pipe/engine.py PipelineEngine: ReduceGrads is an instruction "
                       "after the schedule's last backward (_exec_reduce_grads), so nothing overlaps it"),
        ("tp_wgrad_overlap", "DeepSpeed's pipeline engine runs the model's own TP layers (Megatron-DeepSpeed's "
                             "synchronous mappings): the all-reduce is waited for where it is issued"),
        ("attentions", "Megatron-DeepSpeed megatron/model/fused_softmax.py FusedScaleMaskSoftmax, or flash "
                       "attention where installed"),
    ))

RUNTIMES: dict[str, RuntimeProfile] = {r.name: r for r in (HETHUB, MEGATRON, DEEPSPEED)}
DEFAULT_RUNTIME = HETHUB.name


def runtime_profile(name: str) -> RuntimeProfile:
    """The profile called ``name``; a ValueError naming the choices otherwise."""
    try:
        return RUNTIMES[name]
    except KeyError:
        raise ValueError(f"unknown runtime {name!r}; use one of {', '.join(RUNTIMES)}") from None


def runtime_runs(name: str, *, sequence_parallel: bool = False, cp: int = 1, zero_stage: int = 0) -> bool:
    """Whether runtime ``name`` runs a plan with these memory-scaling choices (the planner offers only
    what it does). hethub's runtime runs all of them (``runtime/tensor_parallel.py`` SP,
    ``runtime/context_parallel.py``, ``runtime/zero_grads.py`` / ``zero_params.py``); the other runtimes
    are offered none of them until their own lists say which they run."""
    return name == HETHUB.name or not (sequence_parallel or cp > 1 or zero_stage >= 2)
