"""The versioned, human-readable parallel plan: pipelines -> stages -> devices, layers, TP.

A plan is self-contained: it embeds the model and cluster it was made for, so `hethub predict` and
the runtime need nothing else. Pipelines are data-parallel replicas that may differ in everything
(kinds, layer splits, TP degrees, micro-batch counts); the runtime synchronises gradients among
whichever ranks hold each parameter.

Torch ranks are the plan's devices in ascending device-id order, so a plan that leaves devices idle
still launches with a dense ``world_size``.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from hethub.errors import PlanError, SpecError, load_json
from hethub.plan_parts import RECOMPUTE_MODES, Pipeline, Recompute, ShardWeights, Stage, interleave, split_evenly
from hethub.runtimes import ATTENTION_KINDS, DEFAULT_RUNTIME, RUNTIMES, runtime_profile
from hethub.schedules import DEFAULT_P2P, DEFAULT_SCHEDULE, LOCKSTEP, P2P_MODES, SCHEDULES, get_schedule
from hethub.schedules.lockstep import LOCKSTEP_FIX, lockstep_unsupported
from hethub.spec.cluster import Cluster
from hethub.spec.model import PRECISIONS, ModelSpec

__all__ = ["OPTIMIZER_SHARDINGS", "OPTIMIZER_SHARES", "PLAN_VERSION", "PLAN_VERSION_P2P", "RECOMPUTE_MODES",
           "Pipeline", "Plan", "Recompute", "ShardWeights", "Stage", "interleave", "split_evenly", "zero23_refusal",
           "zero_stage_of"]

PLAN_FORMAT = "hethub-plan"
# 2: per-kind "precision"/"attention" under training.kinds. Version 1 files (no per-kind settings)
# are still read; a version-1 reader would silently ignore per-kind settings, hence the bump.
# 3: a stage's "recompute" is "none" | "selective" | "full" (a version-2 reader would reject the words).
# Versions 1 and 2 (true/false) are still read: true is "full", false "none".
# 4: training.optimizer_sharding / training.optimizer_shares (a version-3 reader would silently train
# unsharded and could run out of memory). Older files read as unsharded.
# 5: stages may hold several layer chunks ("chunks", per-pipeline "virtual_stages"); written only for
# such plans, so that an older reader refuses them by version rather than misreading them.
# 6: training.p2p "blocking" or "lockstep" (the plan is for a runtime whose sends block; an older
# reader would silently predict asynchronous sends). Written only for such plans, for the same reason
# as 5. A version-6 reader that predates "lockstep" refuses it by name (training.p2p validation).
# 7: training.optimizer_shard_weights, the ZeRO-1 split the plan was scored with (an older reader
# would recompute the split at its default memory headroom, and a rank could then hold more optimizer
# state than predicted). Written only for sharded plans that carry it; sharded files without it still
# load, and the training entry point computes it (hethub.train).
# 8: a stage's "cp" (context parallelism: devices = tp x cp, CP-major) and "sequence_parallel"; an
# older reader would take every device for TP. Written only for plans that use either.
# 9: training.optimizer_sharding "zero2" or "zero3" (a version-8 reader would refuse the word anyway; the
# bump says which hethub runs them). Written only for such plans.
# 10: training.runtime other than "hethub" (hethub.runtimes: what the runtime overlaps and fuses; an
# older reader would predict the plan as hethub's runtime runs it). Written only for such plans.
PLAN_VERSION = 4
PLAN_VERSION_CHUNKS = 5
PLAN_VERSION_P2P = 6
PLAN_VERSION_SHARDS = 7
PLAN_VERSION_SEQ = 8
PLAN_VERSION_ZERO23 = 9
PLAN_VERSION_RUNTIME = 10
READABLE_VERSIONS = (1, 2, 3, 4, 5, 6, 7, 8, 9, 10)
KIND_SETTINGS = ("precision", "attention")
# Sharding across a parameter group's data-parallel holders (runtime/zero.py), one split for all three:
# "zero1" shards the AdamW moments and fp32 masters (ZeRO stage 1, Megatron's distributed optimizer);
# "zero2" also the gradients (each micro-batch's reduced onto their owners as its backward makes them,
# no whole gradient buffer); "zero3" also the parameters (gathered per layer before each use, released
# after: runtime/zero_params.py).
OPTIMIZER_SHARDINGS = ("none", "zero1", "zero2", "zero3")
# What the planner chooses among (hethub plan --optimizer-sharding; zero2/zero3 only for plans that
# zero23_refusal accepts).
PLANNED_SHARDINGS = ("none", "zero1", "zero2", "zero3")
# How a group's elements are split among its holders: in proportion to each holder's free device
# memory (predicted without optimizer state), or equally.
OPTIMIZER_SHARES = ("proportional", "equal")


@dataclass(frozen=True)
class Plan:
    model: ModelSpec
    cluster: Cluster
    global_batch: int  # sequences per optimizer step
    seq_len: int
    pipelines: tuple[Pipeline, ...]
    schedule: str = DEFAULT_SCHEDULE
    precision: str = "bf16-mixed"
    strategy: str = "manual"
    meta: dict[str, Any] = field(default_factory=dict, compare=False)
    # Per-kind overrides of the plan-wide precision and of the kind's default attention implementation:
    # {"v100-16gb": {"precision": "fp32", "attention": "math"}}. See precision_of / attention_of.
    kind_settings: dict[str, dict[str, str]] = field(default_factory=dict, hash=False)
    optimizer_sharding: str = "none"  # one of OPTIMIZER_SHARDINGS
    optimizer_shares: str = "proportional"  # one of OPTIMIZER_SHARES (used when sharded)
    # How the runtime that trains the plan sends between stages (hethub.schedules.P2P_MODES), which
    # the predictor models: "async" is hethub's runtime; "blocking" a runtime whose sends block
    # (Megatron-LM); "lockstep" DeepSpeed's pipeline engine, which Sailor uses (1F1B only). hethub's
    # runtime sends asynchronously whatever this says. Plans read from a file take their runtime's
    # (below) unless the file says otherwise; use with_runtime to change both.
    p2p: str = DEFAULT_P2P
    # The runtime the plan is predicted for (hethub.runtimes: what it overlaps and fuses). hethub's
    # runtime trains every plan; the others' plans are for prediction and planning.
    runtime: str = DEFAULT_RUNTIME
    # The ZeRO-1 split's weights per rank and the headroom they were computed at (None: not computed;
    # the training entry point computes them). Written and read only for sharded plans.
    shard_weights: ShardWeights | None = None

    def with_runtime(self, name: str) -> Plan:
        """The plan for runtime ``name``, sending as that runtime does."""
        return replace(self, runtime=name, p2p=runtime_profile(name).p2p)

    @property
    def splits_sequences(self) -> bool:
        """Whether some stage uses context or sequence parallelism (plan version 8)."""
        return any(s.cp > 1 or s.sequence_parallel for p in self.pipelines for s in p.stages)

    @property
    def sharded_optimizer(self) -> bool:
        return self.optimizer_sharding != "none"

    @property
    def zero_stage(self) -> int:
        """0 unsharded, else the ZeRO stage: 1 optimizer state, 2 and gradients, 3 and parameters."""
        return zero_stage_of(self.optimizer_sharding)

    def rank_shard_weights(self) -> dict[int, float]:
        """Each rank's weight in the ZeRO-1 split (``predict/sharding.py``), as the plan carries it."""
        if self.shard_weights is None:
            _fail("training.optimizer_shard_weights", "is missing from a plan with optimizer sharding",
                  "start training through 'python -m hethub.train' or 'hethub train' (they compute it at the "
                  "default memory headroom), or re-create the plan with 'hethub plan'")
        assert self.shard_weights is not None
        return dict(enumerate(self.shard_weights.by_rank))

    def precision_of(self, kind: str) -> str:
        """The precision stages of ``kind`` train in: the plan's per-kind setting, else the plan-wide
        precision where the kind runs it, else the kind's first supported one (e.g. fp32 on CPU,
        where the runtime never autocasts)."""
        own = self.kind_settings.get(kind, {}).get("precision")
        if own is not None:
            return own
        return self.cluster.kinds[kind].precision_for(self.precision)

    def attention_of(self, kind: str) -> str:
        """The attention implementation stages of ``kind`` use: the plan's per-kind setting, else the
        kind's default from the catalog ("math" on pre-Ampere GPUs)."""
        return self.kind_settings.get(kind, {}).get("attention") or self.cluster.kinds[kind].attention

    @functools.cached_property
    def devices(self) -> tuple[int, ...]:
        # Kept on the instance (frozen, so it cannot go stale): the predictor's sync and sharding
        # rules ask it per group, and a 4,096-device plan sorts 4,096 ids each time.
        return tuple(sorted(d for p in self.pipelines for d in p.devices))

    @property
    def world_size(self) -> int:
        return len(self.devices)

    @functools.cached_property
    def _rank_of(self) -> dict[int, int]:
        return {d: r for r, d in enumerate(self.devices)}

    def rank_of_device(self) -> dict[int, int]:
        """Each device's rank (the plan's devices in ascending id order); a copy the caller may change."""
        return dict(self._rank_of)

    def rank_of(self, device: int) -> int:
        """One device's rank (``rank_of_device`` without copying the whole map)."""
        return self._rank_of[device]

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq_len

    def with_meta(self, **meta: Any) -> Plan:
        return replace(self, meta={**self.meta, **meta})

    # ---- validation --------------------------------------------------------------------------------
    def validate(self) -> Plan:
        """Raise PlanError naming the first inconsistent field and how to fix it; return self if fine."""
        m, c = self.model, self.cluster
        if self.schedule not in SCHEDULES:
            _fail("schedule", f"is {self.schedule!r}", f"use one of {', '.join(SCHEDULES)}")
        if self.optimizer_sharding not in OPTIMIZER_SHARDINGS:
            _fail("training.optimizer_sharding", f"is {self.optimizer_sharding!r}",
                  f"use one of {', '.join(OPTIMIZER_SHARDINGS)}")
        if self.zero_stage >= 2:
            _check_zero23(self)
        if self.optimizer_shares not in OPTIMIZER_SHARES:
            _fail("training.optimizer_shares", f"is {self.optimizer_shares!r}",
                  f"use one of {', '.join(OPTIMIZER_SHARES)}")
        if self.sharded_optimizer and self.shard_weights is not None:
            _check_shard_weights(self.shard_weights, world_size=self.world_size)
        if self.runtime not in RUNTIMES:
            _fail("training.runtime", f"is {self.runtime!r}", f"use one of {', '.join(RUNTIMES)} (hethub: hethub's "
                  "own runtime, which trains the plan; megatron, deepspeed: predict the plan as those run it)")
        if self.p2p not in P2P_MODES:
            _fail("training.p2p", f"is {self.p2p!r}", f"use one of {', '.join(P2P_MODES)} (async: hethub's runtime; "
                  "blocking: a runtime whose sends block, such as Megatron-LM; lockstep: DeepSpeed's pipeline engine)")
        if self.p2p == LOCKSTEP:
            why = lockstep_unsupported(schedule=self.schedule,
                                       chunks=max((p.virtual_stages for p in self.pipelines), default=1))
            if why is not None:
                _fail("training.p2p", why, LOCKSTEP_FIX)
        if self.precision not in PRECISIONS:
            _fail("precision", f"is {self.precision!r}", f"use one of {', '.join(PRECISIONS)}")
        for kind, settings in self.kind_settings.items():
            kw = f"training.kinds.{kind}"
            if kind not in c.kinds:
                _fail(kw, f"names kind {kind!r}, not a kind of cluster {c.name!r}",
                      f"use one of {', '.join(c.kind_names)}")
            if not isinstance(settings, dict) or set(settings) - set(KIND_SETTINGS):
                _fail(kw, f"is {settings!r}", f"give an object with only {' and/or '.join(KIND_SETTINGS)}")
            prec, att = settings.get("precision"), settings.get("attention")
            if prec is not None and prec not in c.kinds[kind].precisions:
                _fail(f"{kw}.precision", f"is {prec!r}, which hethub's runtime does not run on {kind} "
                      f"(it runs {', '.join(c.kinds[kind].precisions)})", "use one of those or leave it out")
            if att is not None and att not in ATTENTION_KINDS:
                _fail(f"{kw}.attention", f"is {att!r}", f"use one of {', '.join(ATTENTION_KINDS)}")
            runs = runtime_profile(self.runtime).attentions
            if att is not None and att not in runs:
                _fail(f"{kw}.attention", f"is {att!r}, which the {self.runtime} runtime does not run (it runs "
                      f"{', '.join(runs)})", f"use one of those, or set training.runtime to one that runs {att!r} "
                      f"({', '.join(n for n, r in RUNTIMES.items() if att in r.attentions)}) to predict the plan "
                      "as that runtime runs it")
        if self.seq_len < 1 or self.seq_len > m.max_seq_len:
            _fail("seq_len", f"is {self.seq_len}, outside 1..{m.max_seq_len} (the model's max_seq_len)",
                  "use a sequence length the model supports")
        if not self.pipelines:
            _fail("pipelines", "is empty", "add at least one pipeline")
        used: dict[int, str] = {}
        for pi, p in enumerate(self.pipelines):
            where = f"pipelines[{pi}]"
            if p.micro_batch_size < 1 or p.num_micro_batches < 1:
                _fail(f"{where}.micro_batch_size/num_micro_batches",
                      f"are {p.micro_batch_size}/{p.num_micro_batches}", "both must be >= 1")
            if not p.stages:
                _fail(f"{where}.stages", "is empty", "give each pipeline at least one stage")
            for si, s in enumerate(p.stages):
                sw = f"{where}.stages[{si}]"
                _check_stage(s, sw, model=m, cluster=c, first=si == 0, last=si == len(p.stages) - 1)
                _check_seq_split(s, sw, seq_len=self.seq_len, cp0=p.stages[0].cp)
                for d in s.devices:
                    if d in used:
                        _fail(f"{sw}.devices", f"reuses device {d}, already used by {used[d]}",
                              "give every device to exactly one stage")
                    used[d] = sw
            _check_layer_ranges(p, where, model=m, schedule=self.schedule)
        total = sum(p.num_samples for p in self.pipelines)
        if total != self.global_batch:
            _fail("global_batch", f"is {self.global_batch} but the pipelines take {total} sequences "
                  "(sum of micro_batch_size x num_micro_batches)",
                  "make the pipelines' shares add up to the global batch")
        return self

    # ---- io ------------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        rank = self.rank_of_device()
        weights = self.shard_weights if self.sharded_optimizer else None
        return {
            "format": PLAN_FORMAT,
            "version": (PLAN_VERSION_RUNTIME if self.runtime != DEFAULT_RUNTIME else
                        PLAN_VERSION_ZERO23 if self.zero_stage >= 2 else PLAN_VERSION_SEQ if self.splits_sequences else
                        PLAN_VERSION_SHARDS if weights else PLAN_VERSION_P2P if self.p2p != DEFAULT_P2P else
                        PLAN_VERSION_CHUNKS if any(p.virtual_stages > 1 for p in self.pipelines) else PLAN_VERSION),
            "strategy": self.strategy,
            "training": {"global_batch": self.global_batch, "seq_len": self.seq_len,
                         "schedule": self.schedule, "precision": self.precision,
                         "optimizer_sharding": self.optimizer_sharding, "optimizer_shares": self.optimizer_shares,
                         **({"optimizer_shard_weights": weights.to_dict()} if weights else {}),
                         **({"runtime": self.runtime} if self.runtime != DEFAULT_RUNTIME else {}),
                         **({"p2p": self.p2p} if self.p2p != runtime_profile(self.runtime).p2p else {}),
                         **({"kinds": {k: dict(v) for k, v in self.kind_settings.items()}}
                            if self.kind_settings else {})},
            "world_size": self.world_size,
            "pipelines": [
                {
                    "micro_batch_size": p.micro_batch_size,
                    "num_micro_batches": p.num_micro_batches,
                    **({"virtual_stages": p.virtual_stages} if p.virtual_stages > 1 else {}),
                    "stages": [
                        {"kind": s.kind, "tp": s.tp, **({"cp": s.cp} if s.cp > 1 else {}),
                         **({"sequence_parallel": True} if s.sequence_parallel else {}),
                         "devices": list(s.devices), "ranks": [rank[d] for d in s.devices],
                         **({"chunks": [list(r) for r in s.chunks]} if s.chunks else {"layers": list(s.layers)}),
                         "embedding": s.embedding, "head": s.head, "recompute": s.recompute.value}
                        for s in p.stages
                    ],
                }
                for p in self.pipelines
            ],
            "meta": self.meta,
            "model": self.model.to_dict(),
            "cluster": self.cluster.to_dict(),
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2) + "\n"

    def save(self, path: str | Path) -> None:
        from hethub.outfiles import write_text_atomic

        write_text_atomic(path, self.to_json())

    @staticmethod
    def from_dict(data: dict[str, Any]) -> Plan:
        if not isinstance(data, dict) or data.get("format") != PLAN_FORMAT:
            raise PlanError(f"not a hethub plan: field 'format' must be {PLAN_FORMAT!r}. "
                            "Fix: pass a file written by 'hethub plan' (or 'hethub import-plan').")
        if data.get("version") not in READABLE_VERSIONS:
            raise PlanError(f"plan field 'version' is {data.get('version')!r}; this hethub reads versions "
                            f"{', '.join(map(str, READABLE_VERSIONS))}. Fix: re-create the plan with this version of "
                            "'hethub plan'.")
        try:
            model = ModelSpec.from_dict(_get(data, "model", "", dict), where="plan field 'model'")
            cluster = Cluster.from_dict(_get(data, "cluster", "", dict), where="plan field 'cluster'")
        except SpecError as err:
            raise PlanError(str(err)) from None
        t = _get(data, "training", "", dict)
        runtime = _get(t, "runtime", "training", str, default=DEFAULT_RUNTIME)
        if runtime not in RUNTIMES:
            _fail("training.runtime", f"is {runtime!r}", f"use one of {', '.join(RUNTIMES)}")
        pipelines = tuple(_pipeline_from_dict(p, f"pipelines[{i}]")
                          for i, p in enumerate(_get(data, "pipelines", "", list)))
        meta = data.get("meta") or {}
        if not isinstance(meta, dict):
            _fail("meta", "must be an object", "write {} or delete it")
        plan = Plan(model=model, cluster=cluster, global_batch=_get(t, "global_batch", "training", int),
                    seq_len=_get(t, "seq_len", "training", int), pipelines=pipelines,
                    schedule=_get(t, "schedule", "training", str, default=DEFAULT_SCHEDULE),
                    precision=_get(t, "precision", "training", str, default="bf16-mixed"),
                    strategy=str(data.get("strategy", "manual")), meta=dict(meta),
                    kind_settings=_kind_settings(t),
                    optimizer_sharding=_get(t, "optimizer_sharding", "training", str, default="none"),
                    optimizer_shares=_get(t, "optimizer_shares", "training", str, default="proportional"),
                    runtime=runtime,
                    p2p=_get(t, "p2p", "training", str, default=RUNTIMES[runtime].p2p),
                    shard_weights=_shard_weights(t))
        plan.validate()
        _check_ranks(data, plan)
        return plan

    @staticmethod
    def load(path: str | Path) -> Plan:
        p = Path(path)
        data = load_json(p, missing=f"plan file '{p}' does not exist. Fix: create one with 'hethub plan --out {p}'.",
                         invalid_fix="re-create it with 'hethub plan'", cls=PlanError)
        try:
            return Plan.from_dict(data)
        except PlanError as err:
            raise PlanError(f"{p}: {err}") from None


