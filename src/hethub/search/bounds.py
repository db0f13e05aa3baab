"""A closed-form upper bound on a kind-pure template's rate, so hopeless stage counts are not split.

Splitting a template (split.py) and pricing its sync dominate the template scan. Before splitting
(kind, TP, micro-batch size, p stages) we bound the rate it can reach from below-bounding its step:

* work of one micro-batch, W >= L w + emb + head (w: forward + backward of one layer without
  recomputation) plus, for the layers beyond what the stages hold without recomputation (the
  schedule's in-flight bound, e.g. 1F1B stage s holds p - s micro-batches; skipped for a schedule
  whose in-flight count grows with the batch share, GPipe), the extra forward recomputation costs: a
  stage over its no-recompute capacity recomputes all its layers, at the cheaper recomputing mode's
  cost and the larger one's capacity (``costs.RecomputeFloor``);
* the bottleneck stage >= W / p, and >= the smallest B for which whole layers fit under B when
  memory is ignored (integer balance, closed form in `_balanced`);
* T(m) = W + 2 (p - 1) p2p + (m - 1) bottleneck, m = ceil(mb / c) micro-batches on each of the
  c = devices // (p tp) replicas; the sync tail and the update only add to it.

rate <= mb * mbs / (T(m) * c * p * tp). Every term is a lower bound of the one `Searcher.rate`
prices, so a template whose bound is below a rate already found cannot beat that rate.

`pipe_floor` is the same idea for a mixed pipeline's T(m), used to skip splitting candidates that
could not become finalists (hetero._mixed_around).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hethub.predict.memory import act_bytes_for
from hethub.schedules import Schedule, get_schedule
from hethub.search.costs import RECOMPUTE_ORDER, CostBook
from hethub.search.holding import Runs, least_layer_work, smallest_holding
from hethub.search.links import LinkBook
from hethub.search.segments import in_flights, segment_memory, segment_terms, stage_modes
from hethub.search.split import Slot


class Capacity:
    """Layers that p stages of one (kind, TP, micro-batch size) hold in total under the memory of a
    schedule with an in-flight bound (``Schedule.max_in_flight``; 1F1B: stage s of p holds p - s), for
    every p, without recomputation and with the better of both per stage."""

    def __init__(self, book: CostBook, kind: str, *, tp: int, mbs: int, schedule: Schedule) -> None:
        self.models = [book.stage(kind, tp=tp, mbs=mbs, recompute=False), book.recompute_floor(kind, tp=tp, mbs=mbs)]
        self.kind, self.tp, self.mbs = kind, tp, mbs  # not the book: it keeps this (no reference cycle)
        self._runs = Runs()  # a middle stage's modes by in-flight count (_middle_groups)
        # Each stage's in-flight bound by stage count, shared by every (kind, TP, micro-batch size).
        self._in_flights: dict[int, tuple[int, ...]] = book.capacity.setdefault(("in-flight", schedule.name), {})
        self.limit = book.job.model.num_layers
        self.schedule = schedule
        self._totals: dict[tuple[int, int], int] = {}
        self._ats: dict[tuple[int, bool, bool, int], int] = {}
        self._mid: dict[int, dict[int, int]] = {}

    def _at(self, variant: int, *, emb: bool, head: bool, in_flight: int) -> int:
        """Best layer count of one stage: 0 = without recomputation, 1 = the better of both."""
        key = (variant, emb, head, in_flight)
        hit = self._ats.get(key)
        if hit is None:  # totals for every p ask the same few stage shapes again (O(p^2) calls)
            n = self.models[0].max_layers(emb=emb, head=head, in_flight=in_flight, limit=self.limit)
            if variant:
                n = max(n, self.models[1].max_layers(emb=emb, head=head, in_flight=in_flight, limit=self.limit))
            hit = self._ats[key] = max(0, n)
        return hit

    def total(self, p: int, *, variant: int) -> int:
        key = (p, variant)
        if key not in self._totals:
            # O(p) per p: each stage's count is cached in its StageCost (max_layers).
            bounds = self._in_flights.get(p)
            if bounds is None:
                bounds = self._in_flights[p] = tuple(self.schedule.max_in_flight(stage=s, num_stages=p)
                                                     for s in range(p))  # type: ignore[misc]
                assert None not in bounds, "Capacity needs a schedule with an in-flight bound"
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

    def mode_bottleneck(self, book: CostBook, p: int, *, lo: float) -> float | None:
        """The smallest bottleneck B >= lo at which p stages hold the model's L layers, each stage in
        the recomputation mode (none, selective, full: `stage_modes`) that holds the most layers
        within B at the stage's in-flight count (this capacity's schedule), the first and the last
        stage with the embedding's and the head's memory and time (`smallest_holding`, exact per
        stage). The rate bound's other bottleneck floors let a stage's no-recompute capacity stand
        in for another's and price recomputation at the cheapest mode, so where every stage must
        recompute (llama-2-70b at micro-batch 4) they sat ~25 % below the best split's. None: the
        stages cannot hold L layers in any mode."""
        self.total(p, variant=0)  # fills the in-flight bounds of p stages
        bounds = self._in_flights[p]
        if p == 1:
            caps = [(1, stage_modes(book, self.kind, self.tp, self.mbs, True, True, bounds[0]))]
        else:
            caps = [(1, stage_modes(book, self.kind, self.tp, self.mbs, True, False, bounds[0])),
                    (1, stage_modes(book, self.kind, self.tp, self.mbs, False, True, bounds[-1])),
                    *self._middle_groups(book, bounds[1:-1])]
        if any(max(c for c, _, _ in modes) < 0 for _, modes in caps):
            return None  # a stage that fits in no mode: split.split_layers has no split either
        return smallest_holding(caps, self.limit, lo)

    def _middle_groups(self, book: CostBook, flights: tuple[int, ...]) -> list[tuple[int, tuple]]:
        """The middle stages as (count, modes) groups. Under 1F1B their in-flight counts run from p - 2
        down to 2, one stage each, and the modes of long runs of them are equal (capacities level off),
        so they are read off `holding.Runs` of the modes by count."""
        if not flights:
            return []
        if flights == tuple(range(len(flights) + 1, 1, -1)):
            runs = self._runs
            for f in range(runs.last + 1, len(flights) + 2):
                runs.add(stage_modes(book, self.kind, self.tp, self.mbs, False, False, f))
            return [(k, modes) for modes, k in runs.counts(2, len(flights) + 1)]
        groups: dict[tuple, int] = {}
        for f in flights:
            modes = stage_modes(book, self.kind, self.tp, self.mbs, False, False, f)
            groups[modes] = groups.get(modes, 0) + 1
        return [(k, modes) for modes, k in groups.items()]


def capacity(book: CostBook, kind: str, *, tp: int, mbs: int) -> Capacity:
    key = (kind, tp, mbs)
    if key not in book.capacity:
        sched = get_schedule(book.job.schedule, chunks=book.job.chunks)
        if sched.max_in_flight(stage=0, num_stages=1) is None or sched.chunks_per_stage > 1:
            # A schedule without an in-flight bound (GPipe) gets 1F1B's capacity: a full pipeline
            # holds no fewer micro-batches under any schedule, so it is an optimistic floor (where the
            # template scan starts; the rate bound skips its recomputation term for such schedules).
            # So does interleaving, whose bound counts chunks, not whole-stage micro-batches.
            sched = get_schedule("1f1b")
        book.capacity[key] = Capacity(book, kind, tp=tp, mbs=mbs, schedule=sched)
    return book.capacity[key]  # type: ignore[return-value]


def rate_bound(book: CostBook, links: LinkBook, *, kind: str, tp: int, mbs: int, p: int, kind_devices: int,
               global_batch: int, share: float) -> float:
    """Upper bound on `Searcher.rate` of every split of p stages (kind, tp), 0 when none can fit."""
    c = kind_devices // (p * tp)
    key = (kind, tp, mbs, p)
    floor = book.floors.get(key, ())
    if floor == ():
        floor = book.floors[key] = _template_floor(book, links, kind=kind, tp=tp, mbs=mbs, p=p)
    if c < 1 or floor is None:
        return 0.0
    fill, bottleneck = floor
    mb = max(c, round(global_batch // mbs * share))
    return mb * mbs / ((fill + (-(-mb // c) - 1) * bottleneck) * c * p * tp)


def _template_floor(book: CostBook, links: LinkBook, *, kind: str, tp: int, mbs: int,
                    p: int) -> tuple[float, float] | None:
    """(work + 2 (p - 1) p2p, bottleneck) below every split of p stages (kind, tp); None: none fits."""
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
    if get_schedule(job.schedule, chunks=job.chunks).max_in_flight(stage=0, num_stages=p) is not None:
        caps = capacity(book, kind, tp=tp, mbs=mbs)
        cap = caps.total(p, variant=0)
        if cap < n_layers:
            if caps.total(p, variant=1) < n_layers:
                return None  # split.split_layers finds no split either
            work += (n_layers - cap) * (w_rc - w)
    bottleneck = max(work / p, _balanced(n_layers, p, w, e, h))
    if caps is not None:
        held = caps.mode_bottleneck(book, p, lo=bottleneck)
        if held is None:
            return None
        bottleneck = held
        work = max(work, bottleneck)
    numel = mbs * job.seq_len * job.model.hidden_size
    hop = links.hop_s(Slot(kind, tp), Slot(kind, tp), numel=numel, nbytes=numel * act_bytes_for(job.precision))
    fill = get_schedule(job.schedule, chunks=job.chunks).fill_work_floor_s(work_s=work, bottleneck_s=bottleneck)
    return fill + 2 * (p - 1) * hop, bottleneck


def _balanced(n_layers: int, p: int, w: float, e: float, h: float) -> float:
    """Smallest B with sum_s floor((B - base_s) / w) >= n_layers over p stages, the first based at e
    (embedding), the last at h (head), the others at 0: the bottleneck when layers are whole and
    memory is ignored. With B = k w + r (0 <= r < w), the count is p k - ke - kh - [r < re] - [r < rh]
    where e = ke w + re and h = kh w + rh, so B is k w plus one of 0, re, rh."""
    if p == 1 or w <= 0:
        return n_layers * w + e + h
    ke, re = divmod(e, w)
    kh, rh = divmod(h, w)
    k = math.ceil((n_layers + ke + kh) / p)  # the first k whose count reaches n_layers for r near w
    for r in sorted((0.0, re, rh)):
        if p * k - ke - kh - (r < re) - (r < rh) >= n_layers:
            return max(k * w + r, e, h)
    return max(k * w + max(re, rh), e, h)


@dataclass(frozen=True)
class PipeFloor:
    """T_floor(m) = base_s + m per_mb_s <= T(m) of every layer split of some stages; it stands in for
    a PipeCost in combine.allocate, whose makespan only grows with base_s and per_mb_s."""

    base_s: float
    per_mb_s: float

    def time_s(self, m: int) -> float:
        return self.base_s + m * self.per_mb_s


def pipe_floor(book: CostBook, links: LinkBook, segments: tuple[tuple[str, int, int], ...],
               mbs: int, *, memory: bool = True, in_flight_hint: int = 1, recompute: bool = True) -> PipeFloor | None:
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

    ``memory=False`` skips the memory terms: a looser floor in O(segments) rather than O(stages x 16),
    to order many candidates before the tight one is paid for. ``recompute=False``: the floor of the
    splits without any recomputation (split_layers(allow_recompute=False)), none's mode alone.
    """
    job = book.job
    n_layers = job.model.num_layers
    p = sum(n for _, _, n in segments)
    if not segments or p > n_layers + 2:
        return None
    key = (segments, mbs, memory, in_flight_hint, recompute)
    hit = book.pipe_floors.get(key, ())
    if hit != ():
        return hit  # type: ignore[return-value]
    n_modes = len(RECOMPUTE_ORDER) if recompute else 1
    sched = get_schedule(job.schedule, chunks=job.chunks)
    inv_w, base_over_w, base_sum, w_min = 0.0, 0.0, 0.0, math.inf
    caps: list[tuple[int, tuple]] = []  # (stages, their modes: (capacity, w, base) each)
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
        if memory:
            # what split.split_layers sizes each stage for (Searcher.in_flight_hint's hint for GPipe)
            flights = in_flights(book, sched, p, in_flight_hint)[pos:pos + n]
            seg = segment_memory(book, kind, tp, mbs, flights, first, last, n_modes, mid)
            if seg is None:
                book.pipe_floors[key] = None
                return None
            seg_caps, seg_plain, one_first, one_last, seg_one_max, seg_held = seg
            caps += seg_caps
            plain_total += seg_plain
            held += seg_held
        else:  # the pipeline's first and last stages 0, the others `mid`
            one_first = 0.0 if pos == 0 or pos == p - 1 else mid
            one_last = 0.0 if pos + n - 1 in (0, p - 1) else mid
            seg_one_max = mid if n - (pos == 0) - (pos + n == p) > 0 else 0.0
        ends.append((one_first, one_last))
        one_max = max(one_max, seg_one_max)
        pos += n
    if w_min <= 0 or (memory and held < n_layers):
        book.pipe_floors[key] = None
        return None

    # Every B below the continuous balance holds fewer than L layers, so start there.
    balance = max((n_layers + base_over_w) / inv_w, one_max)
    lo = smallest_holding(caps, n_layers, balance) if memory else balance
    if lo is None:  # not reached: the capacities were checked to hold L above
        book.pipe_floors[key] = None
        return None
    bottleneck = lo
    forced = max(0.0, n_layers - plain_total) if memory else 0.0
    work = max(bottleneck, base_sum + n_layers * w_min + (forced * extra_min if forced and extra_min < math.inf
                                                           else 0.0))
    if memory:
        work = max(work, base_sum + least_layer_work(caps, n_layers))
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
            seg = book.stage_floors.get(("segment-hops", kind, tp, n, mbs))
            if seg is None:
                inner = links.pipe_hops((here,) * n, numel=numel, nbytes=nbytes)
                seg = book.stage_floors[("segment-hops", kind, tp, n, mbs)] = (sum(inner), max(inner))
            p2p += seg[0]
            hop_max = max(hop_max, seg[1])
        prev = here
    fill = sched.fill_work_floor_s(work_s=work, bottleneck_s=bottleneck)
    period = sched.period_floor_s(bottleneck_s=bottleneck, work_s=work, p2p_s=p2p, max_hop_s=hop_max,
                                  max_pair_s=pair, stages=p)
    # T(m) >= work + 2 p2p + (m - 1) period (fill_drain_s + m per_micro_batch_s)
    out = PipeFloor(base_s=fill + 2 * p2p - period, per_mb_s=period)
    book.pipe_floors[key] = out
    return out
