"""Identical mixed-kind pipelines over a pool of devices: a branch-and-bound over their shapes.

A mixed candidate is a set of two or more kinds, a TP degree per kind, a replica count c, a stage
count n_k per kind (each kind one contiguous segment) and an order of the segments; the pool must
hold it (c n_k tp_k <= pool_k; devices may stay idle) and a pipeline has at most L + 2 stages. That
space is large (hundreds of thousands of shapes on a 512-device pool), so it is searched best-first
over *boxes*: per (kinds, TP degrees), ranges of c and of each n_k. A box's floor (`_box_level`) is
below the step of every candidate in it; the lowest box is split along its widest range until it is
one shape, whose orders then get the per-member floors of `bounds.pipe_floor` (with memory) and are
split and priced only while those could still enter the finalists. Nothing is pruned without a
proven floor, so this finds every mixed candidate of the reference search (search/reference.py)
whose closed form could be a finalist.
"""

from __future__ import annotations

import heapq
import itertools
import math
from typing import Protocol

from hethub.search.bounds import PipeFloor, pipe_floor
from hethub.search.combine import (
    Estimate,
    Group,
    bisect_time,
    finished_mb,
    lines_level_beside,
    water_level,
    water_level_with,
)
from hethub.search.families import Family, families
from hethub.search.mixed_sync import SyncFloors
from hethub.search.split import Slot
from hethub.search.templates import Searcher


class Sink(Protocol):
    def may_enter(self, step_lower_bound: float) -> bool: ...

    def add(self, est: Estimate | None) -> None: ...