def _fail(fieldname: str, problem: str, fix: str) -> None:
    raise PlanError(f"plan field '{fieldname}' {problem}. Fix: {fix}.")


def _check_layer_ranges(p: Pipeline, where: str, *, model: ModelSpec, schedule: str) -> None:
    """Every stage holds v chunks, and the chunks in virtual-stage order (chunk 0 of every stage,
    then chunk 1, ...; without chunks: the stages in order) cover the layers contiguously, once."""
    v, n = p.virtual_stages, len(p.stages)
    for si, s in enumerate(p.stages):
        if s.num_chunks != v:
            _fail(f"{where}.stages[{si}].chunks", f"holds {s.num_chunks} chunk(s) but stage 0 holds {v}",
                  "give every stage of a pipeline the same number of layer chunks")
        if s.chunks and s.layers != s.chunks[0]:
            _fail(f"{where}.stages[{si}].layers", f"is {list(s.layers)}, not the first chunk {list(s.chunks[0])}",
                  "leave 'layers' out of a stage that lists 'chunks'")
    if v > 1:
        try:
            get_schedule(schedule, chunks=v)
        except ValueError:
            _fail(f"{where}.virtual_stages", f"is {v} but the plan's schedule is {schedule!r}, which runs one "
                  "chunk per stage", "set training.schedule to \"interleaved\", or give each stage one layer range")
        if n < 2:
            _fail(f"{where}.virtual_stages", f"is {v} on a pipeline of one stage (nothing to interleave)",
                  "give the stage one layer range, or use two or more stages")
    expect = 0
    for k in range(v * n):
        c, si = divmod(k, n)
        start, end = p.stages[si].layer_ranges[c]
        fieldname = f"{where}.stages[{si}]." + (f"chunks[{c}]" if v > 1 else "layers")
        if start != expect or end < start or end > model.num_layers:
            order = " (virtual stage order: chunk 0 of every stage, then chunk 1, ...)" if v > 1 else ""
            _fail(fieldname, f"is [{start}, {end}), expected to start at {expect} and end by {model.num_layers}",
                  f"give contiguous layer ranges covering every layer once{order}")
        expect = end
    for si, s in enumerate(p.stages):
        # An empty chunk of a stage with other layers passes its input on (one more hop, no work).
        if s.num_layers == 0 and not (s.embedding or s.head):
            _fail(f"{where}.stages[{si}].{'chunks' if v > 1 else 'layers'}", "is empty and the stage holds no "
                  "embedding or head", "remove the stage or give it layers")
    if expect != model.num_layers:
        _fail(f"{where}.stages", f"cover layers 0..{expect}, but the model has {model.num_layers}",
              f"make the last {'chunk' if v > 1 else 'stage'}'s layers end at {model.num_layers}")


