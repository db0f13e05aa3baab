"""Closed-form floors: an upper bound on a kind-pure template's rate, so hopeless stage counts are not
split, and the stage and segment floors the mixed search prunes with.

Splitting a template (split.py) and pricing its sync dominate the template scan. Before splitting
(kind, TP, micro-batch size, p stages) we bound the rate it can reach from below-bounding its step:

* work of one micro-batch, W >= L w + emb + head (w: forward + backward of one layer without
  recomputation) plus, for the layers beyond what the stages hold without recomputation (the
  schedule's in-flight bound, e.g. 1F1B stage s holds p - s micro-batches; skipped for a schedule
  whose in-flight count grows with the batch share, GPipe), the extra forward recomputation costs: a
  stage over its no-recompute capacity recomputes all its layers, at the cheaper recomputing mode's
  cost and the larger one's capacity (``costs.RecomputeFloor``);
* the bottleneck stage >= W / p, and >= the smallest B for which whole layers fit under B when
  memory is ignored (integer balance, closed form in `holding.balanced_bottleneck`);
* T(m) = W + 2 (p - 1) p2p + (m - 1) bottleneck, m = ceil(mb / c) micro-batches on each of the
  c = devices // (p tp) replicas; the sync tail and the update only add to it.

rate <= mb * mbs / (T(m) * c * p * tp). Every term is a lower bound of the one `Searcher.rate`
prices, so a template whose bound is below a rate already found cannot beat that rate.

`pipe_floor` is the same idea for a mixed pipeline's T(m), used to skip splitting candidates that
could not become finalists (hetero._mixed_around).
"""

from __future__ import annotations

import itertools
import math

from hethub.memo import reference
from hethub.predict.holding import PipeFloor, Runs, balanced_bottleneck, floor_terms, least_layer_work, smallest_holding
from hethub.predict.memory import act_bytes_for
from hethub.predict.stage_links import LinkBook
from hethub.schedules import Schedule, get_schedule
from hethub.search.split import Cache, CostBook, Slot, StageCost, in_flights

# The floors' caches in each job's CostBook.
_STAGE_MODES: Cache[tuple[tuple[int, float, float], ...]] = Cache("stage-modes", shared=True)
_MODE_WORKS: Cache[tuple[tuple[StageCost, float, float], ...]] = Cache("mode-works", shared=True)
_SEGMENT_TERMS: Cache[tuple[float, float, float, float, float, float]] = Cache("segment-terms", shared=True)
_SEGMENT_MEMORY: Cache[tuple | None] = Cache("segment-memory", shared=True)
_MIDDLE_RUNS: Cache[_MiddleRuns] = Cache("middle-runs", shared=True)
_SEGMENT_HOPS: Cache[tuple[float, float]] = Cache("segment-hops", shared=True)
_IN_FLIGHT_BOUNDS: Cache[dict[int, tuple[int, ...]]] = Cache("in-flight bounds")
_CAPACITY: Cache[Capacity] = Cache("capacity")
_TEMPLATE_FLOORS: Cache[tuple[float, float] | None] = Cache("template floors")
_PIPE_FLOORS: Cache[PipeFloor | None] = Cache("pipe floors")
ALL_MODES = 6  # n_modes for every mode of split._options (at most 3 recomputations x with/without SP)
EXACT, GRID, BLIND = 0, 1, 2  # rate_bound's bounds: the loose ones above the exact one, cheaper in this order


