"""The families of the mixed search (search/mixed.py): each set of kinds and TP degree per kind over a
pool of devices, with the stage constants, capacities and bottleneck floor every box floor of it
reads, and the boxes of replica and stage counts it is searched in (`families`).
"""

from __future__ import annotations

import itertools
import math
import weakref

from hethub.predict.memory import act_bytes_for
from hethub.schedules import get_schedule
from hethub.search.holding import Runs, smallest_holding
from hethub.search.segments import stage_modes
from hethub.search.split import Slot
from hethub.search.templates import Searcher

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
        # The searcher keeps its families (Searcher.mixed_cache): a weak reference, so no reference cycle.
        self._searcher, self.mbs = weakref.ref(s), mbs
        self.book, self.allow, self.n_layers = s.book, s.config.allow_recompute, s.model.num_layers
        self.w = [c[0] for c in cs]
        self.hop = [c[3] for c in cs]
        self.extra = min([c[4] for c in cs if c[4] > 0] or [0.0])  # cheapest recomputation per layer
        self._caps: dict[int, tuple[list[int], list[int]]] = {}
        self._held: dict[tuple[int, int], tuple] = {}
        self._runs: dict[int, Runs] = {}  # `_held_modes` by in-flight count, per kind (_held_runs)
        self._orders: dict[int, tuple[int, ...]] = {}  # _saturation_order's, by in-flight count
        self.cap, self.cap_plain = self.caps(1)
        self.feasible = min(self.cap) >= 0 and min(self.w) > 0
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
        """This family over a pool of devices: a shallow copy (without copy.copy's slower protocol: a
        search makes ~10^3), so the families of every pool of a search share one set of stage constants
        and capacity caches (they depend on the kinds, TP degrees and micro-batch size only)."""
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
        hit = self._caps.get(in_flight)
        if hit is None:
            modes = [self.modes(i, in_flight) for i in range(len(self.subset))]
            hit = self._caps[in_flight] = ([max(c for c, _ in m) for m in modes],
                                           [max(m[0][0], 0) for m in modes])
        return hit

    def modes(self, i: int, in_flight: int) -> tuple[tuple[int, float], ...]:
        """(capacity, cost per layer) of a middle stage of the i-th kind in each mode the split may give
        it (none first; capacity -1 where not even none fits), at `in_flight` micro-batches."""
        book, allow = self.book, self.allow
        key = ("family-modes", self.subset[i], self.tps[i], self.mbs, in_flight, allow)
        hit = book.stage_floors.get(key)
        if hit is None:  # shared by every family holding this kind at this TP degree
            got = stage_modes(book, self.subset[i], self.tps[i], self.mbs, False, False, in_flight)
            hit = book.stage_floors[key] = tuple((c, w) for c, w, _ in (got if allow else got[:1]))
        return hit  # type: ignore[return-value]

    def flights(self, stages: int, devices: int) -> tuple[int, ...]:
        """The in-flight counts split.split_layers sizes the stages of a `stages`-stage pipeline of
        `devices` devices for (planning_in_flight), smallest first. In the registry's schedules the j-th
        smallest never falls as a pipeline gains stages or devices (1F1B: j + 1; ZB-H1: p; GPipe: the
        hint, which grows with the devices; interleaved: (v - 1) p + 1 + 2 j chunks over v), so any
        member's j-th smallest is at least this list's (its last, past the list's end)."""
        # the devices matter only through the hint, and only where the schedule has no in-flight bound
        # (GPipe); shared by every family of the search
        hint = 1 if self.bounded else self.s.in_flight_hint(devices, self.mbs)
        key = ("in-flights-sorted", self.sched.name, stages, hint)
        hit = self.book.stage_floors.get(key)
        if hit is None:
            hit = self.book.stage_floors[key] = tuple(sorted(
                self.sched.planning_in_flight(stage=i, num_stages=stages, expected_micro_batches=hint)
                for i in range(stages)))
        return hit  # type: ignore[return-value]

    def bottleneck(self, top: list[int], n_layers: int, flights: tuple[int, ...]) -> float | None:
        """A floor under the slowest stage with at most top[k] stages per kind; None: no fit.

        Time: L <= sum_s (B - base_s) / w_s, bases at their smallest. Memory: stage s holds at most
        min(cap_k, B / w_k) layers (every stage holds at least flights[0] micro-batches), and they hold
        L. In whole layers: a kind's i-th stage (by in-flight count) holds at least flights[i] (the
        `flights` list's property), so at most what the best mode holds within B there (each mode's own
        capacity and cost, as split._options prices it; bases >= 0 left out), and they hold L.
        """
        cap = self.caps(flights[0])[0]
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
        off `holding.Runs` of its modes by in-flight count (capacities only fall as it grows: few runs)."""
        runs = self._runs.get(i)
        if runs is None:
            runs = self._runs[i] = Runs()
        for f in range(runs.last + 1, hi + 1):
            runs.add(self._held_modes(i, f))
        return runs.counts(lo, hi)

    def _saturation_order(self, in_flight: int) -> tuple[int, ...]:
        """The kinds by the time a middle stage of each takes to fill its capacity (cap_k w_k)."""
        hit = self._orders.get(in_flight)
        if hit is None:
            cap = self.caps(in_flight)[0]
            hit = self._orders[in_flight] = tuple(sorted(range(len(cap)), key=lambda j: cap[j] * self.w[j]))
        return hit

    def _held_modes(self, i: int, in_flight: int) -> tuple[tuple[int, float, float], ...]:
        """`modes` as holding.smallest_holding takes them, bases 0 and capacities at least 0."""
        key = (i, in_flight)
        hit = self._held.get(key)
        if hit is None:
            hit = self._held[key] = tuple((max(c, 0), w, 0.0) for c, w in self.modes(i, in_flight))
        return hit


def families(s: Searcher, pool: dict[str, int], mbs: int) -> list[tuple[Family, list[tuple]]]:
    """Each (kinds, TP degree per kind) that the pool holds, with the boxes it is searched in."""
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
                proto = s.mixed_cache.get(("family", subset, tps, mbs))
                if proto is None:
                    proto = s.mixed_cache[("family", subset, tps, mbs)] = Family(s, subset, tps, mbs)
                if not proto.feasible:
                    continue
                slots = tuple(pool[k] // t for k, t in zip(subset, tps, strict=True))
                if s.cluster.num_devices <= COMPLETE_POOL:
                    hi = tuple(min(n, most - (size - 1)) for n in slots)
                    fam = proto.over(pool).with_boxes(1, min(slots), sum(tps), hi)
                    out.append((fam, [(1, min(slots), (1,) * size, hi)]))
                    continue
                # Larger pools: the whole pool, replica counts spread geometrically (not complete; the
                # complete boxes took minutes at 512 devices, their floors too loose there).
                c_lo = max(1, -(-sum(slots) // most))
                boxes, devices = [], math.inf
                for c in _spread(c_lo, min(slots), 8) if c_lo <= min(slots) else ():
                    ns = tuple(n // c for n in slots)
                    if sum(ns) <= most:
                        boxes.append((c, c, ns, ns))
                        devices = min(devices, sum(t * n for t, n in zip(tps, ns, strict=True)))
                if boxes:  # replica counts ascending: the first box has the most stages of each kind
                    out.append((proto.over(pool).with_boxes(boxes[0][0], boxes[-1][1], devices, boxes[0][3]), boxes))
    s.mixed_cache[key] = out
    return out


def _consts(s: Searcher, kind: str, tp: int, mbs: int) -> tuple:
    """(w, e, h, hop, extra) of (kind, tp): the cheapest per-layer forward + backward with or without
    recomputation, the embedding's and the head's extra cost, a hop between two such stages, and
    recomputation's extra per layer."""
    key = ("mixed-consts", kind, tp, mbs)
    hit = s.book.stage_floors.get(key)
    if hit is None:
        variants = [s.book.stage(kind, tp=tp, mbs=mbs, recompute=False), s.book.recompute_floor(kind, tp=tp, mbs=mbs)]
        if not s.config.allow_recompute:
            variants = variants[:1]
        wp = variants[0].fwd_per_layer_s + variants[0].bwd_per_layer_s
        extra = (variants[-1].fwd_per_layer_s + variants[-1].bwd_per_layer_s - wp) if len(variants) > 1 else 0.0
        hit = s.book.stage_floors[key] = (
            min(v.fwd_per_layer_s + v.bwd_per_layer_s for v in variants),
            min(v.emb_fwd_s + v.emb_bwd_s for v in variants), min(v.head_fwd_s + v.head_bwd_s for v in variants),
            _hop(s, Slot(kind, tp), Slot(kind, tp), mbs), extra)
    return hit  # type: ignore[return-value]


def _hop(s: Searcher, a: Slot, b: Slot, mbs: int) -> float:
    key = ("mixed-hop", a, b, mbs)
    hit = s.book.stage_floors.get(key)
    if hit is None:
        job = s.book.job
        numel = mbs * job.seq_len * job.model.hidden_size
        hit = s.book.stage_floors[key] = s.links.hop_s(a, b, numel=numel, nbytes=numel * act_bytes_for(job.precision))
    return hit  # type: ignore[return-value]
