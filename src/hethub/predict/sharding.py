"""Optimizer-state sharding (ZeRO-1) across a parameter group's unequal data-parallel holders.

The one home of *who owns which elements*: the runtime (``runtime/zero.py``) and the predictor's
memory and sync models both take shard sizes from here, so the predicted per-rank optimizer state
is the runtime's by construction of the same numbers, and a test checks it against the bytes the
runtime's AdamW actually allocates.

A *bucket* is what the runtime reduces as one flat buffer: the parameters whose units have the same
holder stages (:mod:`hethub.layout`). Its *members* are the ranks of one reduction group, in
ascending rank order: where every holder has the same TP degree, one rank per holder (the ones with
equal TP rank: each TP rank of a stage has its own line of the bucket); where TP degrees differ
(``mixed``), every rank of every holder, over the full-size (unsharded) layout. Member i owns the
i-th of consecutive slices whose sizes :func:`hethub.layout.split_elems` gives from the members' weights: each
member's free device memory (``proportional``: the device's usable memory less the stage's
predicted peak without optimizer state, at least 0) or 1 each (``equal``).

Pure (no torch); the element counts per unit are exact for the runtime's modules
(``unit_elems``: Megatron's TP split, vocabulary split where the TP degree divides the vocabulary).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from hethub.layout import StagePlace, split_elems, stage_places, unit_holders
from hethub.plan import Plan
from hethub.predict.memory.model import layer_elems
from hethub.spec.model import ModelSpec

StageId = tuple[int, int]


def unit_elems(model: ModelSpec, unit: str, *, tp: int) -> int:
    """Elements of ``unit``'s parameters on one rank of a TP-``tp`` stage, as the runtime holds them:
    column-parallel weights and biases (wq, wk, wv, w1, w3) and row-parallel weights (wo, w2) split,
    norms and row-parallel biases replicated; embedding and head split by vocabulary where ``tp``
    divides it (``runtime/tensor_parallel.vocab_parallel``)."""
    h, v = model.hidden_size, model.vocab_size
    vtp = tp if tp > 1 and v % tp == 0 else 1
    if unit == "embed":
        return v * h // vtp
    if unit == "pos":
        return model.max_seq_len * h
    if unit == "head":
        return v * h // vtp
    if unit == "final_norm":
        return model.final_norm_params
    return layer_elems(model, tp=tp)


@dataclass(frozen=True)
class Bucket:
    """One flat reduction buffer: its holder stages, whether their TP degrees differ, its units."""

    holders: tuple[StagePlace, ...]
    units: tuple[str, ...]
    mixed: bool

    def lines(self) -> list[tuple[int, ...]]:
        """The reduction groups (sorted ranks): one per TP rank, or one of every rank when mixed."""
        if self.mixed:
            return [tuple(sorted(r for s in self.holders for r in s.ranks))]
        # Every CP rank of a holder is a member (layout.Topology.sync_group).
        return [tuple(sorted(r for s in self.holders for r in s.cp_group(q))) for q in range(self.holders[0].tp)]

    def elems(self, model: ModelSpec) -> int:
        """Elements each member of a line reduces: the local TP shard's, or the full size when mixed."""
        tp = 1 if self.mixed else self.holders[0].tp
        return sum(unit_elems(model, u, tp=tp) for u in self.units)


def buckets(plan: Plan) -> list[Bucket]:
    """The plan's buckets: units grouped by their holder stages (the runtime's GradSync grouping)."""
    holders = unit_holders(plan, stage_places(plan))
    by_set: dict[frozenset[tuple[int, int]], tuple[tuple[StagePlace, ...], list[str]]] = {}
    for unit, hs in holders.items():
        key = frozenset((s.pipeline, s.stage) for s in hs)
        by_set.setdefault(key, (hs, []))[1].append(unit)
    return [Bucket(holders=hs, units=tuple(us), mixed=len({s.tp for s in hs}) > 1) for hs, us in by_set.values()]


def rank_weights(plan: Plan, *, free_bytes: Mapping[StageId, float] | None) -> dict[int, float]:
    """Each rank's share weight: its stage's free bytes per device (``proportional``), or 1 (``equal``,
    or when no free bytes are given)."""
    out: dict[int, float] = {}
    for st in stage_places(plan):
        w = 1.0
        if plan.optimizer_shares == "proportional" and free_bytes is not None:
            w = max(0.0, float(free_bytes[(st.pipeline, st.stage)]))
        for r in st.ranks:
            out[r] = w
    return out


@dataclass(frozen=True)
class RankShards:
    """Per rank: elements whose AdamW moments it keeps, and of those the ones of mixed buckets, for
    which it also keeps an fp32 master copy (it may not hold those parameters itself)."""

    moment_elems: dict[int, int]
    master_elems: dict[int, int]
    padded_elems: dict[tuple[int, ...], int]  # per line: largest member's slice (the padded collective)


def rank_shards(plan: Plan, weights: Mapping[int, float]) -> RankShards:
    """Every rank's owned elements over all buckets (see the module doc)."""
    moments = dict.fromkeys(range(plan.world_size), 0)
    masters = dict.fromkeys(range(plan.world_size), 0)
    padded: dict[tuple[int, ...], int] = {}
    for b in buckets(plan):
        n = b.elems(plan.model)
        for line in b.lines():
            sizes = split_elems(n, [weights[r] for r in line])
            padded[line] = max(sizes)
            for r, k in zip(line, sizes, strict=True):
                moments[r] += k
                if b.mixed:
                    masters[r] += k
    return RankShards(moment_elems=moments, master_elems=masters, padded_elems=padded)


def stage_shard_elems(plan: Plan, shards: RankShards) -> dict[StageId, tuple[int, int]]:
    """Per stage: the largest (moment, master) elements over its ranks (the memory model's one device)."""
    out: dict[StageId, tuple[int, int]] = {}
    for st in stage_places(plan):
        out[(st.pipeline, st.stage)] = (max(shards.moment_elems[r] for r in st.ranks),
                                        max(shards.master_elems[r] for r in st.ranks))
    return out
