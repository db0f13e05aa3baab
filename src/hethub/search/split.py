"""One pipeline: which stage shapes in which order, and how many layers each stage gets.

Decoder layers are identical, so a split is just a layer count per stage. We minimise the bottleneck
stage (forward + backward of one micro-batch), which is what the steady state runs at, subject to each
stage's memory at its position (the schedule's in-flight rule, ``hethub.schedules``; 1F1B stage s of
p holds p - s micro-batches): each stage's cost, in the cheapest recomputation mode that holds its
layers, is nondecreasing in its layer count, so giving the next layer to the stage whose cost grows
least minimises the bottleneck exactly, in O(L log p) instead of a partition DP's O(p L^2).

Also the search's caches over the predictor's stage cost model per job (``CostBook``).
"""

from __future__ import annotations

import functools
import heapq
import math
from dataclasses import dataclass
from typing import Any, Generic, NamedTuple, Protocol, TypeVar

from hethub.memo import Kept, reference
from hethub.plan import Recompute
from hethub.predict.memory import DEFAULT_MEM_HEADROOM, usable_bytes
from hethub.predict.profiles import ProfileSet
from hethub.predict.seq_parallel import sp_applies
from hethub.predict.stage_cost import Affine, StageJob, StageModel
from hethub.predict.stage_cost import ModesFloor as RecomputeFloor
from hethub.predict.stage_links import Slot
from hethub.predict.stage_modes import RECOMPUTE_ORDER
from hethub.runtimes import DEFAULT_RUNTIME
from hethub.schedules import Schedule, get_schedule
from hethub.spec.cluster import Cluster
from hethub.spec.model import ModelSpec


class PipeHops(Protocol):
    """One micro-batch's activations from each stage to the next (search.links.LinkBook.pipe_hops)."""

    def __call__(self, slots: tuple[Slot, ...], *, numel: int, nbytes: float) -> tuple[float, ...]: ...