class Capacity:
    """Layers that p stages of one (kind, TP, micro-batch size) hold in total under the memory of a
    schedule with an in-flight bound (``Schedule.max_in_flight``; 1F1B: stage s of p holds p - s), for
    every p, without recomputation and with the better of both per stage."""

    def __init__(self, book: CostBook, kind: str, *, tp: int, mbs: int, schedule: Schedule) -> None:
        self.models = [book.stage(kind, tp=tp, mbs=mbs, recompute=False), book.recompute_floor(kind, tp=tp, mbs=mbs)]
        self.kind, self.tp, self.mbs = kind, tp, mbs  # not the book: it keeps this (no reference cycle)
        # Each stage's in-flight bound by stage count, shared by every (kind, TP, micro-batch size).
        self._in_flights: dict[int, tuple[int, ...]] = book.cache(_IN_FLIGHT_BOUNDS).setdefault(schedule.name, {})
        self.limit = book.job.model.num_layers
        self.schedule = schedule
        self._totals: dict[tuple[int, int, bool], int] = {}
        self._ats: dict[tuple[int, bool, bool, int], int] = {}
        self._mid: dict[int, dict[int, int]] = {}

    def _at(self, variant: int, *, emb: bool, head: bool, in_flight: int) -> int:
        """Best layer count of one stage: 0 = without recomputation, 1 = the better of both."""
        key = (variant, emb, head, in_flight)
        if (hit := self._ats.get(key)) is None:  # totals for every p ask the same few stage shapes again (O(p^2) calls)
            n = self.models[0].max_layers(emb=emb, head=head, in_flight=in_flight, limit=self.limit)
            if variant:
                n = max(n, self.models[1].max_layers(emb=emb, head=head, in_flight=in_flight, limit=self.limit))
            hit = self._ats[key] = max(0, n)
        return hit

    def total(self, p: int, *, variant: int, grid: bool = False) -> int:
        """The layers p stages hold; ``grid``: at least that, each stage at the in-flight count `_grid`
        rounds its own down to (a stage holding more micro-batches holds no more layers), so the loose
        bound solves a few counts per doubling (`StageModel.max_layers`), not every count up to p."""
        key = (p, variant, grid)
        if key not in self._totals:
            # O(p) per p: each stage's count is cached in its StageCost (max_layers).
            bounds = self.in_flights(p)
            if grid:
                bounds = tuple(map(_grid, bounds))
            if p == 1:
                self._totals[key] = self._at(variant, emb=True, head=True, in_flight=bounds[0])
            else:  # the middle stages' counts by in-flight count, filled once (a dict lookup each after)
                mid = self._mid.setdefault(variant, {})
                for f in bounds[1:-1]:
                    if f not in mid:
                        mid[f] = self._at(variant, emb=False, head=False, in_flight=f)
                self._totals[key] = (self._at(variant, emb=True, head=False, in_flight=bounds[0])
                                     + self._at(variant, emb=False, head=True, in_flight=bounds[-1])
                                     + sum(map(mid.__getitem__, bounds[1:-1])))
        return self._totals[key]

    def in_flights(self, p: int) -> tuple[int, ...]:
        """Each of p stages' in-flight bound (cached)."""
        bounds = self._in_flights.get(p)
        if bounds is None:  # capacity() gives every Capacity a schedule with an in-flight bound
            bounds = self._in_flights[p] = tuple(self.schedule.max_in_flight(stage=s, num_stages=p) for s in range(p))
        return bounds

    def mode_bottleneck(self, book: CostBook, p: int, *, lo: float, grid: bool = False) -> float | None:
        """The smallest bottleneck B >= lo at which p stages hold the model's L layers, each stage in
        the recomputation mode (none, selective, full: `stage_modes`) that holds the most layers
        within B at the stage's in-flight count (this capacity's schedule), the first and the last
        stage with the embedding's and the head's memory and time (`segment_memory`'s stages,
        `smallest_holding`: exact per stage): tight where every stage must recompute, which the
        other floors price at the cheapest mode. None: the stages cannot hold L layers in any mode.
        ``grid``: at most that, each stage at `_grid`'s count (as `total`)."""
        # segment_terms' least one-layer work of a middle stage, which depends on no segment shape
        modes = book.modes(self.kind, tp=self.tp, mbs=self.mbs)[:ALL_MODES]
        mid = min(v.fwd_per_layer_s + v.bwd_per_layer_s for v in modes)
        flights = tuple(map(_grid, self.in_flights(p))) if grid else self.in_flights(p)
        seg = segment_memory(book, self.kind, self.tp, self.mbs, flights, True, True, ALL_MODES, mid)
        return None if seg is None else smallest_holding(seg[0], self.limit, lo)


