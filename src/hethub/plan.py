"""The versioned, human-readable parallel plan: pipelines -> stages -> devices, layers, TP.

A plan is self-contained: it embeds the model and cluster it was made for, so `hethub predict` and
the runtime need nothing else. Pipelines are data-parallel replicas that may differ in everything
(kinds, layer splits, TP degrees, micro-batch counts); the runtime synchronises gradients among
whichever ranks hold each parameter.

Torch ranks are the plan's devices in ascending device-id order, so a plan that leaves devices idle
still launches with a dense ``world_size``.

Its parts are in ``plan_parts``, their checks in ``plan_check`` and the file's field readers in
``plan_fields``; this module assembles, validates, writes and reads the plan.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from hethub.errors import PlanError, SpecError, load_json
from hethub.memo import reference
from hethub.plan_check import (
    check_layer_ranges,
    check_seq_split,
    check_shard_weights,
    check_stage,
    check_stage_devices,
    fail,
    stage_shape,
)
from hethub.plan_fields import kind_settings_of, pipeline_from_dict, shard_weights_of, typed_field
from hethub.plan_parts import RECOMPUTE_MODES, Pipeline, Recompute, ShardWeights, Stage, interleave, split_evenly
from hethub.runtimes import ATTENTION_KINDS, DEFAULT_RUNTIME, RUNTIMES, runtime_profile
from hethub.schedules import DEFAULT_P2P, DEFAULT_SCHEDULE, LOCKSTEP, P2P_MODES, SCHEDULES
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
            fail("training.optimizer_shard_weights", "is missing from a plan with optimizer sharding",
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
            fail("schedule", f"is {self.schedule!r}", f"use one of {', '.join(SCHEDULES)}")
        if self.optimizer_sharding not in OPTIMIZER_SHARDINGS:
            fail("training.optimizer_sharding", f"is {self.optimizer_sharding!r}",
                 f"use one of {', '.join(OPTIMIZER_SHARDINGS)}")
        if self.zero_stage >= 2:
            _check_zero23(self)
        if self.optimizer_shares not in OPTIMIZER_SHARES:
            fail("training.optimizer_shares", f"is {self.optimizer_shares!r}",
                 f"use one of {', '.join(OPTIMIZER_SHARES)}")
        if self.sharded_optimizer and self.shard_weights is not None:
            check_shard_weights(self.shard_weights, world_size=self.world_size)
        if self.runtime not in RUNTIMES:
            fail("training.runtime", f"is {self.runtime!r}", f"use one of {', '.join(RUNTIMES)} (hethub: hethub's "
                 "own runtime, which trains the plan; megatron, deepspeed: predict the plan as those run it)")
        if self.p2p not in P2P_MODES:
            fail("training.p2p", f"is {self.p2p!r}", f"use one of {', '.join(P2P_MODES)} (async: hethub's runtime; "
                 "blocking: a runtime whose sends block, such as Megatron-LM; lockstep: DeepSpeed's pipeline engine)")
        if self.p2p == LOCKSTEP:
            why = lockstep_unsupported(schedule=self.schedule,
                                       chunks=max((p.virtual_stages for p in self.pipelines), default=1))
            if why is not None:
                fail("training.p2p", why, LOCKSTEP_FIX)
        if self.precision not in PRECISIONS:
            fail("precision", f"is {self.precision!r}", f"use one of {', '.join(PRECISIONS)}")
        for kind, settings in self.kind_settings.items():
            kw = f"training.kinds.{kind}"
            if kind not in c.kinds:
                fail(kw, f"names kind {kind!r}, not a kind of cluster {c.name!r}",
                     f"use one of {', '.join(c.kind_names)}")
            if not isinstance(settings, dict) or set(settings) - set(KIND_SETTINGS):
                fail(kw, f"is {settings!r}", f"give an object with only {' and/or '.join(KIND_SETTINGS)}")
            prec, att = settings.get("precision"), settings.get("attention")
            if prec is not None and prec not in c.kinds[kind].precisions:
                fail(f"{kw}.precision", f"is {prec!r}, which hethub's runtime does not run on {kind} "
                     f"(it runs {', '.join(c.kinds[kind].precisions)})", "use one of those or leave it out")
            if att is not None and att not in ATTENTION_KINDS:
                fail(f"{kw}.attention", f"is {att!r}", f"use one of {', '.join(ATTENTION_KINDS)}")
            runs = runtime_profile(self.runtime).attentions
            if att is not None and att not in runs:
                fail(f"{kw}.attention", f"is {att!r}, which the {self.runtime} runtime does not run (it runs "
                     f"{', '.join(runs)})", f"use one of those, or set training.runtime to one that runs {att!r} "
                     f"({', '.join(n for n, r in RUNTIMES.items() if att in r.attentions)}) to predict the plan "
                     "as that runtime runs it")
        if self.seq_len < 1 or self.seq_len > m.max_seq_len:
            fail("seq_len", f"is {self.seq_len}, outside 1..{m.max_seq_len} (the model's max_seq_len)",
                 "use a sequence length the model supports")
        if not self.pipelines:
            fail("pipelines", "is empty", "add at least one pipeline")
        used: dict[int, int] = {}  # each device's pipeline
        # Stage shapes (plan_check.stage_shape) that passed their checks here: replicas repeat a few, so
        # a stage of one is checked only for its device ids; and a pipeline that reuses no device is
        # checked for it at once (shortcuts: memo.py).
        passed: set[tuple] = set()
        fresh = reference()
        for pi, p in enumerate(self.pipelines):
            where = f"pipelines[{pi}]"
            if p.micro_batch_size < 1 or p.num_micro_batches < 1:
                fail(f"{where}.micro_batch_size/num_micro_batches",
                     f"are {p.micro_batch_size}/{p.num_micro_batches}", "both must be >= 1")
            if not p.stages:
                fail(f"{where}.stages", "is empty", "give each pipeline at least one stage")
            # No stage of it reuses a device: the stages' own checks alone can fail, in the same order.
            apart = not fresh and used.keys().isdisjoint(p.devices) and len(set(p.devices)) == len(p.devices)
            n, cp0 = len(p.stages), p.stages[0].cp
            for si, s in enumerate(p.stages):
                shape = None if fresh else stage_shape(s, first=si == 0, last=si == n - 1, cp0=cp0)
                if shape is not None and shape in passed:
                    check_stage_devices(s, cluster=c, where=where, index=si)
                else:
                    sw = f"{where}.stages[{si}]"
                    check_stage(s, sw, model=m, cluster=c, first=si == 0, last=si == n - 1)
                    check_seq_split(s, sw, seq_len=self.seq_len, cp0=cp0)
                    if shape is not None:
                        passed.add(shape)
                if apart:
                    continue
                for d in s.devices:
                    if d in used:  # its first holder: the first stage of that pipeline holding it
                        at = next(i for i, x in enumerate(self.pipelines[used[d]].stages) if d in x.devices)
                        fail(f"{where}.stages[{si}].devices", f"reuses device {d}, already used by "
                             f"pipelines[{used[d]}].stages[{at}]", "give every device to exactly one stage")
                    used[d] = pi
            if apart:
                used.update(dict.fromkeys(p.devices, pi))
            check_layer_ranges(p, where, model=m, schedule=self.schedule)
        total = sum(p.num_samples for p in self.pipelines)
        if total != self.global_batch:
            fail("global_batch", f"is {self.global_batch} but the pipelines take {total} sequences "
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
            model = ModelSpec.from_dict(typed_field(data, "model", "", dict), where="plan field 'model'")
            cluster = Cluster.from_dict(typed_field(data, "cluster", "", dict), where="plan field 'cluster'")
        except SpecError as err:
            raise PlanError(str(err)) from None
        t = typed_field(data, "training", "", dict)
        runtime = typed_field(t, "runtime", "training", str, default=DEFAULT_RUNTIME)
        if runtime not in RUNTIMES:
            fail("training.runtime", f"is {runtime!r}", f"use one of {', '.join(RUNTIMES)}")
        pipelines = tuple(pipeline_from_dict(p, f"pipelines[{i}]")
                          for i, p in enumerate(typed_field(data, "pipelines", "", list)))
        meta = data.get("meta") or {}
        if not isinstance(meta, dict):
            fail("meta", "must be an object", "write {} or delete it")
        plan = Plan(model=model, cluster=cluster, global_batch=typed_field(t, "global_batch", "training", int),
                    seq_len=typed_field(t, "seq_len", "training", int), pipelines=pipelines,
                    schedule=typed_field(t, "schedule", "training", str, default=DEFAULT_SCHEDULE),
                    precision=typed_field(t, "precision", "training", str, default="bf16-mixed"),
                    strategy=str(data.get("strategy", "manual")), meta=dict(meta),
                    kind_settings=kind_settings_of(t),
                    optimizer_sharding=typed_field(t, "optimizer_sharding", "training", str, default="none"),
                    optimizer_shares=typed_field(t, "optimizer_shares", "training", str, default="proportional"),
                    runtime=runtime,
                    p2p=typed_field(t, "p2p", "training", str, default=RUNTIMES[runtime].p2p),
                    shard_weights=shard_weights_of(t))
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


def zero_stage_of(sharding: str) -> int:
    """The ZeRO stage of an optimizer sharding (OPTIMIZER_SHARDINGS): 0 for none."""
    return 0 if sharding == "none" else int(sharding[-1])


def _check_zero23(plan: Plan) -> None:
    refusal = zero23_refusal(plan)
    if refusal is not None:
        fail("training.optimizer_sharding", *refusal)


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


def _check_ranks(data: dict[str, Any], plan: Plan) -> None:
    """Ranks and world_size are derived; if a person edited them, say they disagree rather than silently
    ignore (a launcher may have been sized by them)."""
    if "world_size" in data and data["world_size"] != plan.world_size:
        fail("world_size", f"is {data['world_size']!r} but the pipelines use {plan.world_size} devices (one rank "
             "each)", f"write {plan.world_size}, or delete 'world_size' (it is derived)")
    rank = plan.rank_of_device()
    for pi, p in enumerate(data["pipelines"]):
        for si, s in enumerate(p["stages"]):
            if "ranks" in s and s["ranks"] != [rank[d] for d in s["devices"]]:
                fail(f"pipelines[{pi}].stages[{si}].ranks", f"is {s['ranks']} but devices {s['devices']} "
                     f"get ranks {[rank[d] for d in s['devices']]} (ranks are devices in ascending order)",
                     "edit 'devices' only, or delete 'ranks'")
