"""Identical mixed-kind pipelines over a pool of devices: a branch-and-bound over their shapes.

A mixed candidate is two or more kinds, a TP degree per kind, a replica count c, a stage count n_k
per kind (each kind one contiguous segment) and an order of the segments; the pool holds it (c n_k
tp_k <= pool_k) and a pipeline has at most L + 2 stages. That space is large, so it is searched
best-first over *boxes*: per (kinds, TP degrees), ranges of c and of each n_k. A box's floor
(`_box_level`) is below the step of every candidate in it; the lowest box is split along its widest
range until it is one shape, whose orders get the member floors of `bounds.pipe_floor` (with memory)
and are split and priced only while those could still enter the finalists. Nothing is pruned without
a proven floor, so this finds every mixed candidate of the reference search whose closed form could
be a finalist (tests/unit/_reference_search.py).
"""

from __future__ import annotations

import heapq
import itertools
import math
import weakref
from collections.abc import Callable
from typing import Protocol

from hethub.memo import reference
from hethub.predict.holding import PipeFloor, Runs, smallest_holding, undominated
from hethub.predict.memory import act_bytes_for
from hethub.predict.water import capped_level, lines_level_beside, water_level_with
from hethub.schedules import get_schedule
from hethub.search.bounds import pipe_floor, stage_modes
from hethub.search.combine import Estimate, Group
from hethub.search.split import Cache, Slot
from hethub.search.sync_floors import SyncFloors
from hethub.search.templates import Searcher

# The mixed search's caches in each job's CostBook.
_FAMILY_MODES: Cache[tuple[tuple[int, float], ...]] = Cache("family-modes", shared=True)
_HELD_MODES: Cache[tuple[tuple[int, float, float], ...]] = Cache("held-modes", shared=True)  # Family._held_modes'
_HELD_RUNS: Cache[Runs] = Cache("held-runs", shared=True)  # Family._held_runs'
_SORTED_IN_FLIGHTS: Cache[tuple[int, ...]] = Cache("in-flights-sorted")
_KIND_CONSTANTS: Cache[tuple[float, float, float, float, float]] = Cache("mixed-consts")


class Sink(Protocol):
    def may_enter(self, step_lower_bound: float) -> bool: ...
    def add(self, est: Estimate | None) -> None: ...


