"""Identical mixed-kind pipelines over a pool of devices: a branch-and-bound over their shapes.

A mixed candidate is a set of two or more kinds, a TP degree per kind, a replica count c, a stage
count n_k per kind (each kind one contiguous segment) and an order of the segments; the pool must
hold it (c n_k tp_k <= pool_k; devices may stay idle) and a pipeline has at most L + 2 stages.
That space is large (hundreds of thousands of shapes on a 512-device pool), so it is searched
best-first over *boxes*: per (kinds, TP degrees), ranges of c and of each n_k. A box's floor
(`_box_level`) is below the step of every candidate in it; the lowest box is split along its widest
range until it is one shape, whose orders then get the per-member floors of `bounds.pipe_floor`
(without, then with, memory) and are split and priced only while those could still enter the
finalists. Nothing is pruned without a proven floor, so this finds every mixed candidate of the
reference search (search/reference.py) whose closed form could be a finalist.
"""

from __future__ import annotations

import heapq
import itertools
import math
from typing import Protocol

from hethub.predict.memory import act_bytes_for
from hethub.schedules import get_schedule
from hethub.search.bounds import PipeFloor, pipe_floor
from hethub.search.combine import Estimate, Group, embedding_sync_floor, water_level
from hethub.search.split import Slot
from hethub.search.templates import Searcher


class Sink(Protocol):
    def may_enter(self, step_lower_bound: float) -> bool: ...

    def add(self, est: Estimate | None) -> None: ...