def _check_seq_split(s: Stage, sw: str, *, seq_len: int, cp0: int) -> None:
    """Context and sequence parallelism: a CP degree that divides the devices and the sequence into
    2cp load-balanced chunks, equal on every stage of the pipeline (CP rank c of each stage holds the
    same positions, so stage messages go CP rank to CP rank); SP only with TP > 1 and a CP-local
    sequence the TP degree divides."""
    if isinstance(s.cp, bool) or not isinstance(s.cp, int) or s.cp < 1:
        _fail(f"{sw}.cp", f"is {s.cp!r}", "give the context-parallel degree, an integer >= 1")
    if len(s.devices) % s.cp:
        _fail(f"{sw}.cp", f"is {s.cp}, which does not divide the stage's {len(s.devices)} devices",
              "list tp x cp devices (CP-major: CP rank c's TP group first, then the next)")
    if s.cp != cp0:
        _fail(f"{sw}.cp", f"is {s.cp} but the pipeline's first stage has cp {cp0}",
              "give every stage of a pipeline the same CP degree (replicas may differ)")
    if s.cp > 1 and seq_len % (2 * s.cp):
        _fail(f"{sw}.cp", f"is {s.cp}, but seq_len {seq_len} does not split into 2 x cp = {2 * s.cp} equal chunks "
              "(causal load balancing: CP rank c holds chunks c and 2cp-1-c)",
              f"use a CP degree with seq_len divisible by 2 x cp, or a sequence length divisible by {2 * s.cp}")
    if not isinstance(s.sequence_parallel, bool):
        _fail(f"{sw}.sequence_parallel", f"is {s.sequence_parallel!r}", "write true or false")
    if s.sequence_parallel and s.tp < 2:
        _fail(f"{sw}.sequence_parallel", "is true on a stage with TP 1 (sequence parallelism splits what TP "
              "replicates)", "give the stage TP > 1 or set it false")
    local = seq_len // s.cp
    if s.sequence_parallel and local % s.tp:
        _fail(f"{sw}.sequence_parallel", f"is true, but the {local} tokens each CP rank holds do not split "
              f"evenly over TP {s.tp}",
              "use a sequence length (per CP rank) divisible by the TP degree, or set it false")


