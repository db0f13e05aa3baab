"""A pipeline segment's stages, as the search's floors read them: each recomputation mode's capacity
and cost at a stage's in-flight count (`stage_modes`), and what a run of stages of one kind adds to a
member floor (`segment_terms`, `segment_memory`; bounds.pipe_floor sums them over the segments).
"""

from __future__ import annotations

import math

from hethub.schedules import Schedule
from hethub.search.costs import RECOMPUTE_ORDER, CostBook
from hethub.search.holding import Runs


def in_flights(book: CostBook, sched: Schedule, p: int, hint: int) -> tuple[int, ...]:
    """Each stage's planning_in_flight (what split.split_layers sizes it for) of a p-stage pipeline."""
    key = ("in-flights", sched.name, p, hint)
    hit = book.stage_floors.get(key)
    if hit is None:
        hit = book.stage_floors[key] = tuple(sched.planning_in_flight(stage=s, num_stages=p,
                                                                      expected_micro_batches=hint) for s in range(p))
    return hit  # type: ignore[return-value]


def stage_variants(book: CostBook, kind: str, tp: int, mbs: int) -> list:
    """Every recomputation mode a split may give a stage (none, selective, full: split._options)."""
    key = ("modes", kind, tp, mbs)
    hit = book.stage_floors.get(key)
    if hit is None:
        hit = book.stage_floors[key] = [book.stage(kind, tp=tp, mbs=mbs, recompute=rc) for rc in RECOMPUTE_ORDER]
    return hit  # type: ignore[return-value]


def stage_modes(book: CostBook, kind: str, tp: int, mbs: int, emb: bool, head: bool,
                 in_flight: int) -> tuple[tuple[int, float, float], ...]:
    """(capacity in layers, -1 if not even none fit; cost per layer; base) of one stage position in each
    mode (none first), as split._options prices it; cached (every floor asks the same positions)."""
    key = ("stage-modes", kind, tp, mbs, emb, head, in_flight)
    hit = book.stage_floors.get(key)
    if hit is None:
        n_layers, out = book.job.model.num_layers, []
        for v in stage_variants(book, kind, tp, mbs):
            cap = v.max_layers(emb=emb, head=head, in_flight=in_flight, limit=n_layers)
            w = v.work(emb=emb, head=head)
            out.append((max(cap, -1), w.per_layer, w.base if emb or head else 0.0))
        hit = book.stage_floors[key] = tuple(out)
    return hit  # type: ignore[return-value]


def segment_terms(book: CostBook, kind: str, tp: int, n: int, mbs: int, first: bool, last: bool,
                   n_modes: int) -> tuple[float, float, float, float, float, float]:
    """pipe_floor's time terms of one segment of n stages (the pipeline's first and/or last or
    neither): sum 1 / w_s, sum base_s / w_s, sum base_s, the least w, a middle stage's least one-layer
    work and the least extra recomputation costs per layer (inf: none); cached per segment shape."""
    key = ("segment-terms", kind, tp, n, mbs, first, last, n_modes)
    hit = book.stage_floors.get(key)
    if hit is None:
        variants = stage_variants(book, kind, tp, mbs)[:n_modes]
        mid = min(v.fwd_per_layer_s + v.bwd_per_layer_s for v in variants)
        # The segment's stages by what they hold besides layers: the embedding (first stage of the
        # pipeline), the head (its last), both (one stage), neither (the others).
        if n == 1:
            shapes = [(first, last, 1)]
        else:
            shapes = [(e, h, 1) for e, h in ((first, False), (False, last)) if e or h]
            shapes.append((False, False, n - len(shapes)))
        inv_w = base_over_w = base_sum = 0.0
        w_min = math.inf
        for emb, head, k in shapes:
            if k == 0:
                continue
            costs = [v.work(emb=emb, head=head) for v in variants]
            per_layer, base = min(c.per_layer for c in costs), min(c.base for c in costs)
            inv_w += k / per_layer if per_layer > 0 else math.inf
            base_over_w += k * base / per_layer if per_layer > 0 else 0.0
            base_sum += k * base
            w_min = min(w_min, per_layer)
        wp, *wrs = [v.fwd_per_layer_s + v.bwd_per_layer_s for v in variants]
        wr = min(wrs, default=wp)
        hit = book.stage_floors[key] = (inv_w, base_over_w, base_sum, w_min, mid, wr - wp if wr > wp else math.inf)
    return hit  # type: ignore[return-value]