@dataclass(frozen=True)
class PipeCost:
    """A pipeline template with its layer split and closed-form times (devices not chosen yet)."""

    slots: tuple[Slot, ...]
    mbs: int
    layers: tuple[int, ...]
    recompute: tuple[Recompute, ...]
    fwd_s: tuple[float, ...]
    bwd_s: tuple[float, ...]
    update_s: tuple[float, ...]
    p2p_s: tuple[float, ...]
    params: tuple[float, ...]  # parameters held by one device of each stage
    schedule: str
    chunks: int = 1  # model chunks per stage (interleaved schedule)
    sp: tuple[bool, ...] = ()  # sequence parallelism per stage (empty: none)

    @functools.cached_property
    def num_devices(self) -> int:
        return sum(s.tp for s in self.slots)

    @functools.cached_property
    def kinds(self) -> frozenset[str]:
        return frozenset(s.kind for s in self.slots)

    @functools.cached_property
    def per_mb_s(self) -> float:
        return self._sched.period_s(fwd_s=self.fwd_s, bwd_s=self.bwd_s, p2p_s=self.p2p_s)

    @functools.cached_property
    def base_s(self) -> float:
        """T(m) = base_s + m * per_mb_s: fill and drain of the pipeline plus the steady state."""
        return self._sched.fill_drain_s(fwd_s=self.fwd_s, bwd_s=self.bwd_s, p2p_s=self.p2p_s,
                                        per_micro_batch_s=self.per_mb_s)

    def stage_finish_s(self, step_s: float) -> list[float]:
        """Each stage's finish when stage 0 finishes at ``step_s`` (the schedule's; its last ops ripple up)."""
        return self._sched.stage_finish_s(step_s=step_s, bwd_s=self.bwd_s, p2p_s=self.p2p_s)

    @functools.cached_property
    def _sched(self) -> Schedule:
        return get_schedule(self.schedule, chunks=self.chunks)

    def time_s(self, m: int) -> float:
        return self.base_s + m * self.per_mb_s

    def devices_by_kind(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for s in self.slots:
            out[s.kind] = out.get(s.kind, 0) + s.tp
        return out


class _Option(NamedTuple):  # a tuple: the greedy unpacks it in its inner loop
    base: float
    per_layer: float
    max_layers: int
    sm: StageCost


@dataclass(frozen=True)
class LayerSplits:
    """A pipeline's layer splits before they are priced: each stage's options and each split's layer
    counts (`split_layers` prices them all). A split's boundaries are known here, so a search can floor
    its step by them (search/sync_floors.SyncFloors.split_floor) and price only the splits it needs."""

    slots: tuple[Slot, ...]
    opts: tuple[list[_Option], ...]
    counts: tuple[tuple[int, ...], ...]  # one per split, in split_layers' order (none: the model cannot fit)
    plain_upto: tuple[int, ...] = ()  # per stage, `_Position.plain_upto` (empty: none known)

    def recomputes(self) -> bool:
        """Whether some split recomputes on some stage (its cheapest option holding its layers); a stage
        holding at most its plain_upto layers does not, so its options are not walked (but on the reference path)."""
        ups = (-1,) * len(self.opts) if reference() or not self.plain_upto else self.plain_upto
        return any(k > up and _cheapest(ops, k).sm.recompute for c in self.counts
                   for ops, k, up in zip(self.opts, c, ups, strict=True))


def split_layers(book: CostBook, slots: tuple[Slot, ...], *, mbs: int, allow_recompute: bool,
                 hops: PipeHops, in_flight_hint: int = 1, slacks: tuple[float, ...] = (1.0,)) -> list[PipeCost]:
    """Good layer splits for these stages (one per bottleneck slack), or [] when the model cannot fit."""
    return price_splits(book, layer_splits(book, slots, mbs=mbs, allow_recompute=allow_recompute,
                                           in_flight_hint=in_flight_hint, slacks=slacks), mbs=mbs, hops=hops)


def price_splits(book: CostBook, splits: LayerSplits, *, mbs: int, hops: PipeHops) -> list[PipeCost]:
    """Each split of `layer_splits`, priced."""
    job = book.job
    return [_price(job_model=job.model, slots=splits.slots, opts=list(splits.opts), counts=list(c), mbs=mbs,
                   hops=hops, schedule=job.schedule, chunks=job.chunks) for c in splits.counts]


def layer_splits(book: CostBook, slots: tuple[Slot, ...], *, mbs: int, allow_recompute: bool,
                 in_flight_hint: int = 1, slacks: tuple[float, ...] = (1.0,)) -> LayerSplits:
    """`split_layers`' layer counts, unpriced (kept per book): per slack the least sum of stage costs
    within it of the least bottleneck, then (slack 1, where it differs) the min-max split itself."""
    key = (slots, mbs, allow_recompute, in_flight_hint, slacks)
    if (hit := book.cache(_LAYER_SPLITS).get(key)) is None:
        hit = book.cache(_LAYER_SPLITS)[key] = _layer_splits(book, slots, mbs=mbs, allow_recompute=allow_recompute,
                                                             in_flight_hint=in_flight_hint, slacks=slacks)
    return hit


def _layer_splits(book: CostBook, slots: tuple[Slot, ...], *, mbs: int, allow_recompute: bool, in_flight_hint: int,
                  slacks: tuple[float, ...]) -> LayerSplits:
    job = book.job
    model: ModelSpec = job.model
    n_layers, p = model.num_layers, len(slots)
    if p > n_layers + 2:
        return LayerSplits(slots, (), ())
    opts: list[list[_Option]] = []
    lows: list[int] = []
    costs: list[tuple[float, ...]] = []
    ups: list[int] = []
    flights = in_flights(book, get_schedule(job.schedule, chunks=job.chunks), p, in_flight_hint)
    positions, most = book.cache(_POSITIONS), 0
    for s, (slot, in_flight) in enumerate(zip(slots, flights, strict=True)):
        emb, head = s == 0, s == p - 1
        low = 0 if p > 1 and (emb or head) else 1
        if p == 1:
            low = n_layers
        key = (slot, mbs, emb, head, in_flight, low, allow_recompute)
        if (at := positions.get(key)) is None:
            here = _options(book, slot, mbs=mbs, emb=emb, head=head, in_flight=in_flight, low=low,
                            allow_recompute=allow_recompute)
            most_here = max((o.max_layers for o in here), default=-1)
            at = positions[key] = _Position(here, most_here, (*map(functools.partial(_cost, here), range(
                max(most_here, low) + 2)), *(math.inf,) * (n_layers - most_here)), _plain_upto(here))
        if not at.opts:
            return LayerSplits(slots, (), ())
        opts.append(at.opts)
        ups.append(at.plain_upto)
        lows.append(low)
        costs.append(at.costs)
        most += at.most
    if most < n_layers:
        return LayerSplits(slots, (), ())

    # Give layers one at a time to the stage whose cost grows least: each stage's cost (cheapest option
    # that still fits) is nondecreasing in its layer count, so this greedy minimises the bottleneck.
    counts, bottleneck = _greedy(costs, lows, n_layers, marginal=False, cap=math.inf)
    if counts is None:
        return LayerSplits(slots, tuple(opts), ())
    # Among splits within (a slack on) that bottleneck, minimise the sum of stage times: it is the
    # pipeline's fill and drain, which weighs as much as the bottleneck when micro-batches are few.
    # Equal counts are one split (the same options, so the same recomputation).
    out: list[tuple[int, ...]] = []
    for slack in slacks:
        cand = _greedy(costs, lows, n_layers, marginal=True, cap=bottleneck * slack * (1 + 1e-12))[0]
        for c in ([cand] if cand else []) + ([counts] if slack == 1.0 and cand != counts and not out else []):
            if tuple(c) not in out:
                out.append(tuple(c))
    return LayerSplits(slots, tuple(opts), tuple(out), tuple(ups))


@dataclass(frozen=True)
class _Position:
    """One stage position's options (`_options`), the most layers any holds and its cost (`_cost`) at each layer
    count 0 .. L + 1 (inf where none holds them), which the greedy reads (kept: templates share positions)."""

    opts: list[_Option]
    most: int
    costs: tuple[float, ...]
    plain_upto: int  # `_plain_upto`'s


def _plain_upto(opts: list[_Option]) -> int:
    """The most layers a plain option (no recomputation) holds at no more base and cost per layer than any
    recomputing one (-1: none): up to that `_cheapest` (first of equal costs; plain modes first) never recomputes."""
    rc = [o for o in opts if o.sm.recompute]
    return max((o.max_layers for o in opts if not o.sm.recompute and all(
        o.base <= r.base and o.per_layer <= r.per_layer for r in rc)), default=-1)


def _greedy(costs: list[tuple[float, ...]], lows: list[int], n_layers: int, *, marginal: bool,
            cap: float) -> tuple[list[int] | None, float]:
    """Add layers one at a time to the stage with the smallest key whose cost stays within cap; the counts (None
    where the layers do not fit) and the most costly stage's cost. The key of a stage at k layers is
    (cost(k + 1), -cost(k)) (the bottleneck), or with `marginal` (cost(k + 1) - cost(k), 0) (the sum); `costs`:
    each stage's cost by layer count (`_Position.costs`), from its low. The search's hottest loop: heap entries
    carry cost(k + 1), the next entry's cost(k). A stage is in the heap once, so its key (with the stage's index)
    never ties: the order popped is the keys' alone, and popping then pushing may be one heapreplace."""
    counts = list(lows)
    heap = [(cs[k + 1] - cs[k], 0.0, s, cs[k + 1]) if marginal else (cs[k + 1], -cs[k], s, cs[k + 1])
            for s, (cs, k) in enumerate(zip(costs, lows, strict=True)) if cs[k + 1] <= cap]
    heapq.heapify(heap)
    pop, replace, inf = heapq.heappop, heapq.heapreplace, math.inf
    for _ in range(n_layers - sum(counts)):
        if not heap:
            return None, inf
        _, _, s, cur = heap[0]
        k = counts[s] = counts[s] + 1
        nxt = costs[s][k + 1]
        if nxt <= cap:
            replace(heap, (nxt - cur, 0.0, s, nxt) if marginal else (nxt, -cur, s, nxt))
        else:
            pop(heap)
    return counts, max(cs[k] for cs, k in zip(costs, counts, strict=True))


def in_flights(book: CostBook, sched: Schedule, p: int, hint: int) -> tuple[int, ...]:
    """Each stage's planning_in_flight (what `split_layers` sizes it for) of a p-stage pipeline."""
    key = (sched.name, p, hint)
    if (hit := book.cache(_PLANNING_IN_FLIGHTS).get(key)) is None:
        hit = book.cache(_PLANNING_IN_FLIGHTS)[key] = tuple(sched.planning_in_flight(stage=s, num_stages=p,
                                                                      expected_micro_batches=hint) for s in range(p))
    return hit


def fixed_split(book: CostBook, slots: tuple[Slot, ...], counts: tuple[int, ...], *, mbs: int,
                allow_recompute: bool, hops: PipeHops, in_flight_hint: int = 1) -> PipeCost | None:
    """Price these stages with a given layer split (recomputing where needed), or None if it cannot fit."""
    job, p = book.job, len(slots)
    sched = get_schedule(job.schedule, chunks=job.chunks)
    opts = []
    for s, (slot, k) in enumerate(zip(slots, counts, strict=True)):
        in_flight = sched.planning_in_flight(stage=s, num_stages=p, expected_micro_batches=in_flight_hint)
        ops = [o for o in _options(book, slot, mbs=mbs, emb=s == 0, head=s == p - 1, in_flight=in_flight, low=0,
                                   allow_recompute=allow_recompute) if o.max_layers >= k]
        if not ops:
            return None
        opts.append(ops)
    return _price(job_model=job.model, slots=slots, opts=opts, counts=list(counts), mbs=mbs, hops=hops,
                  schedule=job.schedule, chunks=job.chunks)


def _options(book: CostBook, slot: Slot, *, mbs: int, emb: bool, head: bool, in_flight: int, low: int,
             allow_recompute: bool) -> list[_Option]:
    """Each stage mode (recomputation none, selective, full; with or without sequence parallelism, where
    ``allow_recompute`` lets the stage trade time for memory) where it fits and no other mode holds as
    many layers at no more cost; cached (templates share stage positions). Selective is an option of
    the split itself, not only of the laid-out plan (layout_assemble.py): a stage that fits only with
    selective would otherwise be priced with full recomputation and its template could rank out of the
    finalists (test_space's first case)."""
    key = (slot.kind, slot.tp, mbs, emb, head, in_flight, low, allow_recompute)
    here = book.options.get(key)
    if here is None:
        n_layers = book.job.model.num_layers
        found: list[_Option] = []
        for sm in book.modes(slot.kind, tp=slot.tp, mbs=mbs, allow_recompute=allow_recompute):
            u = sm.max_layers(emb=emb, head=head, in_flight=in_flight, limit=n_layers)
            if u >= low:
                w = sm.work(emb=emb, head=head)
                found.append(_Option(w.base, w.per_layer, u, sm))
        # Without the modes another holds as many layers at no more cost (of equals, the earlier mode).
        here = book.options[key] = [o for i, o in enumerate(found) if not any(
            q.max_layers >= o.max_layers and q.base <= o.base and q.per_layer <= o.per_layer
            and (j < i or q[:3] != o[:3]) for j, q in enumerate(found) if j != i)]
    return here


def _cost(ops: list[_Option], k: int) -> float:
    best = math.inf
    for base, per_layer, most, _sm in ops:  # at most three options: a plain loop is the hot path of the search
        if most >= k:
            c = base + k * per_layer
            if c < best:
                best = c
    return best


def _cheapest(ops: list[_Option], k: int) -> _Option:
    """The first option of least cost holding k layers (a plain loop, as `_cost`: once per stage priced)."""
    best, got = math.inf, None
    for o in ops:
        if o.max_layers >= k and (c := o.base + k * o.per_layer) < best:
            best, got = c, o
    assert got is not None, "no option holds the layers"
    return got


def _price(*, job_model: ModelSpec, slots: tuple[Slot, ...], opts: list[list[_Option]], counts: list[int],
           mbs: int, hops: PipeHops, schedule: str, chunks: int) -> PipeCost:
    models = [_cheapest(ops, k).sm for ops, k in zip(opts, counts, strict=True)]
    return price(models, counts, model=job_model, slots=slots, mbs=mbs, hops=hops, schedule=schedule, chunks=chunks)


def price(models: list[StageCost], counts: list[int], *, model: ModelSpec, slots: tuple[Slot, ...], mbs: int,
          hops: PipeHops, schedule: str, chunks: int = 1) -> PipeCost:
    """Closed-form costs of a pipeline whose stage models and layer counts are given: each stage's
    times and parameters exactly as the predictor has them (StageModel.step)."""
    p = len(slots)
    # (forward, backward, update, parameters) per stage, kept per (stage model, layers, position).
    fwd, bwd, upd, params = zip(*[_TERMS.get((sm, k, s == 0, s == p - 1), lambda sm=sm, k=k, s=s: (
        (st := sm.step(k, emb=s == 0, head=s == p - 1)).fwd_s, st.bwd_s, st.times.update_s,
        sm.params(k, emb=s == 0, head=s == p - 1))) for s, (sm, k) in enumerate(zip(models, counts, strict=True))],
                                  strict=True)
    job = models[0].job
    p2p = hops(slots, numel=job.hop_numel(mbs), nbytes=job.hop_bytes(mbs))
    sp = tuple(sm.sp for sm in models)
    return PipeCost(slots=slots, mbs=mbs, layers=tuple(counts), recompute=tuple(sm.recompute for sm in models),
                    fwd_s=fwd, bwd_s=bwd, update_s=upd, p2p_s=p2p, params=params, schedule=schedule, chunks=chunks,
                    sp=sp if any(sp) else ())


_TERMS = Kept(1 << 16, shortcut=True)
_STAGES = Kept(1 << 14, shortcut=True)  # CostBook.stage's models of equal jobs, shared between books


# ---- The search's stage costs: caches over the predictor's stage cost model (predict/stage_cost.py).
__all__ = ["RECOMPUTE_ORDER", "Affine", "CostBook", "Job", "RecomputeFloor", "StageCost", "recompute_options"]

StageCost = StageModel


def recompute_options(allow_recompute: bool) -> tuple[Recompute, ...]:
    """The modes a stage may take once the layout is fixed (polish, baselines): all, or only ``none``."""
    return RECOMPUTE_ORDER if allow_recompute else (Recompute.NONE,)


@dataclass(frozen=True)
class Job:
    """What every stage cost of one search depends on besides the stage itself."""

    model: ModelSpec
    seq_len: int
    precision: str
    schedule: str
    profiles: ProfileSet | None = None
    chunks: int = 1  # model chunks per stage the schedule runs (interleaved: v)
    relax_memory: bool = False  # the upper bound prices kinds that cannot hold the model
    mem_headroom: float = DEFAULT_MEM_HEADROOM  # share of each device's memory plans leave free
    # Sharded: each stage keeps AdamW state (ZeRO-2: and gradients; 3: and parameters) for 1/holders
    # of its parameters (an assumption the predictor checks on the finalists with the plan's real
    # holders); 1: unsharded.
    optimizer_shard_holders: int = 1
    zero_stage: int = 1
    sequence_parallel: bool = True  # offered as a stage mode where it applies (CostBook.modes)
    runtime: str = DEFAULT_RUNTIME  # what the plan is for (hethub.runtimes): the modes it runs


V = TypeVar("V")


class Cache(Generic[V]):
    """One named, typed cache of a CostBook, declared once by the module that fills it
    (``CAPACITY: Cache[Capacity] = Cache("capacity")``, read as ``book.cache(CAPACITY)``). ``shared``: its
    entries depend on the stage models alone (`CostBook.modes`, the links), not the schedule, so books of
    equal stage models (the enumerations' ZB-H1 and 1F1B) share one (off the reference path, hethub.memo)."""

    __slots__ = ("name", "shared")

    def __init__(self, name: str, *, shared: bool = False) -> None:
        self.name, self.shared = name, shared

    def __repr__(self) -> str:
        return f"Cache({self.name!r})"


_SHARED = Kept(1 << 10, shortcut=True)  # the shared Caches (Cache.shared) of equal stage models
_OPTIONS: Cache[list[_Option]] = Cache("options", shared=True)
_RECOMPUTE_FLOORS: Cache[RecomputeFloor] = Cache("recompute floors", shared=True)
_LAYER_SPLITS: Cache[LayerSplits] = Cache("layer-splits")  # layer_splits', by its arguments
_PLANNING_IN_FLIGHTS: Cache[tuple[int, ...]] = Cache("in-flights")
_POSITIONS: Cache[_Position] = Cache("positions", shared=True)  # layer_splits', by stage position


class CostBook:
    """StageCosts by shape, and layer splits by template: built once per job, shared by searches."""

    def __init__(self, job: Job, cluster: Cluster) -> None:
        self.job, self.kinds = job, cluster.kinds
        self.stage_job = StageJob.planned(model=job.model, cluster=cluster, seq_len=job.seq_len,
                                          precision=job.precision, profiles=job.profiles, runtime=job.runtime)
        self._pins = (job.model, cluster, job.profiles)  # what StageJob.planned reads, by id in _STAGES' keys
        self._job_key = (*map(id, self._pins), job.seq_len, job.precision, job.runtime)
        self._cache: dict[tuple[str, int, int, Recompute, bool], StageModel] = {}
        self.splits: dict[tuple, list[PipeCost]] = {}  # by (slots, micro-batch size[, recompute])
        self.fixed: dict[tuple, PipeCost | None] = {}  # given layer counts, by (slots, micro-batch size, counts)
        self.solo: dict[tuple[int, int], tuple[PipeCost, float]] = {}  # (id(pipe), replicas) -> (pipe, sync tail)
        self._caches: dict[Cache[Any], dict[Any, Any]] = {}  # the floors' (bounds.py, mixed.py, sync_floors.py)
        self._models_key = (*self._job_key, job.relax_memory, job.mem_headroom, job.optimizer_shard_holders,
                            job.zero_stage, job.sequence_parallel)  # all CostBook.modes reads
        self.options: dict[tuple, list[_Option]] = self.cache(_OPTIONS)  # split._options
        self.recompute_floors: dict[tuple[str, int, int], RecomputeFloor] = self.cache(_RECOMPUTE_FLOORS)

    def cache(self, which: Cache[V]) -> dict[Any, V]:
        """The cache ``which`` of this book (empty at first)."""
        if (hit := self._caches.get(which)) is None:
            hit = self._caches[which] = _SHARED.get((*self._models_key, which.name), dict, pin=self._pins) \
                if which.shared else {}
        return hit

    def recompute_floor(self, kind: str, *, tp: int, mbs: int) -> RecomputeFloor:
        """The floors' stand-in for every recomputing mode of one stage shape (see RecomputeFloor)."""
        key = (kind, tp, mbs)
        return self.recompute_floors.get(key) or self.recompute_floors.setdefault(
            key, RecomputeFloor(*self.modes(kind, tp=tp, mbs=mbs)[1:]))

    def modes(self, kind: str, *, tp: int, mbs: int, allow_recompute: bool = True) -> list[StageCost]:
        """Every mode a split may give a stage of this shape, plain ``none`` first: each recomputation
        mode, each also with sequence parallelism where the job offers it and it applies
        (``seq_parallel.sp_applies``); without ``allow_recompute`` plain ``none`` alone."""
        j = self.job
        sp = allow_recompute and j.sequence_parallel and sp_applies(tp=tp, seq_len=j.seq_len, runtime=j.runtime)
        sps = (False, True) if sp else (False,)
        return [self.stage(kind, tp=tp, mbs=mbs, recompute=rc, sp=sp)
                for rc in recompute_options(allow_recompute) for sp in sps]

    def stage(self, kind: str, *, tp: int, mbs: int, recompute: Recompute | bool, sp: bool = False) -> StageCost:
        """The cost model of one stage shape (a bool ``recompute`` means full or none; ``sp``: sequence
        parallelism)."""
        recompute = Recompute.of(recompute)
        key = (kind, tp, mbs, recompute, sp)
        sm = self._cache.get(key)
        if sm is None:
            k, j = self.kinds[kind], self.job
            cap = float("inf") if j.relax_memory else usable_bytes(k, headroom=j.mem_headroom)
            # Books of other schedules (the enumeration's, the variants') ask the same shapes: one model
            # each, with its solved layer counts and step times.
            sm = self._cache[key] = _STAGES.get((*self._job_key, *key, cap, j.optimizer_shard_holders, j.zero_stage),
                lambda: StageModel(self.stage_job, k, tp=tp, mbs=mbs, recompute=recompute, capacity_bytes=cap,
                                   shard_holders=j.optimizer_shard_holders, sp=sp, zero_stage=j.zero_stage),
                pin=self._pins)
        return sm