def _check_stage(s: Stage, sw: str, *, model: ModelSpec, cluster: Cluster, first: bool, last: bool) -> None:
    if s.kind not in cluster.kinds:
        _fail(f"{sw}.kind", f"is {s.kind!r}, not a kind of cluster {cluster.name!r}",
              f"use one of {', '.join(cluster.kind_names)}")
    if not s.devices:
        _fail(f"{sw}.devices", "is empty", "give the stage at least one device")
    for d in s.devices:
        if not 0 <= d < cluster.num_devices:
            _fail(f"{sw}.devices", f"names device {d}, but the cluster has devices 0..{cluster.num_devices - 1}",
                  "use device ids of this cluster")
        if cluster.devices[d].kind != s.kind:
            _fail(f"{sw}.devices", f"includes device {d} of kind {cluster.devices[d].kind!r}, not {s.kind!r}",
                  "use only devices of the stage's kind")
    for c in range(s.cp):
        if len({cluster.devices[d].node for d in s.tp_group(c)}) > 1:
            where = f" (CP rank {c}'s TP group {list(s.tp_group(c))})" if s.cp > 1 else ""
            _fail(f"{sw}.devices", f"span several nodes{where}", "keep a tensor-parallel group inside one node"
                  + (" (devices are CP-major: CP rank c's TP group is devices[c*tp:(c+1)*tp])" if s.cp > 1 else ""))
    tp = s.tp
    if model.num_heads % tp or model.num_kv_heads % tp or model.ffn_hidden_size % tp:
        _fail(f"{sw}.tp", f"is {tp}, which does not divide the model's heads ({model.num_heads}), KV heads "
              f"({model.num_kv_heads}) and FFN size ({model.ffn_hidden_size})", "use a TP degree that divides them")
    if s.embedding != first:
        _fail(f"{sw}.embedding", f"is {s.embedding}", "put the embedding on the first stage of each pipeline only")
    if s.head != last:
        _fail(f"{sw}.head", f"is {s.head}", "put the head on the last stage of each pipeline only")


