"""A closed-form upper bound on a kind-pure template's rate, so hopeless stage counts are not split.

Splitting a template (split.py) and pricing its sync dominate the template scan. Before splitting
(kind, TP, micro-batch size, p stages) we bound the rate it can reach from below-bounding its step:

* work of one micro-batch, W >= L w + emb + head (w: forward + backward of one layer without
  recomputation) plus, for the layers beyond what the stages hold without recomputation (the
  schedule's in-flight bound, e.g. 1F1B stage s holds p - s micro-batches; skipped for a schedule
  whose in-flight count grows with the batch share, GPipe), the extra forward recomputation costs: a
  stage over its no-recompute capacity recomputes all its layers;
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

import itertools
import math
from dataclasses import dataclass

from hethub.predict.memory import act_bytes_for
from hethub.schedules import Schedule, get_schedule
from hethub.search.costs import CostBook
from hethub.search.links import LinkBook
from hethub.search.split import Slot


class Capacity:
    """Layers that p stages of one (kind, TP, micro-batch size) hold in total under the memory of a
    schedule with an in-flight bound (``Schedule.max_in_flight``; 1F1B: stage s of p holds p - s), for
    every p, without recomputation and with the better of both per stage."""

    def __init__(self, book: CostBook, kind: str, *, tp: int, mbs: int, schedule: Schedule) -> None:
        self.models = [book.stage(kind, tp=tp, mbs=mbs, recompute=rc) for rc in (False, True)]
        self.limit = book.job.model.num_layers
        self.schedule = schedule
        self._totals: dict[tuple[int, int], int] = {}

    def _at(self, variant: int, *, emb: bool, head: bool, in_flight: int) -> int:
        """Best layer count of one stage: 0 = without recomputation, 1 = the better of both."""
        n = self.models[0].max_layers(emb=emb, head=head, in_flight=in_flight, limit=self.limit)
        if variant:
            n = max(n, self.models[1].max_layers(emb=emb, head=head, in_flight=in_flight, limit=self.limit))
        return max(0, n)

    def total(self, p: int, *, variant: int) -> int:
        key = (p, variant)
        if key not in self._totals:
            # O(p) per p: each stage's count is cached in its StageCost (max_layers).
            total = 0
            for s in range(p):
                in_flight = self.schedule.max_in_flight(stage=s, num_stages=p)
                assert in_flight is not None, "Capacity needs a schedule with an in-flight bound"
                total += self._at(variant, emb=s == 0, head=s == p - 1, in_flight=in_flight)
            self._totals[key] = total
        return self._totals[key]


def capacity(book: CostBook, kind: str, *, tp: int, mbs: int) -> Capacity:
    key = (kind, tp, mbs)
    if key not in book.capacity:
        sched = get_schedule(book.job.schedule)
        if sched.max_in_flight(stage=0, num_stages=1) is None:
            # A schedule without an in-flight bound (GPipe) gets 1F1B's capacity: a full pipeline
            # holds no fewer micro-batches under any schedule, so it is an optimistic floor (where the
            # template scan starts; the rate bound skips its recomputation term for such schedules).
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
    rc = book.stage(kind, tp=tp, mbs=mbs, recompute=True)
    w = plain.fwd_per_layer_s + plain.bwd_per_layer_s
    w_rc = rc.fwd_per_layer_s + rc.bwd_per_layer_s
    e = min(plain.emb_fwd_s + plain.emb_bwd_s, rc.emb_fwd_s + rc.emb_bwd_s)
    h = min(plain.head_fwd_s + plain.head_bwd_s, rc.head_fwd_s + rc.head_bwd_s)
    w, w_rc = min(w, w_rc), max(w, w_rc)
    work = n_layers * w + e + h
    # A schedule whose in-flight count grows with the batch share (GPipe) has no bound here: skip this term.
    if get_schedule(job.schedule).max_in_flight(stage=0, num_stages=p) is not None:
        caps = capacity(book, kind, tp=tp, mbs=mbs)
        cap = caps.total(p, variant=0)
        if cap < n_layers:
            if caps.total(p, variant=1) < n_layers:
                return None  # split.split_layers finds no split either
            work += (n_layers - cap) * (w_rc - w)
    bottleneck = max(work / p, _balanced(n_layers, p, w, e, h))
    act = mbs * job.seq_len * job.model.hidden_size * act_bytes_for(job.precision)
    link = links.p2p(Slot(kind, tp), Slot(kind, tp))
    return work + 2 * (p - 1) * (link.latency_s + act / link.bw_bytes_per_s), bottleneck


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


def pipe_floor(book: CostBook, links: LinkBook, slots: tuple[Slot, ...], mbs: int) -> PipeFloor | None:
    """A floor under any split of these (mixed) stages, without splitting; None if there is none.

    Stage s costs at least base_s + k_s w_s for k_s layers (the cheaper of with and without
    recomputation, memory ignored). Under a bottleneck B every stage has k_s <= (B - base_s) / w_s,
    and the k_s sum to L, so B >= (L + sum base_s / w_s) / sum 1 / w_s; the work of one micro-batch
    is at least sum base_s + L min w_s, and at least B. T(m) = work + 2 sum p2p + (m - 1) B.
    """
    job = book.job
    n_layers, p = job.model.num_layers, len(slots)
    if not slots or p > n_layers + 2:
        return None
    ws, bases = [], []
    for s, slot in enumerate(slots):
        key = (slot.kind, slot.tp, mbs, s == 0, s == p - 1)
        cost = book.stage_floors.get(key)
        if cost is None:
            costs = [book.stage(slot.kind, tp=slot.tp, mbs=mbs, recompute=rc).work(emb=s == 0, head=s == p - 1)
                     for rc in (False, True)]
            cost = book.stage_floors[key] = (min(c.per_layer for c in costs), min(c.base for c in costs))
        ws.append(cost[0])
        bases.append(cost[1])
    if min(ws) <= 0:
        return None
    bottleneck = max(max(bases), (n_layers + sum(b / w for b, w in zip(bases, ws, strict=True)))
                     / sum(1 / w for w in ws))
    work = max(bottleneck, sum(bases) + n_layers * min(ws))
    act = mbs * job.seq_len * job.model.hidden_size * act_bytes_for(job.precision)
    p2p = 0.0
    for a, b in itertools.pairwise(slots):
        link = links.p2p(a, b)
        p2p += link.latency_s + act / link.bw_bytes_per_s
    return PipeFloor(base_s=work + 2 * p2p - bottleneck, per_mb_s=bottleneck)