def segment_memory(book: CostBook, kind: str, tp: int, mbs: int, flights: tuple[int, ...], first: bool, last: bool,
                    n_modes: int, mid: float) -> tuple[list, int, float, float, float, int] | None:
    """pipe_floor's memory terms of one segment whose stages hold `flights` micro-batches (the
    pipeline's first and/or last stage among them or not): its stages grouped by their modes
    (capacity, w, base); the layers they hold without recomputation; its first and last stage's least
    one-layer work and the largest over its stages (0 for the embedding's and the head's stages,
    which may hold none); and the most layers its stages hold in any mode. None where some stage fits
    in no mode. Cached: the orders of one shape, and shapes beside other pure groups, ask the same
    segments at the same positions again. Middle stages whose in-flight counts run down by one (1F1B)
    are read off `_MiddleRuns` in O(runs of equal modes) rather than stage by stage."""
    key = ("segment-memory", kind, tp, mbs, flights, first, last, n_modes)
    hit = book.stage_floors.get(key, ())
    if hit != ():
        return hit  # type: ignore[return-value]
    n = len(flights)
    by_cap: dict[tuple, int] = {}  # stages of the segment by their modes' capacities and bases
    plain = held = 0
    one_first = one_last = one_max = 0.0
    ends = [i for i in (0 if first else -1, n - 1 if last else -1) if i >= 0]  # the embedding's, the head's
    for i in dict.fromkeys(ends):
        modes = stage_modes(book, kind, tp, mbs, first and i == 0, last and i == n - 1, flights[i])[:n_modes]
        top = max(c for c, _, _ in modes)
        if top < 0:
            book.stage_floors[key] = None
            return None
        by_cap[modes] = by_cap.get(modes, 0) + 1
        plain += max(modes[0][0], 0)
        held += top
    lo_i, hi_i = (1 if first else 0), (n - 2 if last else n - 1)  # the middle stages' indices
    if lo_i <= hi_i:
        mids = flights[lo_i:hi_i + 1]
        runs = _middle_runs(book, kind, tp, mbs, n_modes)
        got = (runs.terms(book, mids[-1], mids[0], mid) if mids == tuple(range(mids[0], mids[-1] - 1, -1))
               else runs.terms_of(book, mids, mid))
        if got is None:
            book.stage_floors[key] = None
            return None
        groups, m_plain, m_held, f_first, f_last, m_max = got
        for modes, k in groups:
            by_cap[modes] = by_cap.get(modes, 0) + k
        plain += m_plain
        held += m_held
        one_max = m_max
        if lo_i == 0:
            one_first = f_first
        if hi_i == n - 1:
            one_last = f_last
    out = book.stage_floors[key] = ([(k, modes) for modes, k in by_cap.items()], plain, one_first, one_last, one_max,
                                    held)
    return out


def _middle_runs(book: CostBook, kind: str, tp: int, mbs: int, n_modes: int) -> _MiddleRuns:
    key = ("middle-runs", kind, tp, mbs, n_modes)
    hit = book.stage_floors.get(key)
    if hit is None:
        hit = book.stage_floors[key] = _MiddleRuns(kind, tp, mbs, n_modes)  # type: ignore[assignment]
    return hit  # type: ignore[return-value]


class _MiddleRuns:
    """A middle stage's modes (`stage_modes`, the first n_modes) by in-flight count f = 1, 2, ... as
    `holding.Runs` (each with its best capacity and least one-layer work), and running sums of the
    layers a stage holds without recomputation and in its best mode, so that the stages of a segment
    whose counts run down by one are summed in O(runs). The book it reads is passed in, not kept: the
    book keeps this (no reference cycle)."""

    def __init__(self, kind: str, tp: int, mbs: int, n_modes: int) -> None:
        self.args = (kind, tp, mbs, n_modes)
        self.runs = Runs()  # (modes, best capacity, least one-layer w or None) by f
        self.plain = [0]  # layers held without recomputation by stages of counts 1 .. f
        self.held = [0]  # layers held in the best mode by stages of counts 1 .. f

    def _fill(self, book: CostBook, f_max: int) -> None:
        kind, tp, mbs, n_modes = self.args
        for f in range(self.runs.last + 1, f_max + 1):
            modes = stage_modes(book, kind, tp, mbs, False, False, f)[:n_modes]
            one = [w for c, w, _ in modes if c >= 1]
            top = max(c for c, _, _ in modes)
            self.runs.add((modes, top, min(one) if one else None))
            self.plain.append(self.plain[-1] + max(modes[0][0], 0))
            self.held.append(self.held[-1] + top)

    def terms(self, book: CostBook, lo: int, hi: int, mid: float) -> tuple | None:
        """(groups as (modes, stages), layers held without recomputation, in the best mode, one-layer
        work of the stage at count hi and at lo, the largest one-layer work) of stages holding lo .. hi
        micro-batches (one each); None where one fits in no mode (capacities fall with f: the one at hi)."""
        self._fill(book, hi)
        runs = self.runs
        if runs.value(hi)[1] < 0:
            return None
        groups, one_max = [], 0.0
        for (modes, _, one), k in runs.counts(lo, hi):
            groups.append((modes, k))
            one_max = max(one_max, mid if one is None else one)
        at_hi, at_lo = runs.value(hi)[2], runs.value(lo)[2]
        return (groups, self.plain[hi] - self.plain[lo - 1], self.held[hi] - self.held[lo - 1],
                mid if at_hi is None else at_hi, mid if at_lo is None else at_lo, one_max)

    def terms_of(self, book: CostBook, flights: tuple[int, ...], mid: float) -> tuple | None:
        """`terms` of stages holding these counts, in this order (first's and last's one-layer work)."""
        self._fill(book, max(flights))
        groups, plain, held, ones = {}, 0, 0, []
        for f in flights:
            modes, top, one = self.runs.value(f)
            if top < 0:
                return None
            groups[modes] = groups.get(modes, 0) + 1
            plain += self.plain[f] - self.plain[f - 1]
            held += top
            ones.append(mid if one is None else one)
        return list(groups.items()), plain, held, ones[0], ones[-1], max(ones)