_TYPE_WORDS = {int: "an integer", str: "a string", bool: "true or false", list: "a list", dict: "an object"}


def _get(obj: dict[str, Any], key: str, where: str, typ: type, *, default: Any = None) -> Any:
    """obj[key] checked against `typ`, with the field's full path in the error."""
    path = f"{where}.{key}" if where else key
    if not isinstance(obj, dict):
        _fail(where or "(top level)", "must be an object", "see docs/plan-format.md")
    if key not in obj:
        if default is not None:
            return default
        _fail(path, "is missing", "add it (see docs/plan-format.md)")
    value = obj[key]
    if not isinstance(value, typ) or (typ is int and isinstance(value, bool)):
        _fail(path, f"must be {_TYPE_WORDS[typ]}, got {value!r}", f"write {_TYPE_WORDS[typ]}")
    return value


def _kind_settings(training: dict[str, Any]) -> dict[str, dict[str, str]]:
    kinds = training.get("kinds", {})
    if not isinstance(kinds, dict) or not all(isinstance(v, dict) for v in kinds.values()):
        _fail("training.kinds", f"must map kind names to objects, got {kinds!r}",
              'write e.g. {"v100-16gb": {"precision": "fp32", "attention": "math"}}')
    for k, v in kinds.items():
        for key, val in v.items():
            if not isinstance(val, str):
                _fail(f"training.kinds.{k}.{key}", f"must be a string, got {val!r}", "write a string")
    return {k: dict(v) for k, v in kinds.items()}


