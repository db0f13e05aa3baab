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
What a rank holds beyond this under ZeRO-2/3: :mod:`hethub.predict.zero23_bytes`.
"""

from __future__ import annotations

import bisect
import itertools
import operator
from collections.abc import Mapping
from dataclasses import dataclass

from hethub.layout import (
    StagePlace,
    split_elems,
    stage_places,
    unit_holders,
)
from hethub.memo import Kept, reference
from hethub.plan import Plan
from hethub.predict.memory.model import layer_elems
from hethub.spec.model import ModelSpec

StageId = tuple[int, int]


def unit_elems(model: ModelSpec, unit: str, *, tp: int) -> int:
    """Elements of ``unit``'s parameters on one rank of a TP-``tp`` stage, as the runtime holds them:
    column-parallel weights and biases (wq, wk, wv, w1, w3) and row-parallel weights (wo, w2) split,
    norms and row-parallel biases replicated; embedding and head split by vocabulary where ``tp``
    divides it (``runtime/tensor_parallel.vocab_parallel``)."""
    table, pos = model.embedding_parts
    if unit == "embed":
        return table // model.vocab_tp(tp)
    if unit == "pos":
        return pos
    if unit == "head":
        return model.head_params // model.vocab_tp(tp)
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


def stage_weights(plan: Plan, *, free_bytes: Mapping[StageId, float] | None) -> dict[StageId, float]:
    """Each stage's ranks' share weight: its free bytes per device (``proportional``), or 1 (``equal``,
    or when no free bytes are given)."""
    ids = [(pi, si) for pi, p in enumerate(plan.pipelines) for si in range(len(p.stages))]  # stage_places' order
    if plan.optimizer_shares != "proportional" or free_bytes is None:
        return dict.fromkeys(ids, 1.0)
    return {sid: max(0.0, float(free_bytes[sid])) for sid in ids}


def rank_weights(plan: Plan, by_stage: Mapping[StageId, float]) -> dict[int, float]:
    """Each rank's share weight: its stage's (``stage_weights``)."""
    out: dict[int, float] = {}
    for st in stage_places(plan):
        out.update(dict.fromkeys(st.ranks, by_stage[(st.pipeline, st.stage)]))
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
    moments = [0] * plan.world_size  # by rank
    masters = [0] * plan.world_size
    padded: dict[tuple[int, ...], int] = {}
    for b, lines in bucket_lines(plan):
        n = b.elems(plan.model)
        for line in lines:
            sizes = split_elems(n, [weights[r] for r in line])
            padded[line] = max(sizes)
            for r, k in zip(line, sizes, strict=True):
                moments[r] += k
            if b.mixed:
                for r, k in zip(line, sizes, strict=True):
                    masters[r] += k
    return RankShards(moment_elems=dict(enumerate(moments)), master_elems=dict(enumerate(masters)),
                      padded_elems=padded)


def stage_shard_elems(plan: Plan, shards: RankShards) -> dict[StageId, tuple[int, int]]:
    """Per stage: the largest (moment, master) elements over its ranks (the memory model's one device)."""
    moments, masters = shards.moment_elems.__getitem__, shards.master_elems.__getitem__
    return {(st.pipeline, st.stage): (max(map(moments, st.ranks)), max(map(masters, st.ranks)))
            for st in stage_places(plan)}


def stage_elems_of(plan: Plan, stage_weights: Mapping[StageId, float]) -> dict[StageId, tuple[int, int]]:
    """``stage_shard_elems(plan, rank_shards(plan, weights))`` where every rank has its stage's weight
    (``rank_weights`` of ``stage_weights``), found per stage instead of per rank. A line's members of one stage have one
    weight, so ``split_elems`` gives each the same whole part, and the remainder's extra elements to
    the first ``c`` of them in line (rank) order: a rank's total is its stage's whole parts plus the
    number of lines whose first ``c`` include it. Each line's parts and counts come from its stages'
    weights, their sum taken over the members in line order as ``split_elems`` adds them."""
    places, lines, coords = _stage_lines(plan)
    w = [max(0.0, float(stage_weights[(st.pipeline, st.stage)])) for st in places]
    ones = [1.0] * len(places)
    base_mixed = [0] * len(places)
    plus_mixed: list[list[int]] = [[] for _ in places]
    base_own: list[dict[int, int]] = [{} for _ in places]  # non-mixed lines, by the TP rank they hold
    plus_own: list[dict[int, list[int]]] = [{} for _ in places]
    # A line's split by its size and members (the TP ranks' lines of a bucket mostly repeat them): each
    # holder stage's whole part and extra elements, found once (a shortcut: memo.py).
    split: dict[tuple, tuple[dict[int, int], dict[int, int]]] = {}
    fresh = reference()
    for n, mixed, q, members, holders in lines:
        got = None if fresh else split.get((n, members))
        if got is None:
            got = _line_split(n, members, holders, w=w, ones=ones)
            if not fresh:
                split[(n, members)] = got
        wholes, plus = got
        for i, whole in wholes.items():
            if mixed:
                base_mixed[i] += whole
            else:
                base_own[i][q] = base_own[i].get(q, 0) + whole
        for i, c in plus.items():
            (plus_mixed[i] if mixed else plus_own[i].setdefault(q, [])).append(c)
    out: dict[StageId, tuple[int, int]] = {}
    for i, st in enumerate(places):
        if not plus_own[i]:  # mixed lines only: the stage's first rank has an extra element in each that gives one
            out[(st.pipeline, st.stage)] = (base_mixed[i] + len(plus_mixed[i]) - plus_mixed[i].count(0),) * 2
            continue
        over_mixed = _more_than(plus_mixed[i], len(st.ranks))
        over_own = {q: _more_than(cs, st.cp) for q, cs in plus_own[i].items()}
        moment = master = 0
        for q, j_mixed, j_own in coords[i]:
            mine = base_mixed[i] + over_mixed[j_mixed]
            master = max(master, mine)
            moment = max(moment, mine + base_own[i].get(q, 0) + (over_own[q][j_own] if q in over_own else 0))
        out[(st.pipeline, st.stage)] = (moment, master)
    return out


def _line_split(n: int, members: tuple[int, ...], holders: Mapping[int, list[int]], *, w: list[float],
                ones: list[float]) -> tuple[dict[int, int], dict[int, int]]:
    """``split_elems`` of a line of ``n`` elements among ``members`` (each its stage's index; weights
    ``w``), per holder stage (its members' positions in ``holders``): each member's whole part, and how
    many of the stage's members get one of the remainder's extra elements."""
    total = sum(map(w.__getitem__, members))
    x = w if total > 0 else ones
    total = total if total > 0 else float(len(members))
    wholes, plus, behind, left = {}, {}, {}, n
    for i, positions in holders.items():
        e = n * x[i] / total
        whole = int(e)
        behind.setdefault(-(e - whole), []).append(i)
        left -= whole * len(positions)
        plus[i] = 0
        wholes[i] = whole
    for f in sorted(behind) if left else ():  # largest remainder first, ties to the earlier member
        group = behind[f]
        count = sum(len(holders[i]) for i in group)
        if left >= count:
            for i in group:
                plus[i] = len(holders[i])
            left -= count
        else:
            for i in map(members.__getitem__, sorted(itertools.chain(*(holders[i] for i in group)))[:left]):
                plus[i] += 1
            left = 0
        if not left:
            break
    return wholes, plus


def layout_key(plan: Plan) -> tuple:
    """What a plan's buckets and their members' counts depend on (``buckets``, ``Bucket.elems``): the
    model (its id; pin it), each stage's layer ranges, embedding, head, TP and CP degrees, in pipeline
    and stage order; not its kinds, devices, ranks, micro-batches, recomputation or SP."""
    return (id(plan.model), tuple(tuple((s.layer_ranges, s.embedding, s.head, len(s.devices), s.cp) for s in p.stages)
                                  for p in plan.pipelines))


@dataclass(frozen=True)
class BucketSums:
    """A layout's buckets as ``stage_elems_bounds`` reads them. Per bucket: the elements each line
    splits, whether its holders mix TP degrees, and each holder stage (its index in ``stage_places``
    order) and the members each puts in one line (its CP degree, or all its ranks when mixed), and
    those members' count. Per stage: how many buckets, and how many mixed ones, it holds."""

    elems: tuple[int, ...]
    mixed: tuple[bool, ...]
    stages: tuple[tuple[int, ...], ...]
    counts: tuple[tuple[int, ...], ...]
    members: tuple[int, ...]
    held: tuple[int, ...]
    held_mixed: tuple[int, ...]


# BucketSums by layout_key: a layout recurs across the planner's candidates, their SP and recomputation
# modes and their ZeRO stages, each a new plan.
_SUMS = Kept(256, shortcut=True)
_SUMS_OF = Kept(64, shortcut=True)  # by plan (id, pinned; plans are frozen): one plan is asked once per mode


def bucket_sums(plan: Plan) -> BucketSums:
    """The plan's :class:`BucketSums` (kept by plan and by ``layout_key``)."""
    return _SUMS_OF.get((id(plan),), lambda: _SUMS.get(layout_key(plan), lambda: _bucket_sums(plan),
                                                         pin=(plan.model,)), pin=(plan,))


def _bucket_sums(plan: Plan) -> BucketSums:
    """``buckets(plan)``'s sums found per run of layers between stage boundaries instead of per unit:
    the layers of one run have the same holders (each pipeline's stage holding the run's first layer),
    so one bucket; runs and units (``layout.stage_units``: the embedding with the positions of a
    learned-position model, or with the tied head's copy; the final norm and the head) of the same
    holder set merge, as ``buckets`` groups units by theirs."""
    model, tied = plan.model, plan.model.tied_embeddings
    stages = [s for p in plan.pipelines for s in p.stages]  # stage_places' order
    first = list(itertools.accumulate((len(p.stages) for p in plan.pipelines), initial=0))
    units: dict[tuple[int, ...], dict[str, int]] = {}

    def add(holders: tuple[int, ...], unit: str, count: int) -> None:
        if holders:
            counts = units.setdefault(holders, {})
            counts[unit] = counts.get(unit, 0) + count

    held = [sorted((a, b, first[pi] + si) for si, s in enumerate(p.stages) for a, b in s.layer_ranges if b > a)
            for pi, p in enumerate(plan.pipelines)]
    starts = [[a for a, _, _ in h] for h in held]
    bounds = sorted({0, model.num_layers, *(x for s in stages for r in s.layer_ranges for x in r)})
    for a, b in itertools.pairwise(bounds):
        if b > a:
            holders = []
            for h, st in zip(held, starts, strict=True):
                k = bisect.bisect_right(st, a) - 1
                if k >= 0 and h[k][1] > a:
                    holders.append(h[k][2])
            add(tuple(holders), "layer", b - a)
    emb = tuple(i for i, s in enumerate(stages) if s.embedding)
    heads = tuple(i for i, s in enumerate(stages) if s.head)
    add(tuple(sorted(emb + (tuple(i for i in heads if not stages[i].embedding) if tied else ()))), "embed", 1)
    if model.arch == "gpt":
        add(emb, "pos", 1)
    add(heads, "final_norm", 1)
    if not tied:
        add(heads, "head", 1)
    elems, mixed, counts = [], [], []
    for holders, us in units.items():
        tps = {stages[i].tp for i in holders}
        mixed.append(len(tps) > 1)
        tp = 1 if mixed[-1] else tps.pop()
        elems.append(sum(k * unit_elems(model, "layer.0" if u == "layer" else u, tp=tp) for u, k in us.items()))
        counts.append(tuple(len(stages[i].devices) if mixed[-1] else stages[i].cp for i in holders))
    held_all, held_mixed = [0] * len(stages), [0] * len(stages)
    for holders, m in zip(units, mixed, strict=True):
        for i in holders:
            held_all[i] += 1
            held_mixed[i] += m
    return BucketSums(elems=tuple(elems), mixed=tuple(mixed), stages=tuple(units), counts=tuple(counts),
                      members=tuple(map(sum, counts)), held=tuple(held_all), held_mixed=tuple(held_mixed))


def stage_elems_bounds(plan: Plan, stage_weights: list[float]) -> tuple[list[int], list[int], list[int], list[int]]:
    """Per stage (``stage_places`` order, ``stage_weights`` likewise): a low and a high bound of each part
    of ``stage_elems_of``, (moments low, moments high, masters low, masters high), found per bucket
    instead of per rank. Every member of a line gets ``int(e)`` or ``int(e) + 1`` of its ``n`` elements,
    e = n x weight / (the line's weights' sum); here e is found per holder stage in another order of
    operations, which moves it by far less than one element (a relative 1e-12 of n), so the exact slice
    lies in [int(e) - 1, int(e) + 2] of this e. A rank is a member of one line per bucket its stage
    holds, and its master elements are its mixed buckets' (the module doc)."""
    sums = bucket_sums(plan)
    w = [max(0.0, float(x)) for x in stage_weights]
    whole, whole_mixed = [0] * len(w), [0] * len(w)
    at = w.__getitem__
    for n, mixed, stages, counts, members in zip(sums.elems, sums.mixed, sums.stages, sums.counts, sums.members,
                                                 strict=True):
        ws = list(map(at, stages))
        total = sum(map(operator.mul, ws, counts))
        if total > 0:
            scale = n / total
            parts = [int(x * scale) for x in ws]
        else:  # no member has weight: equal shares
            parts = [int(n / members)] * len(stages)
        for i, k in zip(stages, parts, strict=True):
            whole[i] += k
        if mixed:
            for i, k in zip(stages, parts, strict=True):
                whole_mixed[i] += k
    return ([max(0, x - k) for x, k in zip(whole, sums.held, strict=True)],
            [x + 2 * k for x, k in zip(whole, sums.held, strict=True)],
            [max(0, x - k) for x, k in zip(whole_mixed, sums.held_mixed, strict=True)],
            [x + 2 * k for x, k in zip(whole_mixed, sums.held_mixed, strict=True)])


def _more_than(counts: list[int], size: int) -> list[int]:
    """For each j < size: how many of ``counts`` exceed j."""
    if not counts:
        return [0] * size
    hist = [0] * (size + 1)
    for c in counts:
        hist[c] += 1
    out, acc = [0] * size, 0
    for j in range(size - 1, -1, -1):
        acc += hist[j + 1]
        out[j] = acc
    return out


# _stage_lines by layout: which stages' members sit where in each line depends on neither the weights nor
# a stage's recomputation, SP or micro-batches, so the planner's variants of one layout share it. The key:
# the model (id, pinned), the pipelines' lengths and each stage's layer ranges, embedding, head, devices
# and CP degree (its units, TP degree and ranks).
_STAGE_LINES = Kept(64, shortcut=True)


_Lines = tuple[tuple[StagePlace, ...], tuple[tuple, ...], dict[int, tuple[tuple[int, int, int], ...]]]


def _stage_lines(plan: Plan) -> _Lines:
    """The plan's stage places; each bucket line as (elements, mixed, the TP rank it holds (0 if mixed),
    each member's stage index, each holder stage's index -> its members' positions in the line); and
    per stage in a non-mixed line each rank's (TP rank, index among the stage's sorted ranks, index
    among its CP group's sorted ranks)."""
    def make() -> _Lines:
        places = stage_places(plan)
        stage_of = {r: i for i, st in enumerate(places) for r in st.ranks}
        lines = []
        for b, members_of in bucket_lines(plan):
            n = b.elems(plan.model)
            for q, line in enumerate(members_of):
                members = tuple(map(stage_of.__getitem__, line))
                holders: dict[int, list[int]] = {}
                for pos, i in enumerate(members):
                    holders.setdefault(i, []).append(pos)
                lines.append((n, b.mixed, 0 if b.mixed else q, members, holders))
        coords: dict[int, tuple[tuple[int, int, int], ...]] = {}
        for i in {i for _, mixed, _, _, holders in lines if not mixed for i in holders}:  # non-mixed lines' stages
            st = places[i]
            tp, ranks = st.tp, st.ranks
            mixed_at = {r: j for j, r in enumerate(sorted(ranks))}
            own_at = {r: j for q in range(tp) for j, r in enumerate(sorted(st.cp_group(q)))}  # in its CP group
            coords[i] = tuple((k % tp, mixed_at[r], own_at[r]) for k, r in enumerate(ranks))
        return places, tuple(lines), coords
    key = (id(plan.model), tuple(len(p.stages) for p in plan.pipelines),
           tuple((s.layer_ranges, s.embedding, s.head, s.devices, s.cp) for p in plan.pipelines for s in p.stages))
    return _STAGE_LINES.get(key, make, pin=(plan.model,))