class Family:
    """(kinds, TP degree per kind) over a pool, with what every box floor of it needs."""

    def __init__(self, s: Searcher, subset: tuple[str, ...], tps: tuple[int, ...], pool: dict[str, int],
                 mbs: int) -> None:
        self.subset, self.tps = subset, tps
        self.slots = tuple(pool[k] // t for k, t in zip(subset, tps, strict=True))
        self.ends = [Slot(k, t) for k, t in zip(subset, tps, strict=True)]
        self.pairs = [(a, b) for a in self.ends for b in self.ends if a != b]
        n_layers = s.model.num_layers
        cs = [_consts(s, k, t, mbs) for k, t in zip(subset, tps, strict=True)]
        self.w = [c[0] for c in cs]
        self.hop = [c[3] for c in cs]
        self.cap = [c[4] for c in cs]  # most layers one stage holds (any variant, one micro-batch in flight)
        self.cap_plain = [c[5] for c in cs]  # the same without recomputation
        self.extra = min([c[6] for c in cs if c[6] > 0] or [0.0])  # cheapest recomputation per layer
        self.feasible = min(self.cap) >= 0 and min(self.w) > 0
        e, h = min(c[1] for c in cs), min(c[2] for c in cs)
        self.base_over_w = min(c[1] / c[0] for c in cs) + min(c[2] / c[0] for c in cs) if self.feasible else 0.0
        self.work_min = n_layers * min(self.w) + e + h
        self.base_min = max(e, h)
        self.cross = min(_hop(s, a, b, mbs) for a, b in self.pairs)
        self.sched = get_schedule(s.book.job.schedule)
        # saturation order for the memory relaxation: kinds by cap * w
        self.order = sorted(range(len(subset)), key=lambda i: self.cap[i] * self.w[i])

    def bottleneck(self, top: list[int], n_layers: int) -> float | None:
        """A floor under the slowest stage with at most top[k] stages per kind; None: no fit.

        Time: L <= sum_s (B - base_s) / w_s, bases at their smallest. Memory: stage s holds at most
        min(cap_k, B / w_k) layers (every stage holds at least one micro-batch), and they hold L.
        """
        if sum(t * c for t, c in zip(top, self.cap, strict=True)) < n_layers:
            return None
        inv = sum(t / w for t, w in zip(top, self.w, strict=True))
        b = (n_layers + self.base_over_w) / inv
        # smallest B with sum_k top_k min(cap_k, B / w_k) >= L (piecewise linear in B)
        held, slope = 0.0, inv
        for i in self.order:
            sat = self.cap[i] * self.w[i]
            if held + slope * sat >= n_layers:
                break
            held += top[i] * self.cap[i]
            slope -= top[i] / self.w[i]
        b = max(b, self.base_min, (n_layers - held) / slope if slope > 0 else b)
        # Whole layers: from there, walk the next layer a stage of some kind can take, in time order,
        # until they hold L (each step adds top_k layers); rounding errs towards more layers held.
        whole, heap = 0, []
        for i, (t, w, cap) in enumerate(zip(top, self.w, self.cap, strict=True)):
            j = min(cap, math.floor(b / w + 1e-9))
            whole += t * j
            if j < cap and t:
                heap.append(((j + 1) * w, i, j + 1))
        heapq.heapify(heap)
        while whole < n_layers and heap:
            b_next, i, j = heapq.heappop(heap)
            whole += top[i]
            b = max(b, b_next * (1 - 1e-12))
            if j < self.cap[i]:
                heapq.heappush(heap, ((j + 1) * self.w[i], i, j + 1))
        return b


def families(s: Searcher, pool: dict[str, int], mbs: int) -> list[tuple[Family, tuple]]:
    """One (family, whole box) per (kinds, TP degree per kind) that the pool holds."""
    key = (tuple(sorted(pool.items())), mbs)
    hit = s.mixed_cache.get(key)
    if hit is not None:
        return hit
    kinds = [k for k, n in pool.items() if n > 0 and s.tps[k]]
    most = s.model.num_layers + 2
    out = []
    for size in range(2, min(len(kinds), most) + 1):
        for subset in itertools.combinations(kinds, size):
            for tps in itertools.product(*[[t for t in s.tps[k] if t <= pool[k]] for k in subset]):
                fam = Family(s, subset, tps, pool, mbs)
                if fam.feasible:
                    hi = tuple(min(n, most - (size - 1)) for n in fam.slots)
                    out.append((fam, (1, min(fam.slots), (1,) * size, hi)))
    s.mixed_cache[key] = out
    return out


def _consts(s: Searcher, kind: str, tp: int, mbs: int) -> tuple:
    """(w, e, h, hop, cap, cap_plain, extra) of (kind, tp): the cheapest per-layer forward + backward
    with or without recomputation, the embedding's and the head's extra cost, a hop between two
    such stages, the most layers a middle stage holds with one micro-batch in flight (any variant;
    -1: not even none), the same without recomputation, and recomputation's extra per layer."""
    key = ("mixed-consts", kind, tp, mbs)
    hit = s.book.stage_floors.get(key)
    if hit is None:
        variants = [s.book.stage(kind, tp=tp, mbs=mbs, recompute=rc) for rc in (False, True)]
        if not s.config.allow_recompute:
            variants = variants[:1]
        n_layers = s.model.num_layers
        caps = [v.max_layers(emb=False, head=False, in_flight=1, limit=n_layers) for v in variants]
        wp = variants[0].fwd_per_layer_s + variants[0].bwd_per_layer_s
        extra = (variants[-1].fwd_per_layer_s + variants[-1].bwd_per_layer_s - wp) if len(variants) > 1 else 0.0
        hit = s.book.stage_floors[key] = (
            min(v.fwd_per_layer_s + v.bwd_per_layer_s for v in variants),
            min(v.emb_fwd_s + v.emb_bwd_s for v in variants), min(v.head_fwd_s + v.head_bwd_s for v in variants),
            _hop(s, Slot(kind, tp), Slot(kind, tp), mbs), max(caps), max(caps[0], 0), extra)
    return hit  # type: ignore[return-value]


def _hop(s: Searcher, a: Slot, b: Slot, mbs: int) -> float:
    key = ("mixed-hop", a, b, mbs)
    hit = s.book.stage_floors.get(key)
    if hit is None:
        job = s.book.job
        act = mbs * job.seq_len * job.model.hidden_size * act_bytes_for(job.precision)
        link = s.links.p2p(a, b)
        hit = s.book.stage_floors[key] = link.latency_s + act / link.bw_bytes_per_s
    return hit  # type: ignore[return-value]


class _Context:
    """One set of pure groups beside which mixed pipelines are placed, with cached sync floors."""

    def __init__(self, s: Searcher, pure: list[Group]) -> None:
        self.s, self.pure = s, pure
        self.devices = sum(g.count * g.pipe.num_devices for g in pure)
        self.firsts = [(g.pipe.slots[0], g.count) for g in pure]
        self.lasts = [(g.pipe.slots[-1], g.count) for g in pure]
        self._sync: dict[tuple, float] = {}

    def sync_floor(self, pairs: list[tuple[Slot, Slot]], c: int, devices: int) -> float:
        """The embedding sync after the makespan (combine.embedding_sync_floor) for c mixed pipelines
        of at least `devices` devices whose (first, last) stages are one of `pairs`; more replicas and
        more devices only slow a ring down, so a box's smallest are a floor for all of it."""
        key = (tuple(pairs), c, devices)
        hit = self._sync.get(key)
        if hit is None:
            s = self.s
            hit = self._sync[key] = min(
                embedding_sync_floor([*self.firsts, (a, c)], [*self.lasts, (b, c)],
                                     total_devices=self.devices + c * devices, links=s.links, model=s.model,
                                     precision=s.config.precision) for a, b in pairs)
        return hit


def _box_level(s: Searcher, ctx: _Context, fam: Family, box: tuple, mbs: int) -> float | None:
    """A floor under the step of every candidate in the box (None: the box holds none).

    Each kind has at most H_k = min(hi_k, slots_k // c_lo) stages (Family.bottleneck gives the
    bottleneck floor). One micro-batch's work is at least that and at least L min w + min e + min h,
    plus the recomputation memory forces; hops at least the box's fewest stages' within-kind hops plus
    (kinds - 1) of the cheapest cross-kind hop. T(m) >= the schedule's fill floor + 2 hops + (m - 1) B,
    with c_hi such pipelines, then the embedding sync.
    """
    clo, chi, lo, hi = box
    n_layers = s.model.num_layers
    top = [min(h, n // clo) for h, n in zip(hi, fam.slots, strict=True)]
    if any(a > b for a, b in zip(lo, top, strict=True)) or sum(lo) > n_layers + 2:
        return None
    bottleneck = fam.bottleneck(top, n_layers)
    if bottleneck is None:
        return None
    forced = n_layers - sum(t * c for t, c in zip(top, fam.cap_plain, strict=True))
    work = max(bottleneck, fam.work_min + (forced * fam.extra if forced > 0 else 0.0))
    hops = sum((n - 1) * h for n, h in zip(lo, fam.hop, strict=True)) + (len(lo) - 1) * fam.cross
    fill = fam.sched.fill_work_floor_s(work_s=work, bottleneck_s=bottleneck)
    floor = PipeFloor(base_s=fill + 2 * hops - bottleneck, per_mb_s=bottleneck)
    devices = sum(t * n for t, n in zip(fam.tps, lo, strict=True))
    return water_level([*ctx.pure, Group(floor, chi)], s.total_mb(mbs)) + ctx.sync_floor(fam.pairs, clo, devices)


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

    Heap entries, each floor under the next: a box of shapes, one shape's orders under the loose
    member floor (no memory), the tight one (with memory); then the member's layer splits are
    priced. Once the lowest floor cannot enter the finalists, nothing left can.
    """
    total = s.total_mb(mbs)
    heap: list[tuple] = []
    tie = itertools.count()
    for pure, pool in todo:
        ctx = _Context(s, pure)
        for fam, box in families(s, pool, mbs):
            level = _box_level(s, ctx, fam, box, mbs)
            if level is not None:
                heap.append((level, next(tie), 0, ctx, fam, box))
    heapq.heapify(heap)
    while heap:
        level, _, stage, ctx, fam, item = heapq.heappop(heap)
        if not results.may_enter(level):
            break
        if stage == 0:
            halves = _split(fam, item)
            if halves:
                for half in halves:
                    lv = _box_level(s, ctx, fam, half, mbs)
                    if lv is not None:
                        heapq.heappush(heap, (max(level, lv), next(tie), 0, ctx, fam, half))
                continue
            c, _, ns, _ = item
            for order in itertools.permutations(range(len(ns))):
                segs = tuple((fam.subset[i], fam.tps[i], ns[i]) for i in order)
                floor = pipe_floor(s.book, s.links, segs, mbs, memory=False)
                if floor is None:
                    continue
                devices = sum(t * n for _, t, n in segs)
                sync = ctx.sync_floor([(Slot(*segs[0][:2]), Slot(*segs[-1][:2]))], c, devices)
                lv = max(level, water_level([*ctx.pure, Group(floor, c)], total) + sync)
                heapq.heappush(heap, (lv, next(tie), 1, ctx, fam, (segs, c, sync)))
            continue
        segs, c, sync = item
        if stage == 1:
            floor = pipe_floor(s.book, s.links, segs, mbs)
            if floor is not None:
                lv = max(level, water_level([*ctx.pure, Group(floor, c)], total) + sync)
                heapq.heappush(heap, (lv, next(tie), 2, ctx, fam, item))
            continue
        for pipe in s.mixed(segs, mbs):
            groups = [*ctx.pure, Group(pipe, c)]
            if results.may_enter(water_level(groups, total)):
                results.add(s.estimate(groups, mbs))