def _shard_weights(training: dict[str, Any]) -> ShardWeights | None:
    where = "training.optimizer_shard_weights"
    if "optimizer_shard_weights" not in training:
        return None
    got = _get(training, "optimizer_shard_weights", "training", dict)
    headroom, by_rank = got.get("mem_headroom"), _get(got, "by_rank", where, list)
    if isinstance(headroom, bool) or not isinstance(headroom, int | float):
        _fail(f"{where}.mem_headroom", f"must be a number, got {headroom!r}", "write the fraction, e.g. 0.1")
    if not all(isinstance(w, int | float) and not isinstance(w, bool) for w in by_rank):
        _fail(f"{where}.by_rank", "must be a list of numbers, one per rank", "re-create the plan with 'hethub plan'")
    return ShardWeights(mem_headroom=float(headroom), by_rank=tuple(float(w) for w in by_rank))


def zero_stage_of(sharding: str) -> int:
    """The ZeRO stage of an optimizer sharding (OPTIMIZER_SHARDINGS): 0 for none."""
    return 0 if sharding == "none" else int(sharding[-1])


def _check_zero23(plan: Plan) -> None:
    refusal = zero23_refusal(plan)
    if refusal is not None:
        _fail("training.optimizer_sharding", *refusal)


def zero23_refusal(plan: Plan) -> tuple[str, str] | None:
    """Why ``plan`` cannot run its ZeRO-2/3 sharding, as (problem, fix), or None where it can. ZeRO-2
    and ZeRO-3 run one collective per micro-batch (and per layer use) over each group of holders,
    matched in order among them (runtime/zero.py): every holder must run as many. Every pipeline
    holds every layer, so that is every pipeline."""
    counts = sorted({p.num_micro_batches for p in plan.pipelines})
    if len(counts) > 1:
        return (f"is {plan.optimizer_sharding!r}, but the pipelines run {', '.join(map(str, counts))} micro-batches "
                "per step (each micro-batch's gradients are reduced onto their owners, and under zero3 each layer "
                "gathered, as collectives all holders join)",
                "give every pipeline the same num_micro_batches (their micro_batch_size may differ), or use zero1")
    if plan.zero_stage == 3 and any(p.virtual_stages > 1 for p in plan.pipelines):
        return ("is 'zero3' on a pipeline with virtual stages (its gathers follow each holder's forward order, which "
                "chunks interleave differently per holder)", "give each stage one layer range, or use zero2")
    return None


