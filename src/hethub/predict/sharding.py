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

from hethub.layout import (
    DEFAULT_BUCKET_ELEMS,
    ZERO_IN_FLIGHT_ROUNDS,
    StagePlace,
    bucket_ranges,
    gathers_params,
    split_elems,
    stage_places,
    unit_holders,
    unit_position,
)
from hethub.memo import Kept
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


# Each plan's buckets with their reduction lines (plan id, pinned; plans are frozen): the predictor
# splits them under several weights per plan (each recomputation mode, ZeRO-2/3's bytes).
_LINES = Kept(64, shortcut=True)


def bucket_lines(plan: Plan) -> tuple[tuple[Bucket, tuple[tuple[int, ...], ...]], ...]:
    """`buckets` of the plan, each with its `Bucket.lines`."""
    return _LINES.get((id(plan),), lambda: tuple((b, tuple(b.lines())) for b in buckets(plan)), pin=(plan,))


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
    for b, lines in bucket_lines(plan):
        n = b.elems(plan.model)
        for line in lines:
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


@dataclass(frozen=True)
class Zero23Bytes:
    """One rank's memory under ZeRO-2/3 beyond ZeRO-1's (``runtime/zero_grads.py``, ``zero_params.py``):
    its persistent fp32 gradient shard, the parameters it keeps whole, the peak of the units it has
    gathered at once (ZeRO-3) and a bound on its in-flight reduction rounds."""

    grad_bytes: int
    whole_weight_bytes: int
    gathered_bytes: int
    round_bytes: int


def zero23_rank_bytes(plan: Plan, weights: Mapping[int, float], *,
                      bucket_elems: int = DEFAULT_BUCKET_ELEMS) -> dict[int, Zero23Bytes]:
    """Every rank's :class:`Zero23Bytes` (a ZeRO-2 plan's ranks gather nothing and keep every parameter)."""
    model, stage3 = plan.model, plan.zero_stage == 3
    shards = rank_shards(plan, weights)
    place_of = {r: st for st in stage_places(plan) for r in st.ranks}
    wbytes = {r: ModelSpec.state_bytes_per_param(plan.precision_of(st.kind))["weights"] for r, st in place_of.items()}
    whole = dict.fromkeys(range(plan.world_size), 0)
    sizes: dict[int, dict[str, tuple[int, int]]] = {r: {} for r in range(plan.world_size)}  # unit -> (bytes, staging)
    largest = dict.fromkeys(range(plan.world_size), (0, 0))  # (layout elems, local elems) of the largest bucket
    for b, lines in bucket_lines(plan):
        precisions = {plan.precision_of(s.kind) for s in b.holders}
        gather_bytes = ModelSpec.state_bytes_per_param(precisions.pop())["weights"] if len(precisions) == 1 else 4
        gathered = stage3 and gathers_params([(s.stage, s.num_stages) for s in b.holders])
        for line in lines:
            for r in line:
                tp = place_of[r].tp
                layout = [unit_elems(model, u, tp=1 if b.mixed else tp) for u in b.units]
                local = [unit_elems(model, u, tp=tp) for u in b.units]
                spans = bucket_ranges(layout, cap_elems=bucket_elems)  # units are not split here: a bound
                big = max(((sum(layout[i:j]), sum(local[i:j])) for i, j in spans), default=(0, 0))
                largest[r] = max(largest[r], big)
                for u, n_layout, n in zip(b.units, layout, local, strict=True):
                    if not gathered:
                        whole[r] += n * wbytes[r]
                        continue
                    direct = not b.mixed and gather_bytes == wbytes[r]
                    sizes[r][u] = (n * wbytes[r], 0 if direct else n_layout * gather_bytes)
    mixed_any = {r for b, lines in bucket_lines(plan) if b.mixed for line in lines for r in line}
    out = {}
    for r in range(plan.world_size):
        layout_elems, local_elems = largest[r]
        rounds = (ZERO_IN_FLIGHT_ROUNDS + 1) * layout_elems * 4 + (local_elems * 4 if r in mixed_any else 0)
        out[r] = Zero23Bytes(grad_bytes=4 * shards.moment_elems[r], whole_weight_bytes=whole[r],
                             gathered_bytes=_gather_peak(place_of[r], sizes[r], tied=model.tied_embeddings,
                                                         num_layers=model.num_layers),
                             round_bytes=rounds)
    return out


def _gather_peak(st: StagePlace, sizes: Mapping[str, tuple[int, int]], *, tied: bool, num_layers: int) -> int:
    """Most bytes of gathered units a rank holds at once: its forward and backward ops replayed as
    ``runtime/zero_params.py`` runs them (groups gathered in data-flow order, the next one prefetched,
    a layer released after its use; a staging tensor lives from a gather's start to its wait)."""
    order = sorted(sizes, key=lambda u: unit_position(u, num_layers=num_layers))
    layers = [u for u in order if u.startswith("layer.")]
    front = [u for u in order if u in ("embed", "pos") and st.embedding]
    tail = [u for u in order if u in ("final_norm", "head") or (u == "embed" and not st.embedding)]
    back = [u for u in order if u in ("final_norm", "head") or (u == "embed" and tied)]
    replay = _Replay(sizes)
    for seq in ([g for g in (front, *([u] for u in layers), tail) if g],
                [g for g in (back, *([u] for u in reversed(layers))) if g]):
        replay.op(seq)
    return replay.peak


class _Replay:
    """The live bytes of one rank's gathers over its ops (``_gather_peak``)."""

    def __init__(self, sizes: Mapping[str, tuple[int, int]]) -> None:
        self.sizes, self.peak = sizes, 0

    def op(self, seq: list[list[str]]) -> None:
        self.live, self.started, self.waited = 0, set(), set()
        for k, g in enumerate(seq):
            layer = g[0].startswith("layer.")
            if k == 0 and layer:
                self._start(g)
            self._run(seq, k)
            if layer:
                self.live -= self.sizes[g[0]][0]  # released after its use

    def _start(self, g: list[str]) -> None:
        for u in g:
            if u not in self.started:
                self.started.add(u)
                self.live += sum(self.sizes[u])
                self.peak = max(self.peak, self.live)

    def _run(self, seq: list[list[str]], k: int) -> None:
        self._start(seq[k])
        for u in seq[k]:
            if u not in self.waited:
                self.waited.add(u)
                self.live -= self.sizes[u][1]
        if k + 1 < len(seq):
            self._start(seq[k + 1])
