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
  (:func:`hethub.predict.sync_overlap.exposed_sync_groups`); False: it starts after the whole schedule.
* ``tp_wgrad_overlap``: the all-reduce of a column-parallel layer's input gradient runs while the
  layer's weight-gradient GEMM computes (so only the part longer than that GEMM is exposed).
* ``attentions``: the attention kernels the runtime runs ("flash", "math", "fused": a fused
  scale-mask-softmax between two score GEMMs).

What it can run (``hethub plan --runtime`` searches only that; :func:`runtime_refusals` names what a
plan asks beyond it):

* ``schedules``: the pipeline schedules it executes (:data:`hethub.schedules.SCHEDULES` names).
* ``shardings``: its optimizer shardings (``training.optimizer_sharding``: none, zero1, zero2, zero3).
* ``unequal_tp``: stages of one pipeline may have different TP degrees.
* ``unequal_replicas``: data-parallel replicas may differ (kinds, stage count, layer split).
* ``unequal_shares``: replicas may run different micro-batch counts (and sizes).
* ``stage_recompute``: each stage chooses its own recomputation (False: none planned).
* ``sequence_parallel``, ``context_parallel``: Megatron-style SP on TP stages; CP across ranks.

hethub's own entry describes exactly what ``runtime/`` does (tests/unit/test_runtime_profiles.py
reads that code where it can). Pure: the planner and ``hethub predict`` use it without torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hethub.schedules import AUTO_CANDIDATES, LOCKSTEP, SCHEDULES

# The attention kernels any runtime may offer; the catalog's per-kind default is one of the first two.
ATTENTION_KINDS = ("flash", "math", "fused")
# The yes/no capabilities, each with the plan feature it allows (runtime_refusals' words).
CAPABILITIES = {"unequal_tp": "stages of one pipeline with different TP degrees",
                "unequal_replicas": "data-parallel replicas that differ in kinds, stages or layer split",
                "unequal_shares": "replicas with unequal batch shares (micro-batch counts or sizes)",
                "stage_recompute": "per-stage activation recomputation",
                "sequence_parallel": "sequence parallelism", "context_parallel": "context parallelism"}