def _check_shard_weights(w: ShardWeights, *, world_size: int) -> None:
    where = "training.optimizer_shard_weights"
    if not 0 <= w.mem_headroom < 1:
        _fail(f"{where}.mem_headroom", f"is {w.mem_headroom!r}", "give a fraction in [0, 1)")
    if len(w.by_rank) != world_size:
        _fail(f"{where}.by_rank", f"lists {len(w.by_rank)} weights for {world_size} ranks",
              "re-create the plan with 'hethub plan' (or delete the field: 'hethub train' then recomputes it)")
    if not all(math.isfinite(x) and x >= 0 for x in w.by_rank):
        _fail(f"{where}.by_rank", "holds a negative or non-finite weight", "give weights >= 0 (free bytes, or 1 each)")


def _pipeline_from_dict(p: Any, where: str) -> Pipeline:
    stages = []
    for si, s in enumerate(_get(p, "stages", where, list)):
        sw = f"{where}.stages[{si}]"
        devices = _get(s, "devices", sw, list)
        if not all(isinstance(d, int) and not isinstance(d, bool) for d in devices):
            _fail(f"{sw}.devices", f"must be a list of device ids, got {devices!r}", "write e.g. [0, 1]")
        chunks: tuple[tuple[int, int], ...] = ()
        if "chunks" in s:
            if "layers" in s:
                _fail(f"{sw}.layers", "is given beside 'chunks'", "give either 'layers' or 'chunks', not both")
            raw = _get(s, "chunks", sw, list)
            if len(raw) < 2:
                _fail(f"{sw}.chunks", f"lists {len(raw)} range(s)",
                      "give two or more layer ranges, or write 'layers' for one")
            chunks = tuple(_layer_range(r, f"{sw}.chunks[{c}]") for c, r in enumerate(raw))
            layers = chunks[0]
        else:
            layers = _layer_range(_get(s, "layers", sw, list), f"{sw}.layers")
        cp = _get(s, "cp", sw, int, default=1)
        if cp < 1:
            _fail(f"{sw}.cp", f"is {cp}", "give the context-parallel degree, an integer >= 1")
        if "tp" in s and s["tp"] * cp != len(devices):
            _fail(f"{sw}.tp", f"is {s['tp']!r} but the stage lists {len(devices)} devices for cp {cp}",
                  "a stage's TP degree times its CP degree equals its number of devices")
        stages.append(Stage(kind=_get(s, "kind", sw, str), devices=tuple(devices), layers=layers,
                            embedding=_get(s, "embedding", sw, bool, default=False),
                            head=_get(s, "head", sw, bool, default=False),
                            recompute=_recompute(s, sw), chunks=chunks, cp=cp,
                            sequence_parallel=_get(s, "sequence_parallel", sw, bool, default=False)))
    pipe = Pipeline(micro_batch_size=_get(p, "micro_batch_size", where, int),
                    num_micro_batches=_get(p, "num_micro_batches", where, int), stages=tuple(stages))
    v = _get(p, "virtual_stages", where, int, default=1)
    if stages and v != pipe.virtual_stages:
        _fail(f"{where}.virtual_stages", f"is {v} but stage 0 lists {pipe.virtual_stages} layer chunk(s)",
              "make it the number of ranges in each stage's 'chunks' (1: 'layers' only)")
    return pipe