def _box_core(s: Searcher, fam: Family, box: tuple, *, refine: bool) -> tuple | None:
    """What `_box_level` builds its floor on: each kind's most stages, the fewest devices of a
    pipeline, the in-flight counts and the bottleneck floor (None: the box holds no candidate)."""
    clo, _, lo, hi = box
    n_layers = s.model.num_layers
    top = [min(h, n // clo) for h, n in zip(hi, fam.slots, strict=True)]
    if any(a > b for a, b in zip(lo, top, strict=True)) or sum(lo) > n_layers + 2:
        return None
    devices = sum(t * n for t, n in zip(fam.tps, lo, strict=True))
    flights = fam.flights(sum(lo), devices)
    bottleneck = fam.bottleneck(top, n_layers, flights if refine else flights[:1])
    return None if bottleneck is None else (top, devices, flights, bottleneck)


def _box_level(s: Searcher, ctx: SyncFloors, fam: Family, box: tuple, mbs: int, *,
               refine: bool = True, core: tuple | None = None) -> float | None:
    """A floor under the step of every candidate in the box (None: the box holds none).

    Each kind has at most H_k = min(hi_k, slots_k // c_lo) stages (Family.bottleneck gives the
    bottleneck floor). One micro-batch's work is at least that and at least L min w + min e + min h,
    plus the recomputation memory forces; hops at least the box's fewest stages' within-kind hops plus
    (kinds - 1) of the cheapest cross-kind hop. T(m) >= the schedule's fill floor + 2 hops + (m - 1) B,
    with c_hi such pipelines, then the embedding sync. ``refine=False``: every stage at the fewest
    in-flight micro-batches (a looser floor in O(kinds) for the whole-layer bound, not O(stages)).
    ``core``: the box's `_box_core`, where already made.
    """
    if core is None:
        core = _box_core(s, fam, box, refine=refine)
        if core is None:
            return None
    clo, chi, lo, _ = box
    top, devices, flights, bottleneck = core
    n_layers = s.model.num_layers
    cap_plain = fam.caps(flights[0])[1]
    forced = n_layers - sum(t * c for t, c in zip(top, cap_plain, strict=True))
    work = max(bottleneck, fam.work_min + (forced * fam.extra if forced > 0 else 0.0))
    hops = sum((n - 1) * h for n, h in zip(lo, fam.hop, strict=True)) + (len(lo) - 1) * fam.cross
    fill = fam.sched.fill_work_floor_s(work_s=work, bottleneck_s=bottleneck)
    floor = PipeFloor(base_s=fill + 2 * hops - bottleneck, per_mb_s=bottleneck)
    total = s.total_mb(mbs)
    level = water_level_with(ctx.lines, total, base_s=floor.base_s, per_mb_s=floor.per_mb_s, count=chi)
    # c pipelines of n_k stages each run at most c sum_k n_k / w_k / L micro-batches per second, and
    # c n_k <= slots_k: a box's pipelines together cannot beat its devices' rate, however many there are.
    rate = sum(min(n, chi * t) / w for n, t, w in zip(fam.slots, top, fam.w, strict=True)) / n_layers
    if bottleneck > 0 and rate * bottleneck < chi:
        level = max(level, _capped_level(ctx.pure, floor, chi, rate, total))
    segs = tuple(zip(fam.subset, fam.tps, top, strict=True))
    return level + max(ctx.sync_floor(fam.pairs, clo, devices), ctx.tail_floor(segs, clo, devices))


def _rate_level(ctx: SyncFloors, fam: Family, total: int) -> float:
    """A floor under the makespan of every candidate in the family's `boxes` beside ctx's pure
    groups, whatever its replica and stage counts. A mixed pipeline j finishes its m-th micro-batch
    no earlier than F + (m - 1) B_j (its fill floor and bottleneck, as in `_box_level`), and its fill
    is at least F0, the schedule's fill floor for one micro-batch's least work through all layers
    with the bottleneck left out (the floor only grows with it). A stage of kind k takes w_k or more
    per layer, so B_j >= L / sum over j's stages of 1 / w_k, and over the family's stages (fam.slots
    of each kind) sum_j 1 / B_j <= R = sum_k slots_k / w_k / L. So by time T >= F0 the c <= c_max
    pipelines finish at most c_max + R (T - F0) micro-batches, none before F0, and the candidates'
    makespan T has finished_mb(pure, T) plus that >= total. After the makespan, `_box_level`'s sync
    floors, which only grow with the replicas, the devices and fewer stages, at the boxes' fewest
    replicas and devices and most stages per kind."""
    return _stream_level(ctx, fam, total, fam.rate_terms[4])


def _stream_level(ctx: SyncFloors, fam: Family, total: int, rate: float) -> float:
    """`_rate_level` with the family's pipelines together finishing at most `rate` micro-batches per
    second after their first (R there, a tighter rate in `_boxes_level`)."""
    key = (id(fam), total, rate)
    hit = ctx.rate_levels.get(key)
    if hit is None:
        c_min, c_max, devices, top, _ = fam.rate_terms
        f0 = fam.sched.fill_work_floor_s(work_s=fam.work_min, bottleneck_s=0.0)
        # by T the stream of the family's pipelines finishes c_max at F0 and one more every 1 / R after
        hit = lines_level_beside(ctx.lines, total, start_s=f0, per_s=1 / rate, at_start=c_max) * (1 - 1e-12) \
            if rate > 0 else 0.0
        segs = tuple(zip(fam.subset, fam.tps, top, strict=True))
        hit += max(ctx.sync_floor(fam.pairs, c_min, devices), ctx.tail_floor(segs, c_min, devices))
        ctx.rate_levels[key] = hit
    return hit


def _boxes_level(ctx: SyncFloors, fam: Family, cores: list[tuple[tuple, tuple | None]], total: int) -> float:
    """`_rate_level` knowing each box's bottleneck floor B (`_box_core`): a box's c_hi pipelines finish
    at most c_hi / B micro-batches per second together after their first, so the family's at most the
    largest of those over the boxes that hold candidates (or R, if that is less); inf where none does."""
    held = [(box, core) for box, core in cores if core is not None]
    if not held:
        return math.inf
    if any(core[3] <= 0 for _, core in held):
        return _rate_level(ctx, fam, total)
    return _stream_level(ctx, fam, total, min(fam.rate_terms[4], max(box[1] / core[3] for box, core in held)))


def _capped_level(pure: list[Group], floor: PipeFloor, count: int, rate: float, total: int) -> float:
    """A floor under the makespan (combine.water_level) when `count` pipelines above `floor` also run
    at most `rate` micro-batches per second together after floor.base_s: the largest T found where
    the pure groups and those pipelines finish fewer than `total` micro-batches (bisection)."""
    a, b = floor.base_s, floor.per_mb_s

    def done(t: float) -> float:
        n = finished_mb(pure, t)
        if t > a:
            n += min(count * max(0, math.floor((t - a) / b)), math.floor(rate * (t - a)))
        return n

    lo = water_level([*pure, Group(floor, count)], total)
    hi = a + max(-(-total // count) * b, total / rate) * (1 + 1e-9) + 1e-12
    if pure:
        hi = min(hi, water_level(pure, total) * (1 + 1e-9) + 1e-12)
    if done(lo) >= total:
        return lo
    lo, _ = bisect_time(lambda t: done(t) >= total, lo_s=lo, hi_s=hi, rel_tol=1e-7, max_iter=40)
    return lo


def _is_shape(fam: Family, box: tuple) -> bool:
    """Whether the box holds a single (replica count, stage counts) shape."""
    clo, chi, lo, hi = box
    return clo == chi and all(a == min(h, n // clo) for a, h, n in zip(lo, hi, fam.slots, strict=True))


def _split(fam: Family, box: tuple) -> list[tuple]:
    """Two halves along the widest range (the replica count's, or a kind's stage count's)."""
    clo, chi, lo, hi = box
    top = tuple(min(h, n // clo) for h, n in zip(hi, fam.slots, strict=True))
    widths = [chi - clo] + [b - a for a, b in zip(lo, top, strict=True)]
    i = max(range(len(widths)), key=lambda j: widths[j])
    if widths[i] == 0:
        return []
    if i == 0:
        mid = (clo + chi) // 2
        return [(clo, mid, lo, top), (mid + 1, chi, lo, top)]
    j, mid = i - 1, (lo[i - 1] + top[i - 1]) // 2
    return [(clo, chi, lo, (*top[:j], mid, *top[j + 1:])), (clo, chi, (*lo[:j], mid + 1, *lo[j + 1:]), top)]


def price_mixed(s: Searcher, results: Sink, todo: list[tuple[list[Group], dict[str, int]]], mbs: int) -> None:
    """Mixed candidates beside each (pure groups, pool of devices) in `todo`, best floor first.

    Heap entries, each floor under the next: a family under its devices' rate, then under its boxes'
    bottlenecks; a box of shapes (one shape: under its loose floor, then its tight one; a wider box only
    under the loose one, where the tight one gained little at 128 devices and doubled the box floors);
    one shape's orders under their member floors (with memory: a floor without memory first spared only
    a quarter of them at 512 devices, less than it cost once `segments._MiddleRuns` made them cheap); then
    the member's layer splits are priced. Once the lowest floor cannot enter the finalists, nothing left
    can.
    """
    total = s.total_mb(mbs)
    heap: list[tuple] = []
    tie = itertools.count()
    for pure, pool in todo:
        ctx = SyncFloors(s, pure)
        for fam, boxes in families(s, pool, mbs):
            # Each family enters under its devices' rate floor; its boxes are floored only once popped.
            heap.append((_rate_level(ctx, fam, total), next(tie), -2, ctx, fam, boxes))
    heapq.heapify(heap)
    while heap:
        level, _, stage, ctx, fam, item = heapq.heappop(heap)
        if not results.may_enter(level):
            break
        if stage == -2:  # a family: its boxes' bottlenecks first, which may raise its floor
            cores = [(box, _box_core(s, fam, box, refine=False)) for box in item]
            tight = _boxes_level(ctx, fam, cores, total)
            if tight > level:
                if tight < math.inf:
                    heapq.heappush(heap, (tight, next(tie), -3, ctx, fam, (level, cores)))
                continue
            item = (level, cores)
            stage = -3
        if stage == -3:  # a family's boxes under their loose floors (over its first floor, as they were)
            first, cores = item
            for box, core in cores:
                lv = None if core is None else _box_level(s, ctx, fam, box, mbs, refine=False, core=core)
                if lv is not None:
                    heapq.heappush(heap, (max(first, lv), next(tie), -1 if _is_shape(fam, box) else 0, ctx, fam, box))
            continue
        if stage == -1:  # one shape under its loose floor: the tight one only now that it could matter
            lv = _box_level(s, ctx, fam, item, mbs)
            if lv is not None:
                heapq.heappush(heap, (max(level, lv), next(tie), 0, ctx, fam, item))
            continue
        if stage == 0:
            halves = _split(fam, item)
            if halves:
                for half in halves:
                    lv = _box_level(s, ctx, fam, half, mbs, refine=False)
                    if lv is not None:
                        heapq.heappush(heap, (max(level, lv), next(tie), -1 if _is_shape(fam, half) else 0, ctx,
                                              fam, half))
                continue
            c, _, ns, _ = item
            devices = sum(t * n for t, n in zip(fam.tps, ns, strict=True))
            hint = s.in_flight_hint(devices, mbs)
            for order in itertools.permutations(range(len(ns))):
                segs = tuple((fam.subset[i], fam.tps[i], ns[i]) for i in order)
                floor = pipe_floor(s.book, s.links, segs, mbs, in_flight_hint=hint)
                if floor is None:
                    continue
                sync = max(ctx.sync_floor([(Slot(*segs[0][:2]), Slot(*segs[-1][:2]))], c, devices),
                           ctx.tail_floor(segs, c, devices))
                lv = max(level, water_level_with(ctx.lines, total, base_s=floor.base_s, per_mb_s=floor.per_mb_s,
                                                 count=c) + sync)
                heapq.heappush(heap, (lv, next(tie), 2, ctx, fam, (segs, c, sync)))
            continue
        segs, c, sync = item
        slots = s.mixed_slots(segs)
        pipes = s.split_part(slots, mbs, recompute=s.config.allow_recompute)
        if s.config.allow_recompute and any(any(pc.recompute) for pc in pipes):
            # Searcher.splits' second half, the splits without recomputation, only where their own floor
            # (none's mode alone: every stage of such a split runs it) could still enter the finalists.
            hint = s.in_flight_hint(sum(t * n for _, t, n in segs), mbs)
            plain = pipe_floor(s.book, s.links, segs, mbs, in_flight_hint=hint, recompute=False)
            if plain is not None and results.may_enter(
                    water_level_with(ctx.lines, total, base_s=plain.base_s, per_mb_s=plain.per_mb_s, count=c) + sync):
                pipes = pipes + s.split_part(slots, mbs, recompute=False)
        for pipe in pipes:
            if results.may_enter(water_level_with(ctx.lines, total, base_s=pipe.base_s, per_mb_s=pipe.per_mb_s,
                                                  count=c)):
                results.add(s.estimate([*ctx.pure, Group(pipe, c)], mbs))