def _box_core(s: Searcher, fam: Family, box: tuple, *, refine: bool) -> tuple | None:
    """What `_box_level` builds its floor on: each kind's most stages, the fewest devices of a
    pipeline, the in-flight counts and the bottleneck floor (None: the box holds no candidate)."""
    clo, _, lo, hi = box
    top = tuple(min(h, n // clo) for h, n in zip(hi, fam.slots, strict=True))
    if any(a > b for a, b in zip(lo, top, strict=True)) or sum(lo) > fam.n_layers + 2:
        return None
    devices = sum(t * n for t, n in zip(fam.tps, lo, strict=True))
    flights = fam.flights(sum(lo), devices)
    bottleneck = fam.bottleneck(top, flights if refine else flights[:1])
    return None if bottleneck is None else (top, devices, flights, bottleneck)


def _box_level(s: Searcher, ctx: SyncFloors, fam: Family, box: tuple, mbs: int, *, refine: bool = True,
               core: tuple | None = None, enters: Callable[[float], bool] | None = None) -> float | None:
    """A floor under the step of every candidate in the box (None: the box holds none, or, with
    ``enters``, none that could enter: `_with_syncs`).

    Each kind has at most H_k = min(hi_k, slots_k // c_lo) stages (Family.bottleneck: the bottleneck
    floor B). One micro-batch's work is at least B and L min w + min e + min h plus the recomputation
    memory forces; hops at least the fewest stages' within-kind hops plus (kinds - 1) cheapest
    cross-kind ones. T(m) >= the fill floor + 2 hops + (m - 1) B, c_hi such pipelines, then the syncs.
    ``refine=False``: every stage at the fewest in-flight micro-batches (looser, O(kinds) not
    O(stages)). ``core``: the box's `_box_core`, where made."""
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
        level = max(level, capped_level(ctx.pure, ctx.lines, floor, count=chi, rate=rate, total=total, lo=level))
    return _with_syncs(ctx, fam, level, top=top, replicas=clo, devices=devices, enters=enters)


def _with_syncs(ctx: SyncFloors, fam: Family, level: float, *, top: tuple, replicas: int, devices: int,
                enters: Callable[[float], bool] | None) -> float | None:
    """``level`` plus the floor under what the step adds after the makespan: the embedding's sync, or the
    layers' (`SyncFloors.tail_floor`) of `fam`'s pipelines at ``top`` stages per kind, ``replicas`` and
    ``devices``; None where ``enters`` rejects the level, or it with the embedding sync (the floor only
    rises from there), before the layers' syncs are floored."""
    if enters is not None and not enters(level):
        return None
    sync = ctx.sync_floor(fam.pairs, replicas, devices)
    if enters is not None and not enters(level + sync):
        return None
    return level + max(sync, ctx.tail_floor(tuple(zip(fam.subset, fam.tps, top, strict=True)), replicas, devices))


def _rate_level(ctx: SyncFloors, fam: Family, total: int, rate: float | None = None, *,
                enters: Callable[[float], bool] | None = None) -> float | None:
    """A floor under the makespan of every candidate in the family's `boxes` beside ctx's pure
    groups. A mixed pipeline j finishes its m-th micro-batch no earlier than F + (m - 1) B_j (as in
    `_box_level`), its fill F at least F0, the fill floor of one micro-batch's least work with the
    bottleneck left out. A kind-k stage takes w_k or more per layer, so B_j >= L / sum over j's stages
    of 1 / w_k and sum_j 1 / B_j <= R = sum_k slots_k / w_k / L (``rate``: a tighter one,
    `_boxes_level`'s). By T >= F0 the c <= c_max pipelines finish at most c_max + R (T - F0), none
    before F0; the makespan T has finished_mb(pure, T) plus that >= total. Then `_box_level`'s sync
    floors (growing with replicas, devices and fewer stages) at the boxes' fewest replicas and
    devices and most stages per kind. None: ``enters`` rejects it part way (`_box_level`'s)."""
    rate = fam.rate_terms[4] if rate is None else rate
    key = (id(fam), total, rate)
    if (hit := ctx.rate_levels.get(key)) is None:
        c_min, c_max, devices, top, _ = fam.rate_terms
        f0 = fam.sched.fill_work_floor_s(work_s=fam.work_min, bottleneck_s=0.0)
        # by T the stream of the family's pipelines finishes c_max at F0 and one more every 1 / R after
        hit = lines_level_beside(ctx.lines, total, start_s=f0, per_s=1 / rate, at_start=c_max) * (1 - 1e-12) \
            if rate > 0 else 0.0
        if (hit := _with_syncs(ctx, fam, hit, top=top, replicas=c_min, devices=devices, enters=enters)) is None:
            return None
        ctx.rate_levels[key] = hit
    return hit


def _boxes_level(ctx: SyncFloors, fam: Family, cores: list[tuple[tuple, tuple | None]], total: int, *,
                 enters: Callable[[float], bool] | None = None) -> float | None:
    """`_rate_level` knowing each box's bottleneck floor B (`_box_core`): a box's c_hi pipelines finish
    at most c_hi / B micro-batches per second together after their first, so the family's at most the
    largest of those over the boxes that hold candidates (or R, if that is less); inf where none does.
    None: ``enters`` rejects it part way (`_rate_level`)."""
    held = [(box, core) for box, core in cores if core is not None]
    if not held:
        return math.inf
    if any(core[3] <= 0 for _, core in held):
        return _rate_level(ctx, fam, total, enters=enters)
    rate = min(fam.rate_terms[4], max(box[1] / core[3] for box, core in held))
    return _rate_level(ctx, fam, total, rate, enters=enters)


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

    Heap entries, each floor under the next: a family under its devices' rate, then its boxes'
    bottlenecks; a box (one shape: under its loose floor, then its tight one; a wider box the loose
    one); one shape's orders under their member floors; then the members' splits are priced. Once
    the lowest floor cannot enter the finalists, nothing left can: so neither can an entry whose floor
    cannot enter when it is made, which is left out (made only as far as that shows, `_box_level`)."""
    total = s.total_mb(mbs)
    heap: list[tuple] = []
    tie = itertools.count()

    def above(first: float) -> Callable[[float], bool] | None:
        """Whether a floor, at least ``first``, could enter (on the reference path every floor is made whole)."""
        return None if reference() else lambda x: results.may_enter(max(first, x))

    for pure, pool in todo:
        ctx = SyncFloors(s, pure)
        for fam, boxes in families(s, pool, mbs):
            # Each family enters under its devices' rate floor; its boxes are floored only once popped.
            if (lv := _rate_level(ctx, fam, total, enters=above(-math.inf))) is not None:
                heap.append((lv, next(tie), -2, ctx, fam, boxes))
    heapq.heapify(heap)
    while heap:
        level, _, stage, ctx, fam, item = heapq.heappop(heap)
        if not results.may_enter(level):
            break
        if stage == -2:  # a family: its boxes' bottlenecks first, which may raise its floor
            cores = [(box, _box_core(s, fam, box, refine=False)) for box in item]
            if (tight := _boxes_level(ctx, fam, cores, total, enters=above(level))) is None:
                continue
            if tight > level:
                if tight < math.inf:
                    heapq.heappush(heap, (tight, next(tie), -3, ctx, fam, (level, cores)))
                continue
            item = (level, cores)
            stage = -3
        if stage == -3:  # a family's boxes under their loose floors (over its first floor, as they were)
            first, cores = item
            for box, core in cores:
                lv = None if core is None else _box_level(s, ctx, fam, box, mbs, refine=False, core=core,
                                                          enters=above(first))
                if lv is not None:
                    heapq.heappush(heap, (max(first, lv), next(tie), -1 if _is_shape(fam, box) else 0, ctx, fam, box))
            continue
        if stage == -1:  # one shape under its loose floor: the tight one only now that it could matter
            if (lv := _box_level(s, ctx, fam, item, mbs, enters=above(level))) is not None:
                heapq.heappush(heap, (max(level, lv), next(tie), 0, ctx, fam, item))
            continue
        if stage == 0:
            if halves := _split(fam, item):
                for half in halves:
                    if (lv := _box_level(s, ctx, fam, half, mbs, refine=False, enters=above(level))) is not None:
                        heapq.heappush(heap, (max(level, lv), next(tie), -1 if _is_shape(fam, half) else 0, ctx,
                                              fam, half))
                continue
            c, _, ns, _ = item
            devices = sum(t * n for t, n in zip(fam.tps, ns, strict=True))
            hint = s.in_flight_hint(devices, mbs)
            for order in itertools.permutations(range(len(ns))):
                segs = tuple((fam.subset[i], fam.tps[i], ns[i]) for i in order)
                if (floor := pipe_floor(s.book, s.links, segs, mbs, in_flight_hint=hint)) is None:
                    continue
                sync = ctx.order_floor(segs, c, devices)
                made = water_level_with(ctx.lines, total, base_s=floor.base_s, per_mb_s=floor.per_mb_s, count=c)
                heapq.heappush(heap, (max(level, made + sync), next(tie), 2, ctx, fam, (segs, c, sync, made)))
            continue
        segs, c, sync, made = item
        if not reference() and not results.may_enter(made + max(sync, ctx.held_floor(segs, c, mbs))):
            continue  # no split of the order could enter: none is made (SyncFloors.held_floor)
        slots = s.mixed_slots(segs)
        laid = [s.layer_splits(slots, mbs, recompute=s.config.allow_recompute)]
        if s.config.allow_recompute and laid[0].recomputes():
            # Searcher.splits' second half, the splits without recomputation, only where their own floor
            # (none's mode alone: every stage of such a split runs it) could still enter the finalists.
            hint = s.in_flight_hint(sum(t * n for _, t, n in segs), mbs)
            plain = pipe_floor(s.book, s.links, segs, mbs, in_flight_hint=hint, recompute=False)
            if plain is not None and results.may_enter(
                    water_level_with(ctx.lines, total, base_s=plain.base_s, per_mb_s=plain.per_mb_s, count=c) + sync):
                laid.append(s.layer_splits(slots, mbs, recompute=False))
        for half, recompute in zip(laid, (s.config.allow_recompute, False), strict=False):
            # A half is priced only where one of its splits, at the order's makespan floor (`made`) plus its own
            # sync floor (boundaries known before pricing), could enter: `estimate` rejects the others unpriced.
            if reference() or any(results.may_enter(made + max(sync, ctx.split_floor(slots, counts, c)))
                                  for counts in half.counts):
                for pipe in s.split_part(slots, mbs, recompute=recompute):
                    if results.may_enter(water_level_with(ctx.lines, total, base_s=pipe.base_s,
                                                          per_mb_s=pipe.per_mb_s, count=c)):
                        # Priced only where its step with its split's sync floor (at least the order's) could enter;
                        # one leaving a pipeline idle is the plan of fewer pipelines, not a candidate of this search.
                        results.add(s.estimate([*ctx.pure, Group(pipe, c)], mbs, whole=True,
                                               after_s=max(sync, ctx.split_floor(pipe.slots, pipe.layers, c)),
                                               may_enter=results.may_enter))


# ---- The families of the mixed search: each set of kinds and TP degree per kind over a pool.
COMPLETE_POOL = 128  # cluster devices up to which mixed shapes are searched completely


def _spread(lo: int, hi: int, n: int) -> list[int]:
    if hi - lo + 1 <= n:
        return list(range(lo, hi + 1))
    vals, x, ratio = {lo, hi}, float(lo), (hi / lo) ** (1 / (n - 1))
    for _ in range(n):
        x *= ratio
        vals.add(min(hi, round(x)))
    return sorted(vals)


class Family:
    """(kinds, TP degree per kind) over a pool, with what every box floor of it needs."""

    slots: tuple[int, ...] = ()  # stage slots of each kind in the pool (`over`)
    rate_terms: tuple = ()  # what _rate_level reads of the family's boxes in that pool (`with_boxes`)

    def __init__(self, s: Searcher, subset: tuple[str, ...], tps: tuple[int, ...], mbs: int) -> None:
        self.subset, self.tps = subset, tps
        self.ends = [Slot(k, t) for k, t in zip(subset, tps, strict=True)]
        self.pairs = tuple((a, b) for a in self.ends for b in self.ends if a != b)
        n_layers = s.model.num_layers
        cs = [_consts(s, k, t, mbs) for k, t in zip(subset, tps, strict=True)]
        # The searcher keeps its families (Searcher.family_protos): a weak reference, so no reference cycle.
        self._searcher, self.mbs = weakref.ref(s), mbs
        self.book, self.allow, self.n_layers = s.book, s.config.allow_recompute, s.model.num_layers
        self.w = [c[0] for c in cs]
        self.hop = [c[3] for c in cs]
        self.extra = min([c[4] for c in cs if c[4] > 0] or [0.0])  # cheapest recomputation per layer
        self._caps: dict[int, tuple[list[int], list[int]]] = {}
        self._orders: dict[int, tuple[int, ...]] = {}  # _saturation_order's, by in-flight count
        self._bottlenecks: dict[tuple, float | None] = {}  # by (top, flights): sibling boxes share them
        self.feasible = min(self.caps(1)[0]) >= 0 and min(self.w) > 0
        e, h = min(c[1] for c in cs), min(c[2] for c in cs)
        self.base_over_w = min(c[1] / c[0] for c in cs) + min(c[2] / c[0] for c in cs) if self.feasible else 0.0
        self.work_min = n_layers * min(self.w) + e + h
        self.base_min = max(e, h)
        self.cross = min(_hop(s, a, b, mbs) for a, b in self.pairs)
        self.sched = get_schedule(s.book.job.schedule, chunks=s.book.job.chunks)
        self.bounded = self.sched.max_in_flight(stage=0, num_stages=1) is not None  # planning ignores the hint

    @property
    def s(self) -> Searcher:
        s = self._searcher()
        assert s is not None, "a family outlived its search"
        return s

    def over(self, pool: dict[str, int]) -> Family:
        """This family over a pool: a shallow copy, so every pool's families share one set of stage
        constants and caches (they depend on the kinds, TP degrees and micro-batch size only)."""
        fam = Family.__new__(Family)
        fam.__dict__.update(self.__dict__)
        fam.slots = tuple(pool[k] // t for k, t in zip(self.subset, self.tps, strict=True))
        return fam

    def with_boxes(self, c_min: int, c_max: int, devices: int, top: tuple[int, ...]) -> Family:
        """Keep what `_rate_level` reads of the family's boxes: their fewest and most replicas, fewest
        devices per pipeline and most stages per kind, and the devices' rate."""
        self.rate_terms = (c_min, c_max, devices, top,
                           sum(n / w for n, w in zip(self.slots, self.w, strict=True)) / self.n_layers)
        return self

    def caps(self, in_flight: int) -> tuple[list[int], list[int]]:
        """Most layers a middle stage of each kind holds with `in_flight` micro-batches (any mode;
        -1: not even none), and the same without recomputation."""
        if (hit := self._caps.get(in_flight)) is None:
            modes = [self.modes(i, in_flight) for i in range(len(self.subset))]
            hit = self._caps[in_flight] = ([max(c for c, _ in m) for m in modes], [max(m[0][0], 0) for m in modes])
        return hit

    def modes(self, i: int, in_flight: int) -> tuple[tuple[int, float], ...]:
        """(capacity, cost per layer) of a middle stage of the i-th kind in each mode the split may give
        it (none first; capacity -1 where not even none fits), at `in_flight` micro-batches."""
        book, allow = self.book, self.allow
        key = (self.subset[i], self.tps[i], self.mbs, in_flight, allow)
        hit = book.cache(_FAMILY_MODES).get(key)
        if hit is None:  # shared by every family holding this kind at this TP degree
            got = stage_modes(book, self.subset[i], self.tps[i], self.mbs, False, False, in_flight)
            hit = book.cache(_FAMILY_MODES)[key] = tuple((c, w) for c, w, _ in (got if allow else got[:1]))
        return hit

    def flights(self, stages: int, devices: int) -> tuple[int, ...]:
        """The in-flight counts split.split_layers sizes a `stages`-stage pipeline of `devices` devices
        for (planning_in_flight), smallest first. In the registry's schedules the j-th smallest never
        falls as a pipeline gains stages or devices (1F1B: j + 1; ZB-H1: p; GPipe: the hint, growing with
        the devices, which matter only there; interleaved: (v - 1) p + 1 + 2 j chunks over v), so any
        member's j-th smallest is at least this list's (its last, past the list's end)."""
        hint = 1 if self.bounded else self.s.in_flight_hint(devices, self.mbs)
        key = (self.sched.name, stages, hint)
        if (hit := self.book.cache(_SORTED_IN_FLIGHTS).get(key)) is None:
            hit = self.book.cache(_SORTED_IN_FLIGHTS)[key] = tuple(sorted(
                self.sched.planning_in_flight(stage=i, num_stages=stages, expected_micro_batches=hint)
                for i in range(stages)))
        return hit

    def bottleneck(self, top: tuple[int, ...], flights: tuple[int, ...]) -> float | None:
        """`_bottleneck`, kept by what it reads (sibling boxes share most stages and in-flight counts)."""
        hit = () if reference() else self._bottlenecks.get((top, flights), ())
        if hit == ():
            hit = self._bottlenecks[top, flights] = self._bottleneck(top, flights)
        return hit

    def _bottleneck(self, top: tuple[int, ...], flights: tuple[int, ...]) -> float | None:
        """A floor under the slowest stage with at most top[k] stages per kind; None: no fit.

        Time: L <= sum_s (B - base_s) / w_s, bases at their smallest. Memory: stage s holds at most
        min(cap_k, B / w_k) layers (each holds >= flights[0] micro-batches), and they hold L. In whole
        layers: a kind's i-th stage (by in-flight count) holds >= flights[i] (`flights`), so at most what
        the best mode holds within B there (split._options's capacities and costs; bases >= 0 left out)."""
        cap, n_layers = self.caps(flights[0])[0], self.n_layers
        if min(cap) < 0 or sum(t * c for t, c in zip(top, cap, strict=True)) < n_layers:
            return None
        w = self.w
        inv = sum(t / x for t, x in zip(top, w, strict=True))
        b = (n_layers + self.base_over_w) / inv
        # smallest B with sum_k top_k min(cap_k, B / w_k) >= L (piecewise linear in B)
        held, slope = 0.0, inv
        for i in self._saturation_order(flights[0]):
            sat = cap[i] * w[i]
            if held + slope * sat >= n_layers:
                break
            held += top[i] * cap[i]
            slope -= top[i] / w[i]
        b = max(b, self.base_min, (n_layers - held) / slope if slope > 0 else b)
        # Whole layers (holding.smallest_holding), each kind's stages at the smallest in-flight counts a
        # member can give them; a stage that holds nothing counts 0 (a member may have fewer stages).
        last = len(flights) - 1
        if last == 0:  # one in-flight count for every stage: a group per kind
            return smallest_holding([(t, self._held_modes(i, flights[0])) for i, t in enumerate(top) if t > 0],
                                    n_layers, b)
        groups: dict[tuple, int] = {}
        run = flights == tuple(range(flights[0], flights[0] + last + 1))  # 1F1B's 1 .. p: read off runs
        for i, t in enumerate(top):
            if run and t > 0:
                for ms, k in self._held_runs(i, flights[0], flights[0] + min(t, last) - 1):
                    groups[ms] = groups.get(ms, 0) + k
            else:
                for j in range(min(t, last)):
                    ms = self._held_modes(i, flights[j])
                    groups[ms] = groups.get(ms, 0) + 1
            if t > last:
                ms = self._held_modes(i, flights[last])
                groups[ms] = groups.get(ms, 0) + t - last
        return smallest_holding([(k, ms) for ms, k in groups.items()], n_layers, b)

    def _held_runs(self, i: int, lo: int, hi: int) -> list[tuple[tuple, int]]:
        """(`_held_modes`, stages) of the i-th kind's stages holding lo .. hi micro-batches, one each, read
        off `holding.Runs` of its modes by in-flight count (capacities only fall as it grows: few runs),
        kept per kind and TP degree, so every family holding the kind there reads one."""
        key = (self.subset[i], self.tps[i], self.mbs, self.allow)
        if (runs := self.book.cache(_HELD_RUNS).get(key)) is None:
            runs = self.book.cache(_HELD_RUNS)[key] = Runs()
        for f in range(runs.last + 1, hi + 1):
            runs.add(self._held_modes(i, f))
        return runs.counts(lo, hi)

    def _saturation_order(self, in_flight: int) -> tuple[int, ...]:
        """The kinds by the time a middle stage of each takes to fill its capacity (cap_k w_k)."""
        if (hit := self._orders.get(in_flight)) is None:
            cap = self.caps(in_flight)[0]
            hit = self._orders[in_flight] = tuple(sorted(range(len(cap)), key=lambda j: cap[j] * self.w[j]))
        return hit

    def _held_modes(self, i: int, in_flight: int) -> tuple[tuple[int, float, float], ...]:
        """`modes` as holding.smallest_holding takes them, bases 0, capacities at least 0, `undominated`; kept,
        as `modes` is, for every family holding this kind at this TP degree."""
        key = (self.subset[i], self.tps[i], self.mbs, in_flight, self.allow)
        if (hit := self.book.cache(_HELD_MODES).get(key)) is None:
            hit = self.book.cache(_HELD_MODES)[key] = undominated(tuple((max(c, 0), w, 0.0)
                                                                        for c, w in self.modes(i, in_flight)))
        return hit


def families(s: Searcher, pool: dict[str, int], mbs: int) -> list[tuple[Family, list[tuple]]]:
    """Each (kinds, TP degree per kind) that the pool holds, with the boxes it is searched in."""
    key = (tuple(sorted(pool.items())), mbs)
    hit = s.pool_families.get(key)
    if hit is not None:
        return hit
    kinds = [k for k, n in pool.items() if n > 0 and s.tps[k]]
    most = s.model.num_layers + 2
    out = []
    for size in range(2, min(len(kinds), most) + 1):
        for subset in itertools.combinations(kinds, size):
            for tps in itertools.product(*[[t for t in s.tps[k] if t <= pool[k]] for k in subset]):
                proto = s.family_protos.get((subset, tps, mbs))
                if proto is None:
                    proto = s.family_protos[(subset, tps, mbs)] = Family(s, subset, tps, mbs)
                if not proto.feasible:
                    continue
                slots = tuple(pool[k] // t for k, t in zip(subset, tps, strict=True))
                if s.cluster.num_devices <= COMPLETE_POOL:
                    hi = tuple(min(n, most - (size - 1)) for n in slots)
                    fam = proto.over(pool).with_boxes(1, min(slots), sum(tps), hi)
                    out.append((fam, [(1, min(slots), (1,) * size, hi)]))
                    continue
                # Larger pools: the whole pool, replica counts spread geometrically (not complete: the
                # complete boxes' floors are too loose there to prune).
                c_lo = max(1, -(-sum(slots) // most))
                boxes, devices = [], math.inf
                for c in _spread(c_lo, min(slots), 8) if c_lo <= min(slots) else ():
                    ns = tuple(n // c for n in slots)
                    if sum(ns) <= most:
                        boxes.append((c, c, ns, ns))
                        devices = min(devices, sum(t * n for t, n in zip(tps, ns, strict=True)))
                if boxes:  # replica counts ascending: the first box has the most stages of each kind
                    out.append((proto.over(pool).with_boxes(boxes[0][0], boxes[-1][1], devices, boxes[0][3]), boxes))
    s.pool_families[key] = out
    return out


def _consts(s: Searcher, kind: str, tp: int, mbs: int) -> tuple:
    """(w, e, h, hop, extra) of (kind, tp): the cheapest per-layer forward + backward with or without
    recomputation, the embedding's and the head's extra cost, a hop between two such stages, and
    recomputation's extra per layer."""
    key = (kind, tp, mbs)
    if (hit := s.book.cache(_KIND_CONSTANTS).get(key)) is None:
        variants = [s.book.stage(kind, tp=tp, mbs=mbs, recompute=False), s.book.recompute_floor(kind, tp=tp, mbs=mbs)]
        if not s.config.allow_recompute:
            variants = variants[:1]
        wp = variants[0].fwd_per_layer_s + variants[0].bwd_per_layer_s
        extra = (variants[-1].fwd_per_layer_s + variants[-1].bwd_per_layer_s - wp) if len(variants) > 1 else 0.0
        hit = s.book.cache(_KIND_CONSTANTS)[key] = (
            min(v.fwd_per_layer_s + v.bwd_per_layer_s for v in variants),
            min(v.emb_fwd_s + v.emb_bwd_s for v in variants), min(v.head_fwd_s + v.head_bwd_s for v in variants),
            _hop(s, Slot(kind, tp), Slot(kind, tp), mbs), extra)
    return hit


def _hop(s: Searcher, a: Slot, b: Slot, mbs: int) -> float:
    """One micro-batch's hop from a stage of `a` to one of `b` and back (LinkBook.hop_s, which keeps it)."""
    numel, job = mbs * s.book.job.seq_len * s.model.hidden_size, s.book.job
    return s.links.hop_s(a, b, numel=numel, nbytes=numel * act_bytes_for(job.precision))