def _layer_range(r: Any, fieldname: str) -> tuple[int, int]:
    if not (isinstance(r, list) and len(r) == 2 and all(isinstance(x, int) and not isinstance(x, bool) for x in r)):
        _fail(fieldname, f"must be [start, end), got {r!r}", "write e.g. [0, 16]")
    return (r[0], r[1])


def _recompute(stage: dict[str, Any], where: str) -> Recompute:
    """A stage's "recompute": a mode's word, or true/false as plans before version 3 wrote it."""
    value = stage.get("recompute", Recompute.NONE.value)
    return Recompute.of(value, where=f"{where}.recompute")


def _check_ranks(data: dict[str, Any], plan: Plan) -> None:
    """Ranks and world_size are derived; if a person edited them, say they disagree rather than silently
    ignore (a launcher may have been sized by them)."""
    if "world_size" in data and data["world_size"] != plan.world_size:
        _fail("world_size", f"is {data['world_size']!r} but the pipelines use {plan.world_size} devices (one rank "
              "each)", f"write {plan.world_size}, or delete 'world_size' (it is derived)")
    rank = plan.rank_of_device()
    for pi, p in enumerate(data["pipelines"]):
        for si, s in enumerate(p["stages"]):
            if "ranks" in s and s["ranks"] != [rank[d] for d in s["devices"]]:
                _fail(f"pipelines[{pi}].stages[{si}].ranks", f"is {s['ranks']} but devices {s['devices']} "
                      f"get ranks {[rank[d] for d in s['devices']]} (ranks are devices in ascending order)",
                      "edit 'devices' only, or delete 'ranks'")