def capacity(book: CostBook, kind: str, *, tp: int, mbs: int) -> Capacity:
    key = (kind, tp, mbs)
    caps = book.cache(_CAPACITY)
    if key not in caps:
        sched = get_schedule(book.job.schedule, chunks=book.job.chunks)
        if sched.max_in_flight(stage=0, num_stages=1) is None or sched.chunks_per_stage > 1:
            # A schedule without an in-flight bound (GPipe) gets 1F1B's capacity: a full pipeline
            # holds no fewer micro-batches under any schedule, so it is an optimistic floor (where the
            # template scan starts; the rate bound skips its recomputation term for such schedules).
            # So does interleaving, whose bound counts chunks, not whole-stage micro-batches.
            sched = get_schedule("1f1b")
        caps[key] = Capacity(book, kind, tp=tp, mbs=mbs, schedule=sched)
    return caps[key]


def rate_bound(book: CostBook, links: LinkBook, *, kind: str, tp: int, mbs: int, p: int, kind_devices: int,
               global_batch: int, share: float, loose: int = EXACT) -> float:
    """Upper bound on `Searcher.rate` of every split of p stages (kind, tp), 0 when none can fit. ``loose``:
    one above it at a fraction of its cost: GRID (each stage's capacity at `_grid`'s in-flight count) or,
    cheaper, BLIND (no memory terms); 1e-9 up: `smallest_holding` may end 1e-12 below its
    start. The bound itself on the reference path (hethub.memo), where lazy orders by it are the plain ones."""
    loose = EXACT if reference() else loose
    c = kind_devices // (p * tp)
    key = (kind, tp, mbs, p, loose)
    floor = book.cache(_TEMPLATE_FLOORS).get(key, ())
    if floor == ():
        floor = book.cache(_TEMPLATE_FLOORS)[key] = _template_floor(book, links, kind=kind, tp=tp, mbs=mbs, p=p,
                                                                    loose=loose)
    if c < 1 or floor is None:
        return 0.0
    fill, bottleneck = floor
    mb = max(c, round(global_batch // mbs * share))
    return mb * mbs / ((fill + (-(-mb // c) - 1) * bottleneck) * c * p * tp) * (1 + 1e-9 if loose else 1)


def _template_floor(book: CostBook, links: LinkBook, *, kind: str, tp: int, mbs: int,
                    p: int, loose: int = EXACT) -> tuple[float, float] | None:
    """(work + 2 (p - 1) p2p, bottleneck) below every split of p stages (kind, tp), ``loose`` below that
    (`rate_bound`'s); None: none fits."""
    job = book.job
    n_layers = job.model.num_layers
    if p > n_layers + 2:
        return None
    plain = book.stage(kind, tp=tp, mbs=mbs, recompute=False)
    rc = book.recompute_floor(kind, tp=tp, mbs=mbs)
    w = plain.fwd_per_layer_s + plain.bwd_per_layer_s
    w_rc = rc.fwd_per_layer_s + rc.bwd_per_layer_s
    e = min(plain.emb_fwd_s + plain.emb_bwd_s, rc.emb_fwd_s + rc.emb_bwd_s)
    h = min(plain.head_fwd_s + plain.head_bwd_s, rc.head_fwd_s + rc.head_bwd_s)
    w, w_rc = min(w, w_rc), max(w, w_rc)
    work = n_layers * w + e + h
    caps = None
    # A schedule whose in-flight count grows with the batch share (GPipe) has no bound here: skip this term.
    sched = get_schedule(job.schedule, chunks=job.chunks)
    if loose != BLIND and sched.max_in_flight(stage=0, num_stages=p) is not None:
        caps = capacity(book, kind, tp=tp, mbs=mbs)
        cap = caps.total(p, variant=0, grid=loose == GRID)
        if cap < n_layers:
            if caps.total(p, variant=1, grid=loose == GRID) < n_layers:
                return None  # split.split_layers finds no split either
            work += (n_layers - cap) * (w_rc - w)
    bottleneck = max(work / p, balanced_bottleneck(n_layers, p, w, e, h))
    if caps is not None:
        held = caps.mode_bottleneck(book, p, lo=bottleneck, grid=loose == GRID)
        if held is None:
            return None
        bottleneck = held
        work = max(work, bottleneck)
    numel = mbs * job.seq_len * job.model.hidden_size
    hop = links.hop_s(Slot(kind, tp), Slot(kind, tp), numel=numel, nbytes=numel * act_bytes_for(job.precision))
    fill = sched.fill_work_floor_s(work_s=work, bottleneck_s=bottleneck)
    return fill + 2 * (p - 1) * hop, bottleneck


def _grid(f: int) -> int:
    """f with all but its three leading bits cleared: four counts per doubling, at most f."""
    drop = max(0, f.bit_length() - 3)
    return f >> drop << drop


def pipe_floor(book: CostBook, links: LinkBook, segments: tuple[tuple[str, int, int], ...],
               mbs: int, *, in_flight_hint: int = 1, recompute: bool = True) -> PipeFloor | None:
    """A floor under any split of these (mixed) stages, without splitting; None if no split can fit.

    ``segments`` are (kind, tp, stages) in pipeline order. Stage s costs at least base_s + k_s w_s for
    k_s layers (the cheaper of with and without recomputation, memory ignored). Under a bottleneck B
    every stage has k_s <= (B - base_s) / w_s, and the k_s sum to L, so
    B >= (L + sum base_s / w_s) / sum 1 / w_s.

    Memory: a stage holds at most cap_v layers in mode v (none, selective, full: each its own
    capacity and cost, as split._options prices them), with its micro-batches in flight as
    split.split_layers sizes it (the schedule's planning_in_flight: 1F1B p - s at position s; GPipe
    the pipeline's ``in_flight_hint``, 1 by default), so a stage's whole layer count under B is at
    most max_v min(cap_v, floor((B - base_v) / w_v)), and B is at least the smallest value where those
    reach L in total (`smallest_holding`; no fit at all: None); per mode it is exact per stage.
    Layers beyond what the stages hold without recomputation are recomputed at least at the smallest
    extra cost per layer. The work of one micro-batch is at least sum base_s + L min w_s (+ that extra),
    and at least B. T(m) = work + 2 sum p2p + (m - 1) B.

    ``recompute=False``: the floor of the splits without any recomputation
    (split_layers(allow_recompute=False)), none's mode alone.
    """
    job = book.job
    n_layers = job.model.num_layers
    p = sum(n for _, _, n in segments)
    if not segments or p > n_layers + 2:
        return None
    key = (segments, mbs, in_flight_hint, recompute)
    hit = book.cache(_PIPE_FLOORS).get(key, ())
    if hit != ():
        return hit
    n_modes = ALL_MODES if recompute else 1
    sched = get_schedule(job.schedule, chunks=job.chunks)
    inv_w, base_over_w, base_sum, w_min = 0.0, 0.0, 0.0, math.inf
    caps: list[tuple[int, tuple]] = []  # (stages, their modes: (capacity, w, base) each)
    pieces: list[tuple[float, int]] = []  # their hull_pieces, segment by segment
    pos, extra_min, plain_total, held = 0, math.inf, 0.0, 0
    # A floor under each stage's work (middle stages hold at least one layer; the embedding's and the
    # head's may hold none): per segment its first and last stage's, and the largest.
    ends: list[tuple[float, float]] = []
    one_max = 0.0
    for kind, tp, n in segments:
        first, last = pos == 0, pos + n == p
        d_inv, d_bow, d_base, seg_w_min, mid, extra = segment_terms(book, kind, tp, n, mbs, first, last, n_modes)
        inv_w += d_inv
        base_over_w += d_bow
        base_sum += d_base
        w_min = min(w_min, seg_w_min)
        extra_min = min(extra_min, extra)
        # what split.split_layers sizes each stage for (Searcher.in_flight_hint's hint for GPipe)
        flights = in_flights(book, sched, p, in_flight_hint)[pos:pos + n]
        seg = segment_memory(book, kind, tp, mbs, flights, first, last, n_modes, mid)
        if seg is None:
            book.cache(_PIPE_FLOORS)[key] = None
            return None
        seg_caps, seg_plain, one_first, one_last, seg_one_max, seg_held, seg_pieces = seg
        caps += seg_caps
        pieces += seg_pieces
        plain_total += seg_plain
        held += seg_held
        ends.append((one_first, one_last))
        one_max = max(one_max, seg_one_max)
        pos += n
    if w_min <= 0 or held < n_layers:
        book.cache(_PIPE_FLOORS)[key] = None
        return None

    # Every B below the continuous balance holds fewer than L layers, so start there.
    balance = max((n_layers + base_over_w) / inv_w, one_max)
    lo = smallest_holding(caps, n_layers, balance)
    if lo is None:  # not reached: the capacities were checked to hold L above
        book.cache(_PIPE_FLOORS)[key] = None
        return None
    bottleneck = lo
    forced = max(0.0, n_layers - plain_total)
    work = max(bottleneck, base_sum + n_layers * w_min + (forced * extra_min if forced and extra_min < math.inf
                                                           else 0.0), base_sum + least_layer_work(pieces, n_layers))
    numel = mbs * job.seq_len * job.model.hidden_size
    # The hops as every split of these stages pays them (split.split_layers prices with pipe_hops,
    # which lays each kind's segment out on its own: one segment's hops depend on it alone).
    nbytes = numel * act_bytes_for(job.precision)
    p2p = hop_max = pair = 0.0
    prev = None
    for i, (kind, tp, n) in enumerate(segments):
        here = Slot(kind, tp)
        if prev is not None:
            h = links.hop_s(prev, here, numel=numel, nbytes=nbytes)
            p2p += h
            hop_max = max(hop_max, h)
            pair = max(pair, (ends[i - 1][1] + ends[i][0] + 2 * h) / 2)
        if n > 1:
            seg = book.cache(_SEGMENT_HOPS).get((kind, tp, n, mbs))
            if seg is None:
                inner = links.pipe_hops((here,) * n, numel=numel, nbytes=nbytes)
                seg = book.cache(_SEGMENT_HOPS)[(kind, tp, n, mbs)] = (sum(inner), max(inner))
            p2p += seg[0]
            hop_max = max(hop_max, seg[1])
        prev = here
    fill = sched.fill_work_floor_s(work_s=work, bottleneck_s=bottleneck)
    period = sched.period_floor_s(bottleneck_s=bottleneck, work_s=work, p2p_s=p2p, max_hop_s=hop_max,
                                  max_pair_s=pair, stages=p)
    # T(m) >= work + 2 p2p + (m - 1) period (fill_drain_s + m per_micro_batch_s)
    out = PipeFloor(base_s=fill + 2 * p2p - period, per_mb_s=period, bottleneck_s=bottleneck)
    book.cache(_PIPE_FLOORS)[key] = out
    return out


# ---- A pipeline segment's stages as the floors read them.
def stage_modes(book: CostBook, kind: str, tp: int, mbs: int, emb: bool, head: bool,
                 in_flight: int) -> tuple[tuple[int, float, float], ...]:
    """(capacity in layers, -1 if not even none fit; cost per layer; base) of one stage position in each
    mode (none first), as split._options prices it; cached (every floor asks the same positions)."""
    key = (kind, tp, mbs, emb, head, in_flight)
    if (hit := book.cache(_STAGE_MODES).get(key)) is None:
        n_layers = book.job.model.num_layers
        hit = book.cache(_STAGE_MODES)[key] = tuple(
            (max(v.max_layers(emb=emb, head=head, in_flight=in_flight, limit=n_layers), -1), w, base)
            for v, w, base in mode_works(book, kind, tp, mbs, emb, head))
    return hit


def mode_works(book: CostBook, kind: str, tp: int, mbs: int, emb: bool,
               head: bool) -> tuple[tuple[StageCost, float, float], ...]:
    """(stage model, cost per layer, base) of one stage position in each mode (none first), whatever
    its in-flight count (`stage_modes`' time terms: the floors read each position at many counts)."""
    key = (kind, tp, mbs, emb, head)
    if (hit := book.cache(_MODE_WORKS).get(key)) is None:
        works = [(v, v.work(emb=emb, head=head)) for v in book.modes(kind, tp=tp, mbs=mbs)]
        hit = book.cache(_MODE_WORKS)[key] = tuple((v, w.per_layer, w.base if emb or head else 0.0)
                                                   for v, w in works)
    return hit


def segment_terms(book: CostBook, kind: str, tp: int, n: int, mbs: int, first: bool, last: bool,
                   n_modes: int) -> tuple[float, float, float, float, float, float]:
    """pipe_floor's time terms of one segment of n stages (the pipeline's first and/or last or
    neither): sum 1 / w_s, sum base_s / w_s, sum base_s, the least w, a middle stage's least one-layer
    work and the least extra recomputation costs per layer (inf: none); cached per segment shape."""
    key = (kind, tp, n, mbs, first, last, n_modes)
    if (hit := book.cache(_SEGMENT_TERMS).get(key)) is None:
        variants = book.modes(kind, tp=tp, mbs=mbs)[:n_modes]
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
        hit = book.cache(_SEGMENT_TERMS)[key] = (inv_w, base_over_w, base_sum, w_min, mid,
                                                 wr - wp if wr > wp else math.inf)
    return hit


def segment_memory(book: CostBook, kind: str, tp: int, mbs: int, flights: tuple[int, ...], first: bool, last: bool,
                    n_modes: int, mid: float) -> tuple[list, int, float, float, float, int, list] | None:
    """pipe_floor's memory terms of one segment whose stages hold `flights` micro-batches (the pipeline's first
    and/or last stage among them or not): its stages grouped by their modes (capacity, w, base); the layers they
    hold without recomputation; its first and last stage's least one-layer work and the largest over its stages
    (0 for the embedding's and the head's stages, which may hold none); the most layers its stages hold in any
    mode; the groups' hull_pieces. None where some stage fits in no mode. Cached: the orders of one shape, and
    shapes beside other pure groups, ask the same segments at the same positions again. Middle stages whose
    in-flight counts run down by one (1F1B) are read off `_MiddleRuns` in O(runs of equal modes)."""
    key = (kind, tp, mbs, flights, first, last, n_modes)
    hit = book.cache(_SEGMENT_MEMORY).get(key, ())
    if hit != ():
        return hit
    n = len(flights)
    by_cap: dict[tuple, int] = {}  # stages of the segment by their modes' capacities and bases
    plain = held = 0
    one_first = one_last = one_max = 0.0
    ends = [i for i in (0 if first else -1, n - 1 if last else -1) if i >= 0]  # the embedding's, the head's
    for i in dict.fromkeys(ends):
        modes = stage_modes(book, kind, tp, mbs, first and i == 0, last and i == n - 1, flights[i])[:n_modes]
        top = max(c for c, _, _ in modes)
        if top < 0:
            book.cache(_SEGMENT_MEMORY)[key] = None
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
            book.cache(_SEGMENT_MEMORY)[key] = None
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
    groups, pieces = floor_terms([(k, modes) for modes, k in by_cap.items()])
    out = book.cache(_SEGMENT_MEMORY)[key] = (groups, plain, one_first, one_last, one_max, held, pieces)
    return out


def _middle_runs(book: CostBook, kind: str, tp: int, mbs: int, n_modes: int) -> _MiddleRuns:
    runs, key = book.cache(_MIDDLE_RUNS), (kind, tp, mbs, n_modes)
    return runs.get(key) or runs.setdefault(key, _MiddleRuns(kind, tp, mbs, n_modes))


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
        """`terms` of stages holding these counts, in this order (first's and last's one-layer work), per
        run of equal counts (ZB-H1: every stage holds p; GRID's rounded counts), each count's modes read
        alone (`stage_modes`): the counts between, which `terms` fills, are not solved for them."""
        kind, tp, mbs, n_modes = self.args
        groups, plain, held, ones = {}, 0, 0, []
        for f, run in itertools.groupby(flights):
            k = sum(1 for _ in run)
            modes = stage_modes(book, kind, tp, mbs, False, False, f)[:n_modes]
            one = [w for c, w, _ in modes if c >= 1]
            top = max(c for c, _, _ in modes)
            if top < 0:
                return None
            groups[modes] = groups.get(modes, 0) + k
            plain += k * max(modes[0][0], 0)
            held += k * top
            ones.append(min(one) if one else mid)
        return list(groups.items()), plain, held, ones[0], ones[-1], max(ones)