@dataclass(frozen=True)
class RuntimeProfile:
    name: str
    p2p: str
    dp_overlap: bool
    tp_wgrad_overlap: bool
    attentions: tuple[str, ...]
    # Where each property comes from (the runtime's code), by property name.
    sources: tuple[tuple[str, str], ...]
    schedules: tuple[str, ...] = SCHEDULES
    shardings: tuple[str, ...] = ("none", "zero1", "zero2", "zero3")
    unequal_tp: bool = True
    unequal_replicas: bool = True
    unequal_shares: bool = True
    stage_recompute: bool = True
    sequence_parallel: bool = True
    context_parallel: bool = True

    @property
    def runs_stage_modes(self) -> bool:
        """Whether it runs every stage mode (recomputation, SP): its refusals of a plan do not depend on them."""
        return self.stage_recompute and self.sequence_parallel

    @property
    def auto_schedules(self) -> tuple[str, ...]:
        """The schedules the planner chooses among for schedule "auto" under this runtime."""
        return tuple(n for n in AUTO_CANDIDATES if n in self.schedules)

    def planner_error(self, *, schedule: str, sharding: str) -> str | None:
        """Why a planner forced to ``schedule`` / optimizer ``sharding`` cannot plan for this runtime, as
        "field ... Fix: ..." (None when it can; "auto" always can)."""
        if schedule != "auto" and schedule not in self.schedules:
            return (f"planner option 'schedule' is {schedule!r}, which the {self.name} runtime does not run "
                    f"({self.source('schedules')}). Fix: use --schedule {' or '.join(self.schedules)} or auto, or "
                    f"plan for a runtime that runs it (--runtime hethub).")
        if sharding != "auto" and sharding not in self.shardings:
            return (f"planner option 'optimizer_sharding' is {sharding!r}, which the {self.name} runtime does not "
                    f"run ({self.source('shardings')}). Fix: use --optimizer-sharding "
                    f"{' or '.join(self.shardings)} or auto, or --runtime hethub.")
        return None

    def source(self, prop: str) -> str:
        return dict(self.sources)[prop]

    def describe(self) -> dict[str, object]:
        """Each property with its value and source (``hethub predict --json``: sources.runtime)."""
        values = {"p2p": self.p2p, "dp_overlap": self.dp_overlap, "tp_wgrad_overlap": self.tp_wgrad_overlap,
                  "attentions": list(self.attentions), "schedules": list(self.schedules),
                  "shardings": list(self.shardings), **{k: getattr(self, k) for k in CAPABILITIES}}
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
        ("schedules", "runtime/pipeline.py runs any registered schedule's op order (hethub.schedules)"),
        ("shardings", "runtime/zero.py (ZeRO-1/2 slices), runtime/zero_params.py (ZeRO-3 gathers)"),
        ("unequal_tp", "layout.py: activations routed between stages of different TP degree"),
        ("unequal_replicas", "layout.py unit_holders: gradients synced among whichever stages hold a layer"),
        ("unequal_shares", "runtime/data.py: each pipeline's sample offset and micro-batch count from the plan"),
        ("stage_recompute", "runtime/model.py: each stage's recompute mode from the plan"),
        ("sequence_parallel", "runtime/tensor_parallel.py: sequence-parallel regions on TP stages"),
        ("context_parallel", "runtime/context_parallel.py"),
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
        ("schedules", "Megatron-LM megatron/core/pipeline_parallel/schedules.py: "
                      "forward_backward_pipelining_without_interleaving (1F1B) and _with_interleaving "
                      "(--num-layers-per-virtual-pipeline-stage); no GPipe or zero-bubble schedule"),
        ("shardings", "Megatron-LM --use-distributed-optimizer (megatron/core/optimizer/distrib_optimizer.py): "
                      "optimizer state sharded over data-parallel ranks, i.e. ZeRO-1"),
        ("unequal_tp", "Megatron-LM megatron/core/parallel_state.py initialize_model_parallel: one "
                       "tensor_model_parallel_size for every stage"),
        ("unequal_replicas", "Megatron-LM parallel_state.py: every data-parallel replica has the same pipeline "
                             "(one pipeline_model_parallel_size, one layer split)"),
        ("unequal_shares", "Megatron-LM megatron/core/num_microbatches_calculator.py: global_batch_size / "
                           "(micro_batch_size x data_parallel_size) micro-batches on every replica"),
        ("stage_recompute", "Megatron-LM --recompute-granularity / --recompute-method: one setting for the model"),
        ("sequence_parallel", "Megatron-LM --sequence-parallel (megatron/core/tensor_parallel/mappings.py)"),
        ("context_parallel", "Megatron-LM --context-parallel-size (megatron/core/parallel_state.py)"),
    ),
    schedules=("1f1b", "interleaved"), shardings=("none", "zero1"), unequal_tp=False, unequal_replicas=False,
    unequal_shares=False, stage_recompute=False)

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
        ("schedules", "DeepSpeed deepspeed/runtime/pipe/schedule.py TrainSchedule: 1F1B order, one model chunk "
                      "per stage; no interleaving or zero-bubble schedule"),
        ("shardings", "DeepSpeed deepspeed/runtime/pipe/engine.py PipelineEngine.__init__ asserts "
                      "zero_optimization_stage() < ZeroStageEnum.gradients: ZeRO-1 at most with pipelines"),
        ("unequal_tp", "Sailor's DeepSpeed fork (eth-easl/sailor; its plans' tmp_per_stage: a TP degree per "
                       "stage and replica); stock DeepSpeed takes one TP size from its mpu"),
        ("unequal_replicas", "Sailor's DeepSpeed fork: one pipeline_list entry per layer split, kinds per "
                             "stage and replica"),
        ("unequal_shares", "DeepSpeed deepspeed/runtime/config.py: train_batch_size = micro_batch x "
                           "gradient_accumulation_steps x data-parallel size, the same on every rank (Sailor: "
                           "ceil(gbs / (mbs x dp x pipelines)) per replica)"),
        ("stage_recompute", "DeepSpeed deepspeed/runtime/pipe/module.py PipelineModule "
                            "activation_checkpoint_interval: one interval for every stage (Sailor's plans: none)"),
        ("sequence_parallel", "DeepSpeed's PipelineEngine passes one activation tensor per micro-batch between "
                              "stages; Megatron-style sequence parallelism is not modelled with it here"),
        ("context_parallel", "DeepSpeed's PipelineEngine: no context-parallel groups"),
    ),
    schedules=("1f1b",), shardings=("none", "zero1"), unequal_shares=False, stage_recompute=False,
    sequence_parallel=False, context_parallel=False)

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
    what it does), by its lists above: ``sequence_parallel``, ``context_parallel``, ``shardings``."""
    r = runtime_profile(name)
    return ((not sequence_parallel or r.sequence_parallel) and (cp <= 1 or r.context_parallel)
            and (zero_stage < 2 or f"zero{zero_stage}" in r.shardings))


def runtime_refusals(plan: Any, name: str | None = None) -> list[str]:
    """What of ``plan`` the runtime ``name`` (default: the plan's ``training.runtime``) cannot run, each
    as "field: problem" naming the plan's field; empty when it runs all of it."""
    r = runtime_profile(name or plan.runtime)
    out = []
    if plan.schedule not in r.schedules:
        out.append(f"schedule is {plan.schedule!r}; the {r.name} runtime runs {', '.join(r.schedules)}")
    if plan.optimizer_sharding not in r.shardings:
        out.append(f"training.optimizer_sharding is {plan.optimizer_sharding!r}; the {r.name} runtime runs "
                   f"{', '.join(r.shardings)}")
    ps = plan.pipelines
    found = {
        "unequal_tp": any(len({s.tp for s in p.stages}) > 1 for p in ps),
        "unequal_replicas": len({tuple((s.kind, s.tp, s.layers, s.chunks) for s in p.stages) for p in ps}) > 1,
        "unequal_shares": len({(p.num_micro_batches, p.micro_batch_size) for p in ps}) > 1,
        "stage_recompute": any(s.recompute for p in ps for s in p.stages),
        "sequence_parallel": any(s.sequence_parallel for p in ps for s in p.stages),
        "context_parallel": any(s.cp > 1 for p in ps for s in p.stages),
    }
    out += [f"pipelines: {CAPABILITIES[k]}, which the {r.name} runtime does not run ({r.source(k)})"
            for k, there in found.items() if there and not getattr(r, k)]
    return out


def planner_error(name: str, *, schedule: str, sharding: str) -> str | None:
    """`RuntimeProfile.planner_error` of runtime ``name``, or why ``name`` is not a runtime."""
    if name not in RUNTIMES:
        return f"planner option 'runtime' is {name!r}. Fix: use one of {', '.join(RUNTIMES)}."
    return RUNTIMES[name].planner_error(schedule=schedule, sharding=sharding)
