"""What of the gradient sync the backward leaves exposed, and the buckets the runtime reduces in.

The runtime reduces gradients in buckets of ~40M elements (``runtime/grad_buffer.py``), each started as
soon as its parameters' gradients are final in the last micro-batch's backward, in reverse layer order,
one after another per rank. Only what is left after the backward counts: a group's buckets become
ready through its holders' last backward (the backward taken as proportional to the parameters it has
passed, units in reverse forward order), run back to back on each holder from then, and the group is
priced by the part of its buckets' time after the backward's end (every holder's end taken as the same
instant, as the loss barrier makes it). Each bucket is its own all-reduce (its latency counts). ZeRO-1
groups are priced whole: their all-gather follows the update; ZeRO-2/3 reduce once per micro-batch
(:func:`_exposed_rounds`). An estimate: a backward is not uniform over its parameters, and the
collective shares the device with it.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import replace

from hethub.layout import DEFAULT_BUCKET_ELEMS, StagePlace, stage_places, stage_units, unit_holders, unit_position
from hethub.memo import Kept, reference
from hethub.plan import Plan
from hethub.predict.sharding import unit_elems
from hethub.predict.sync_records import StageId, SyncGroup
from hethub.predict.sync_rules import group_allreduce_s
from hethub.runtimes import runtime_profile
from hethub.spec.model import ModelSpec


def exposed_sync_groups(plan: Plan, groups: Sequence[SyncGroup], *, backward_s: Mapping[StageId, float],
                        bucket_elems: int = DEFAULT_BUCKET_ELEMS) -> list[SyncGroup]:
    """``groups`` (:func:`sync_groups`, unsharded) with each one's time cut to the part of its bucketed
    reduction left after its holders' last backward (module doc). ``backward_s``: each
    stage's backward of one micro-batch (its last one overlaps the buckets). A runtime that reduces
    after the schedule (hethub.runtimes: dp_overlap False, DeepSpeed's pipeline engine) overlaps
    nothing: ``groups`` as they are."""
    if plan.zero_stage >= 2:
        return _exposed_rounds(plan, groups, backward_s=backward_s)
    if plan.sharded_optimizer or not runtime_profile(plan.runtime).dp_overlap:
        return list(groups)
    key = (id(plan), tuple(map(id, groups)), tuple(backward_s.items()), bucket_elems)
    return list(_EXPOSED.get(key, lambda: tuple(_exposed_buckets(plan, groups, backward_s=backward_s,
                                                                   bucket_elems=bucket_elems)),
                             pin=(plan, *groups)))


# _exposed_buckets by plan and groups (the objects: ids, pinned; plans are frozen, and sync_groups keeps
# a layout's groups), every stage's backward and the bucket size: the scoring's floor
# (predictor.sync_tail_s) and the prediction that follows ask it of the same plan with the same.
_EXPOSED = Kept(64, shortcut=True)


def _exposed_buckets(plan: Plan, groups: Sequence[SyncGroup], *, backward_s: Mapping[StageId, float],
                     bucket_elems: int) -> list[SyncGroup]:
    """``exposed_sync_groups`` of an unsharded plan whose runtime overlaps its reduction. Replicas
    are most of a large plan's holders, so what is equal among holders is found once: a unit's span
    per stage shape (its layers, embedding, head and TP degree), the buckets' ready times per class
    of holders with the same backward and span of the group's units. A group's buckets run one
    after another (their order keys are adjacent), each leaving every holder's cursor at its end,
    so only a group's first bucket reads the holders' cursors one by one."""
    if reference():
        return _plain_exposed_buckets(plan, groups, backward_s=backward_s, bucket_elems=bucket_elems)
    model = plan.model
    places, units_of = _units_by_holders(plan)
    spans: dict[tuple, dict[str, tuple[float, float]]] = {}

    def span(x: StageId) -> tuple[tuple, dict[str, tuple[float, float]]]:
        """Each unit of stage x: its span (`_unit_spans`), with what it depends on: the stage's shape."""
        st = places[x]
        shape = (st.layer_ranges, st.embedding, st.head, st.tp)
        if shape not in spans:
            spans[shape] = _unit_spans(st, model)
        return shape, spans[shape]

    # (order key, group, holders, per class of holders its ready time relative to the backward's end
    # and its holders, duration)
    buckets: list[tuple[tuple, int, tuple[StageId, ...], list[tuple[float, list[StageId]]], float]] = []
    for gi, g, us, n, d, first in _bucketed(plan, groups, units_of=units_of, bucket_elems=bucket_elems):
        ends: dict[tuple, tuple[float, float]] = {}  # by stage shape
        classes: dict[tuple[float, float, float], list[StageId]] = {}
        for x in g.holders:
            shape, sp = span(x)
            if shape not in ends:
                ends[shape] = (min(sp[u][0] for u in us), max(sp[u][1] for u in us))
            a, c = ends[shape]
            classes.setdefault((backward_s[x], a, c), []).append(x)
        for k in range(n):
            ready = [(-b * (1.0 - (a + (c - a) * (k + 1) / n)), xs) for (b, a, c), xs in classes.items()]
            buckets.append(((first, g.name, k), gi, g.holders, ready, d))
    buckets.sort(key=lambda b: b[0])
    cursor: dict[StageId, float] = {}
    exposed = dict.fromkeys({b[1] for b in buckets}, 0.0)
    run, end, held = -1, 0.0, ()  # the group whose bucket ran last, that bucket's end and its holders
    for _, gi, hs, ready, d in buckets:
        if gi == run:  # every holder's cursor is the last bucket's end
            start = max(end, max(r for r, _ in ready))
        else:
            cursor.update(dict.fromkeys(held, end))
            start = max(max(r, cursor.get(x, -math.inf)) for r, xs in ready for x in xs)
        run, end, held = gi, start + d, hs
        exposed[gi] += max(0.0, start + d) - max(0.0, start)
    return [replace(g, time_s=exposed[gi]) if gi in exposed else g for gi, g in enumerate(groups)]


def _plain_exposed_buckets(plan: Plan, groups: Sequence[SyncGroup], *, backward_s: Mapping[StageId, float],
                     bucket_elems: int) -> list[SyncGroup]:
    """The plain rule of ``_exposed_buckets``: every holder's ready time per bucket and every bucket's
    start over its holders' cursors (the reference path's, memo.py)."""
    model = plan.model
    places, units_of = _units_by_holders(plan)
    spans: dict[StageId, dict[str, tuple[float, float]]] = {}

    def span(x: StageId) -> dict[str, tuple[float, float]]:
        """Each unit of stage x: its span (`_unit_spans`)."""
        if x not in spans:
            spans[x] = _unit_spans(places[x], model)
        return spans[x]

    buckets = []  # (order key, group, holders, ready time per holder relative to the backward's end, duration)
    for gi, g, us, n, d, first in _bucketed(plan, groups, units_of=units_of, bucket_elems=bucket_elems):
        ends = {x: (min(sp[u][0] for u in us), max(sp[u][1] for u in us)) for x in g.holders for sp in (span(x),)}
        for k in range(n):
            ready = {x: -backward_s[x] * (1.0 - (a + (c - a) * (k + 1) / n)) for x, (a, c) in ends.items()}
            buckets.append(((first, g.name, k), gi, g.holders, ready, d))
    buckets.sort(key=lambda b: b[0])
    cursor: dict[StageId, float] = {}
    exposed = dict.fromkeys({b[1] for b in buckets}, 0.0)
    for _, gi, hs, ready, d in buckets:
        start = max(max(ready[x], cursor.get(x, -math.inf)) for x in hs)
        for x in hs:
            cursor[x] = start + d
        exposed[gi] += max(0.0, start + d) - max(0.0, start)
    return [replace(g, time_s=exposed[gi]) if gi in exposed else g for gi, g in enumerate(groups)]


def _units_by_holders(plan: Plan) -> tuple[dict[StageId, StagePlace], dict[tuple[StageId, ...], list[str]]]:
    """The plan's stage places by (pipeline, stage), and its sync units by the stages holding them."""
    stages = stage_places(plan)
    places = {(st.pipeline, st.stage): st for st in stages}
    units_of: dict[tuple[StageId, ...], list[str]] = {}
    for u, hs in unit_holders(plan, stages).items():
        units_of.setdefault(tuple((st.pipeline, st.stage) for st in hs), []).append(u)
    return places, units_of


def _bucketed(plan: Plan, groups: Sequence[SyncGroup], *, units_of: Mapping[tuple[StageId, ...], list[str]],
              bucket_elems: int) -> Iterator[tuple[int, SyncGroup, list[str], int, float, int]]:
    """Each group that reduces in buckets (it takes time, has more than one participant and holds
    units): its index, itself, its units, its bucket count and each bucket's time, and its order
    key (the negated position of its last unit: groups reduce in backward order)."""
    grad_bytes = ModelSpec.state_bytes_per_param(plan.precision)["grads"]
    for gi, g in enumerate(groups):
        us = units_of.get(g.holders)
        if g.time_s <= 0 or g.participants <= 1 or not us:
            continue
        n, d = _buckets_of(plan, g, grad_bytes=grad_bytes, bucket_elems=bucket_elems)
        yield gi, g, us, n, d, -max(unit_position(u, num_layers=plan.model.num_layers) for u in us)


def _unit_spans(st: StagePlace, model: ModelSpec) -> dict[str, tuple[float, float]]:
    """Each unit of stage place ``st``: the fractions of its backward done when the unit's gradients
    start and finish (units in backward order, each in proportion to its elements)."""
    us = sorted(stage_units(st, tied=model.tied_embeddings, learned_pos=model.arch == "gpt"),
                key=lambda u: -unit_position(u, num_layers=model.num_layers))
    sizes = [unit_elems(model, u, tp=st.tp) for u in us]
    total, acc, out = float(sum(sizes)) or 1.0, 0.0, {}
    for u, n in zip(us, sizes, strict=True):
        out[u] = (acc / total, (acc + n) / total)
        acc += n
    return out


def _exposed_rounds(plan: Plan, groups: Sequence[SyncGroup], *, backward_s: Mapping[StageId, float],
                    ) -> list[SyncGroup]:
    """ZeRO-2/3 groups (an estimate): each micro-batch's reduction runs beside the next micro-batch's
    work, so the earlier rounds show only where one outlasts a backward of the slowest-to-hide holder
    (the shortest backward); the last round is priced whole, after the backward. ZeRO-3's per-use
    gathers are prefetched one unit ahead: per op the first unit's gather shows, and the rest only
    where the step's gathers outlast the compute they hide behind (a forward taken as half a
    backward)."""
    out = []
    for g in groups:
        if g.participants <= 1 or g.round_s <= 0:
            out.append(g)
            continue
        m = plan.pipelines[g.holders[0][0]].num_micro_batches
        bwd = min(backward_s[x] for x in g.holders)
        extra = (m - 1) * max(0.0, g.round_s - bwd)
        if g.gather_s > 0:
            first = g.gather_s / max(1, g.gather_units)  # one unit's gather per op, 2m ops
            extra += first + max(0.0, g.gather_s - first - m * 1.5 * bwd)
        out.append(replace(g, time_s=g.time_s + extra))
    return out


def bucket_count(nbytes: float, *, elem_bytes: float, bucket_elems: int = DEFAULT_BUCKET_ELEMS) -> int:
    """How many buckets a runtime that overlaps its reduction (runtimes: dp_overlap) reduces ``nbytes``
    of gradients in (runtime/grad_buffer.py), each its own all-reduce."""
    return max(1, math.ceil(nbytes / elem_bytes / bucket_elems))


def _buckets_of(plan: Plan, g: SyncGroup, *, grad_bytes: float, bucket_elems: int) -> tuple[int, float]:
    """How many buckets the runtime reduces group ``g`` in, and each one's all-reduce time (across
    vendor islands the bridge's two-level all-reduce, :func:`group_allreduce_s`)."""
    n = bucket_count(g.nbytes, elem_bytes=grad_bytes, bucket_elems=bucket_elems)
    return n, group_allreduce_s(plan, g.holders, nbytes=g.nbytes / n, link=g.link, participants=g.participants,
                                elem_bytes=grad_bytes)


def unoverlapped_sync_s(plan: Plan, groups: Sequence[SyncGroup], *,
                        bucket_elems: int = DEFAULT_BUCKET_ELEMS) -> dict[StageId, float]:
    """Each holder stage's gradient-sync time as its runtime reduces it, before any overlap: in
    buckets where :func:`exposed_sync_groups` overlaps them (each bucket its own all-reduce, at its own
    size's achievable bandwidth), else the groups as they are."""
    bucketed = not plan.sharded_optimizer and runtime_profile(plan.runtime).dp_overlap
    grad_bytes = ModelSpec.state_bytes_per_param(plan.precision)["grads"]
    out: dict[StageId, float] = {}
    for g in groups:
        if g.participants <= 1 or g.time_s <= 0:
            continue
        n, d = _buckets_of(plan, g, grad_bytes=grad_bytes, bucket_elems=bucket_elems) if bucketed else (1, g.time_s)
        for x in g.holders:
            out[x] = out.get(x, 0.0) + n * d
    return out
