"""Candidate pipelines: kind-pure templates per (kind, TP, stages) and mixed templates.

A template fixes a pipeline's stage shapes; split.py chooses its layer split. Pure templates are
ranked by estimated samples/s per device; only the best few per kind survive into the combination
search. Every stage count is rated, except, on large clusters, those whose closed-form rate bound is
below the kind's third best template (they cannot enter the top).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

from hethub.layout_assemble import build_plan, to_pipeline
from hethub.memo import Tiers
from hethub.plan import zero_stage_of
from hethub.predict.closed_step import step_time_s
from hethub.predict.pipeline_floors import fits_some_mode_kept, floor_keys
from hethub.predict.profiles import ProfileSet
from hethub.predict.stage_cost import tp_options
from hethub.predict.stage_links import LinkBook
from hethub.search.bounds import BLIND, EXACT, GRID, rate_bound
from hethub.search.combine import Estimate, Group, estimate
from hethub.search.config import PlannerConfig
from hethub.search.split import CostBook, Job, LayerSplits, PipeCost, Slot, fixed_split, layer_splits, split_layers
from hethub.spec.cluster import Cluster
from hethub.spec.model import ModelSpec

TOP_PER_KIND = 3  # pure templates per kind that enter the combination search (hetero.py)
SMALL_CLUSTER = 64  # devices up to which layer splits that trade bottleneck for fill/drain are tried


@dataclass(frozen=True)
class Ranked:
    pipe: PipeCost
    rate: float  # estimated samples/s per device when its kind runs its batch share with it


@dataclass
class Skipped:
    """A stage count (tp, stages) the scan did not split: its rate bound once read (None before), and
    an upper bound on it (a loose bound until the bound is read, then the bound)."""
    tp: int
    stages: int
    bound: float | None
    upper: float


@dataclass
class Books:
    """What the searches of one make_plan share: stage models and splits per memory mode (they differ
    only in the kinds they use), and the links with their caches (hops, all-reduce times), which
    depend on the cluster alone."""

    costs: dict[bool, CostBook] = field(default_factory=dict)  # by relax_memory
    links: LinkBook | None = None


class Searcher:
    """Everything one search shares: costs, links, device counts, options."""

    def __init__(self, *, cluster: Cluster, model: ModelSpec, config: PlannerConfig,
                 profiles: ProfileSet | None, relax_memory: bool = False,
                 kinds: tuple[str, ...] | None = None, books: Books | None = None) -> None:
        self.cluster, self.model, self.config = cluster, model, config
        self.job = Job(model=model, seq_len=config.seq_len, precision=config.precision,
                       schedule=config.schedule, profiles=profiles, relax_memory=relax_memory,
                       mem_headroom=config.mem_headroom, chunks=config.virtual_stages,
                       optimizer_shard_holders=config.shard_holders if config.optimizer_sharding != "none" else 1,
                       zero_stage=max(1, zero_stage_of(config.optimizer_sharding)),
                       sequence_parallel=config.sequence_parallel)
        self.books = books = Books() if books is None else books
        if relax_memory not in books.costs:
            books.costs[relax_memory] = CostBook(self.job, cluster)
        self.book = books.costs[relax_memory]
        if books.links is None:
            books.links = LinkBook(cluster, runtime=config.runtime)
        self.links = books.links
        counts = cluster.count_by_kind()
        self.counts = {k: counts[k] for k in (kinds or cluster.kind_names)}
        self.tps = {k: tp_options(cluster, model, k, config.tp_degrees) for k in self.counts}
        flops = {k: n * cluster.kinds[k].effective_flops for k, n in self.counts.items()}
        self.share = {k: f / sum(flops.values()) for k, f in flops.items()}
        self._pure: dict[tuple[str, int, float], list[Ranked]] = {}
        self._skipped: dict[tuple[str, int, float], list[Skipped]] = {}  # `skipped` reads a bound only where it must
        self.fills: dict[tuple, tuple[list, int]] = {}  # hetero._fill's answers
        self._seeds: dict[tuple[str, int, float], list[tuple[float, int, int]]] = {}
        self._tops: dict[tuple[str, int, float], Tiers[tuple[int, int]]] = {}  # top_above's orders
        self._fits: dict[tuple, bool] = {}
        self._hopeless: dict[tuple, bool] = {}  # fits_some_mode_kept's, by pipeline
        # mixed.families': (kinds, TP degrees, micro-batch size) -> its Family (a module above this one);
        # (pool as sorted (kind, devices), micro-batch size) -> the pool's families with their boxes.
        self.family_protos: dict[tuple[tuple[str, ...], tuple[int, ...], int], Any] = {}
        self.pool_families: dict[tuple[tuple[tuple[str, int], ...], int], list[tuple[Any, list[tuple]]]] = {}

    def splits(self, slots: tuple[Slot, ...], mbs: int) -> list[PipeCost]:
        """The min-max split, plus the best split without recomputation when that one recomputes. Min-max
        is right for many micro-batches; with few, the fill/drain (the sum over stages) weighs as much,
        and avoiding recomputation can beat a slightly lower bottleneck."""
        key = (slots, mbs)
        if key not in self.book.splits:
            first = self.split_part(slots, mbs, recompute=self.config.allow_recompute)
            if self.config.allow_recompute and first and any(any(pc.recompute) for pc in first):
                first = first + self.split_part(slots, mbs, recompute=False)
            self.book.splits[key] = first
        return self.book.splits[key]

    def split_part(self, slots: tuple[Slot, ...], mbs: int, *, recompute: bool) -> list[PipeCost]:
        """One half of `splits`: the splits with recomputation allowed, or those without any (cached);
        the mixed search asks for the second only where its floor could still enter the finalists."""
        key = (slots, mbs, recompute)
        if (hit := self.book.splits.get(key)) is None:
            hit = self.book.splits[key] = split_layers(self.book, slots, mbs=mbs, allow_recompute=recompute,
                                                       hops=self.links.pipe_hops, in_flight_hint=self._hint(slots, mbs),
                                                       slacks=self.slacks())
        return hit

    def layer_splits(self, slots: tuple[Slot, ...], mbs: int, *, recompute: bool) -> LayerSplits:
        """`split_part`'s layer counts, unpriced (kept: `split_part` prices these): the mixed search floors
        a split by its boundaries and prices only those that could still enter the finalists."""
        return layer_splits(self.book, slots, mbs=mbs, allow_recompute=recompute, in_flight_hint=self._hint(slots, mbs),
                            slacks=self.slacks())

    def _hint(self, slots: tuple[Slot, ...], mbs: int) -> int:
        return self.in_flight_hint(sum(sl.tp for sl in slots), mbs)

    def slacks(self) -> tuple[float, ...]:
        """Small clusters run few micro-batches per pipeline, where trading bottleneck for fill and drain
        pays; large ones do not, and the variants would cost search time."""
        return (1.0, 1.5, math.inf) if sum(self.counts.values()) <= SMALL_CLUSTER else (1.0,)

    def in_flight_hint(self, devices: int, mbs: int) -> int:
        """Micro-batches a pipeline of `devices` devices is sized for where the schedule holds all of
        them (GPipe): its device share of the batch, with room. Grows with `devices`."""
        share = devices / sum(self.counts.values())
        return max(1, math.ceil(1.5 * share * self.config.global_batch / mbs))

    def fixed(self, slots: tuple[Slot, ...], counts: tuple[int, ...], mbs: int) -> PipeCost | None:
        key = (slots, mbs, counts)
        if key not in self.book.fixed:
            self.book.fixed[key] = fixed_split(self.book, slots, counts, mbs=mbs,
                                               allow_recompute=self.config.allow_recompute, hops=self.links.pipe_hops,
                                               in_flight_hint=max(1, self.config.global_batch // mbs))
        return self.book.fixed[key]

    def estimate(self, groups: list[Group], mbs: int, **floor) -> Estimate | None:
        return estimate(groups, total_mb=self.config.global_batch // mbs, links=self.links, model=self.model,
                        precision=self.config.precision, equal=self.config.equal_shares, **floor)

    def fits(self, est: Estimate) -> bool:
        """Whether the candidate's plan fits memory with its real gradient-sync shape. The stage
        models (costs.py) size a stage as if every holder of its parameters had its TP degree; where
        holders differ, the runtime builds full-size gradients (2 x TP of them, predict/memory), which
        the search cannot see, so such candidates are checked laid out before they take a finalist's
        place. Candidates of one TP degree are sized right already."""
        if self.job.relax_memory or len({sl.tp for g in est.groups for sl in g.pipe.slots}) == 1:
            return True
        key = (tuple((g.pipe, g.count) for g in est.groups), est.micro_batches)
        if (hit := self._fits.get(key)) is None:
            cfg = self.config
            if cfg.optimizer_sharding == "none":
                # Two replicas per group have the same sync shape as all of them (whether a stage is
                # synced, whether its buckets mix TP degrees, their sizes), and each stage's memory
                # depends on nothing else but its own micro-batches (the most are kept).
                ms = tuple(tuple(sorted(m, reverse=True)[:2]) for m in est.micro_batches)
                est = replace(est, groups=tuple(replace(g, count=len(m)) for g, m in zip(est.groups, ms, strict=True)),
                              micro_batches=ms)
            lone = [to_pipeline(g.pipe, [(0,) * sl.tp for sl in g.pipe.slots], num_micro_batches=m, mbs=g.pipe.mbs)
                    for g, ms in zip(est.groups, est.micro_batches, strict=True) for m in set(ms)]  # one per shape
            keys = floor_keys(lone, schedule=cfg.schedule, zero_stage=zero_stage_of(cfg.optimizer_sharding))
            if keys is not None and any(self._hopeless.get(k) for k in keys):  # a pipeline's kept proof: unbuilt
                self._fits[key] = False
                return False
            total = sum(sum(m) * g.pipe.mbs for g, m in zip(est.groups, est.micro_batches, strict=True))
            plan = build_plan(cluster=self.cluster, model=self.model, est=est, global_batch=total,
                              seq_len=cfg.seq_len, schedule=cfg.schedule, precision=cfg.precision, strategy="hethub",
                              validate=False, place=cfg.optimizer_sharding != "none")  # slices follow the ranks
            if cfg.optimizer_sharding != "none":
                plan = replace(plan, optimizer_sharding=cfg.optimizer_sharding, optimizer_shares=cfg.optimizer_shares)
            hit = self._fits[key] = fits_some_mode_kept(plan, self._hopeless, allow_recompute=cfg.allow_recompute,
                                                        mem_headroom=cfg.mem_headroom, allow_sp=cfg.sequence_parallel)
        return hit

    def rate(self, pipe: PipeCost, *, kind_devices: int, share: float) -> float:
        """Samples/s per device of `pipe` replicated over its kind, running that kind's share of the batch.
        With one group of c identical pipelines (each holding >= 1 micro-batch), the step is the
        slowest pipeline's T(ceil(mb / c)) plus a sync tail that does not depend on T (combine.step_time_s
        only shifts by it). The tail is cached per (pipe, c) in the CostBook, so the kind-alone searches
        and the combined one (same templates, other shares) rate a template in O(1) after the first time.
        """
        c = kind_devices // pipe.num_devices
        if c < 1:
            return 0.0
        mb = max(c, round(self.config.global_batch // pipe.mbs * share))
        key = (id(pipe), c)
        if (hit := self.book.solo.get(key)) is None:  # keep the pipe alive with its tail so the id cannot be reused
            hit = self.book.solo[key] = (pipe, step_time_s([Group(pipe, c)], [0.0], links=self.links, model=self.model,
                                                           precision=self.config.precision))
        return mb * pipe.mbs / (pipe.time_s(-(-mb // c)) + hit[1]) / (c * pipe.num_devices)

    def pure(self, kind: str, mbs: int, *, share: float) -> list[Ranked]:
        """Scanned kind-pure templates of `kind`, best rate first. On clusters over SMALL_CLUSTER devices,
        a stage count whose closed-form rate bound (bounds.py) is below the TOP_PER_KIND-th best distinct
        template found so far is not split yet: it cannot enter the kind's top templates. Such a count
        still extends the scan as if it had been the best so far whenever its bound allows that, so every
        stage count the full scan reaches is still reached; `complete` splits skipped ones when needed."""
        key = (kind, mbs, share)
        if key in self._pure:
            return self._pure[key]
        n, out, skipped = self.counts[kind], [], []
        prune = self.cluster.num_devices > SMALL_CLUSTER
        top: list[tuple[float, tuple]] = []  # the best TOP_PER_KIND distinct (rate, key) so far
        split: dict[tuple[int, int], list[Ranked]] = {}  # (tp, stages): its templates, rated

        def ranked(tp: int, p: int) -> list[Ranked]:
            got = split.get((tp, p))
            if got is None:
                got = split[(tp, p)] = [Ranked(pipe, self.rate(pipe, kind_devices=n, share=share))
                                        for pipe in self.splits((Slot(kind, tp),) * p, mbs)]
                out.extend(got)
            return got

        def keep(tp: int, p: int, got: list[Ranked]) -> None:
            for r in got:
                if prune and r.rate > 0:
                    _keep_top(top, r.rate, (tp, p, any(r.pipe.recompute)))

        # Seeds: stage shapes split first, so the bar starts near its final height (seeds only raise it
        # earlier: any template's rate is a valid bar, and the scan below takes their templates as split).
        for _, tp, p in self.seeds(kind, mbs, share=share) if prune else ():
            keep(tp, p, ranked(tp, p))
        # Largest TP first: on the models that need pruning it is usually best, which raises the bar early.
        # Every stage count is considered (the rate is not unimodal in it: a deeper pipeline may win
        # again past a dip); pruning skips those whose rate bound is below the bar, so the top
        # templates are the full scan's exactly.
        for tp in sorted(self.tps[kind], reverse=prune):
            # up to L + 2 stages: the first and the last may hold only the embedding / the head
            for p in range(1, min(n // tp, self.model.num_layers + 2) + 1):
                bar = top[-1][0] if prune and len(top) == TOP_PER_KIND else 0.0
                if bar and (tp, p) not in split:
                    # Each loose bound is above the bound (`seeds`): one below the bar leaves the bound unread.
                    bound = 0.0
                    for tier in (BLIND, GRID, EXACT):
                        bound = self._bound(kind, tp, mbs, p, share, loose=tier)
                        if bound * (1 + 1e-9) < bar:
                            break
                    if bound * (1 + 1e-9) < bar:
                        skipped.append(Skipped(tp, p, bound if tier == EXACT else None, bound))
                        continue
                keep(tp, p, ranked(tp, p))
        out.sort(key=lambda x: -x.rate)
        self._pure[key] = out
        self._skipped[key] = skipped
        return out

    def seeds(self, kind: str, mbs: int, *, share: float) -> list[tuple[float, int, int]]:
        """(rate bound, tp, stages) of the TOP_PER_KIND stage shapes of highest rate bound, best first
        (cached). The bound is within a few % of the rate (bounds.rate_bound), so these are near the top,
        and splitting them first puts the scan's bar near its final height before the other stage
        counts are reached; the first bound is above every template's rate (`top_bound`). Exact
        bounds are computed in the order of their loose ones (each at least its exact one), until the
        TOP_PER_KIND-th best exact (ties: in stage-shape order) is above every loose one left."""
        key = (kind, mbs, share)
        if key not in self._seeds:
            cands = self._shapes(kind)
            loose = sorted((-self._bound(kind, tp, mbs, p, share, loose=BLIND), i) for i, (tp, p) in enumerate(cands))
            best: list[tuple[float, int]] = []  # (-exact bound, candidate), best first
            for neg, i in loose:
                if len(best) >= TOP_PER_KIND and best[TOP_PER_KIND - 1][0] < neg:
                    break  # the loose bounds left, so their exact ones, are below the TOP_PER_KIND-th best
                if len(best) >= TOP_PER_KIND and best[TOP_PER_KIND - 1][0] < -self._bound(
                        kind, cands[i][0], mbs, cands[i][1], share, loose=GRID):
                    continue  # so is this one's (GRID: a tighter loose bound)
                best = sorted([*best, (-self._bound(kind, cands[i][0], mbs, cands[i][1], share), i)])
            self._seeds[key] = [(-b, *cands[i]) for b, i in best[:TOP_PER_KIND] if b < 0]
        return self._seeds[key]

    def best_rate(self, kind: str, mbs: int, *, share: float, bar: float = 0.0) -> float | None:
        """The best rate of `pure`'s templates (0.0: none) where it is at least ``bar``, else None (how far below
        is not found): stage shapes split best bound first (`by_bound`), while a bound left is at least ``bar``
        and above the best rate found, so a size no shape reaches costs about BLIND's bounds, and the best rate
        the splits of the few shapes of highest bound (`pure` splits every shape that could hold one of the
        kind's top templates)."""
        best = 0.0  # read by the stop as it grows
        for _, tp, p in self.by_bound(kind, mbs, share=share,
                                      stop=lambda upper: upper < bar or upper <= best):  # noqa: B023
            for pipe in self.splits((Slot(kind, tp),) * p, mbs):
                best = max(best, self.rate(pipe, kind_devices=self.counts[kind], share=share))
        return best if best >= bar else None

    def top_bound(self, kind: str, mbs: int, *, share: float, loose: bool = False) -> float:
        """An upper bound on the rate of every template of `kind` (0.0: none fits): the first of `seeds` times
        1 + 1e-9, found best bound first (`top_above`: no other seed's bound is read); ``loose``: the largest BLIND
        bound, at least that."""
        if loose:
            return max([self._bound(kind, tp, mbs, p, share, loose=BLIND) for tp, p in self._shapes(kind)] + [0.0])
        return self.top_above(kind, mbs, share=share, above=0.0)[0]

    def top_above(self, kind: str, mbs: int, *, share: float, above: float) -> tuple[float, bool]:
        """`top_bound` (True; always where it is at least ``above``), else an upper bound on it below ``above``
        (False): `by_bound`'s order, kept per (kind, size, share) so that a later call goes on from there
        (`hetero._alone_all_sizes` tightens a size's bound only below the next size's: most sizes' exact
        bounds, which read their memory, then stay unread)."""
        bound = self._tier_bound(kind, mbs, share=share)
        if (tiers := self._tops.get((kind, mbs, share))) is None:
            tiers = self._tops[(kind, mbs, share)] = Tiers(self._shapes(kind), bound, loosest=BLIND)
        return tiers.top(above=above, bound=bound)

    def by_bound(self, kind: str, mbs: int, *, share: float,
                 stop: Callable[[float], bool]) -> Iterator[tuple[float, int, int]]:
        """`kind`'s stage shapes as (rate bound times 1 + 1e-9, tp, stages), largest first, until ``stop`` holds
        for the largest bound left, loose or not (asked anew after each shape). A shape's GRID and exact bounds
        are read only when its looser one is the largest left: each loose bound is at least the bound times
        1 + 1e-9, which is at least the rate of every split of the shape (as `pure` prunes)."""
        bound = self._tier_bound(kind, mbs, share=share)
        tiers = Tiers(self._shapes(kind), bound, loosest=BLIND)
        while (got := tiers.pop(stop, bound=bound)) is not None:
            yield got[0], *got[1]

    def _tier_bound(self, kind: str, mbs: int, *, share: float) -> Callable[[tuple[int, int], int], float]:
        """The rate bound of one of `kind`'s stage shapes (tp, stages) at a tier (BLIND, GRID, or the bound times
        1 + 1e-9), for `Tiers`: passed with each question, as a kept order must not hold this searcher."""
        return lambda x, tier: (self._bound(kind, x[0], mbs, x[1], share, loose=tier)
                                * (1 + 1e-9 if tier == EXACT else 1))

    def _shapes(self, kind: str) -> list[tuple[int, int]]:
        """Every (TP, stages) of `kind` a template may have: up to L + 2 stages (the first and the last may
        hold only the embedding / the head) over the kind's devices."""
        n = self.counts[kind]
        return [(tp, p) for tp in self.tps[kind] for p in range(1, min(n // tp, self.model.num_layers + 2) + 1)]

    def skipped(self, kind: str, mbs: int, *, share: float, above: float = 0.0,
                want: Callable[[int, int], bool] | None = None) -> list[tuple[int, int, float]]:
        """(tp, stages, rate bound) of the stage counts `pure` has not split (yet) whose bound is above
        ``above`` (and want(tp, stages)); a bound is computed only where its loose one is above ``above``."""
        self.pure(kind, mbs, share=share)
        return [(x.tp, x.stages, b) for x in self._skipped[(kind, mbs, share)]
                if x.upper > above and (want is None or want(x.tp, x.stages))
                and (b := self._read(x, kind, mbs, share)) > above]

    def skipped_upper(self, kind: str, mbs: int, *, share: float) -> list[tuple[int, int, float, bool]]:
        """`skipped`'s stage counts, none's bound computed: (tp, stages, at least its rate bound, whether
        that is the bound itself)."""
        self.pure(kind, mbs, share=share)
        return [(x.tp, x.stages, x.upper, x.bound is not None) for x in self._skipped[(kind, mbs, share)]
                if x.upper > 0]

    def top_skipped(self, kind: str, mbs: int, *, share: float, above: float,
                    want: Callable[[int, int], bool]) -> tuple[float, int, int] | None:
        """The largest (rate bound, tp, stages) of `skipped`'s, its bounds computed in the order of
        their loose ones until the loose ones left are below the largest found."""
        self.pure(kind, mbs, share=share)
        best = None
        for x in sorted(self._skipped[(kind, mbs, share)], key=lambda x: -x.upper):
            if x.upper <= above or (best is not None and x.upper < best[0]):
                break
            if want(x.tp, x.stages) and (b := self._read(x, kind, mbs, share)) > above:
                best = max(best or (b, x.tp, x.stages), (b, x.tp, x.stages))
        return best

    def _bound(self, kind: str, tp: int, mbs: int, p: int, share: float, *, loose: int = EXACT) -> float:
        """bounds.rate_bound of p stages of (kind, tp) over all the kind's devices (``loose``: its)."""
        if p > self.model.num_layers + 2:
            return 0.0
        return rate_bound(self.book, self.links, kind=kind, tp=tp, mbs=mbs, p=p, kind_devices=self.counts[kind],
                          global_batch=self.config.global_batch, share=share, loose=loose)

    def _read(self, x: Skipped, kind: str, mbs: int, share: float) -> float:
        """The rate bound of a `skipped` entry, computed the first time."""
        if x.bound is None:
            x.bound = x.upper = self._bound(kind, x.tp, mbs, x.stages, share)
        return x.bound

    def complete(self, kind: str, mbs: int, *, share: float, want: Callable[[int, int], bool],
                 above: float = 0.0) -> bool:
        """Split and rate the templates `pure` skipped for which want(tp, stages) holds and whose rate
        bound is above ``above``, adding them to its list in place (it stays sorted); whether there were any."""
        ranked = self.pure(kind, mbs, share=share)
        key = (kind, mbs, share)
        take = [(tp, p) for tp, p, _ in self.skipped(kind, mbs, share=share, above=above, want=want)]
        if not take:
            return False
        self._skipped[key] = [x for x in self._skipped[key] if (x.tp, x.stages) not in take]
        for tp, p in take:
            for pipe in self.splits((Slot(kind, tp),) * p, mbs):
                ranked.append(Ranked(pipe, self.rate(pipe, kind_devices=self.counts[kind], share=share)))
        ranked.sort(key=lambda x: -x.rate)
        return True

    def mixed(self, segments: tuple[tuple[str, int, int], ...], mbs: int) -> list[PipeCost]:
        """Pipelines of consecutive kind segments (kind, tp, stages), in the given order."""
        slots = self.mixed_slots(segments)
        return self.splits(slots, mbs) if slots else []

    @staticmethod
    def mixed_slots(segments: tuple[tuple[str, int, int], ...]) -> tuple[Slot, ...]:
        return sum(((Slot(k, t),) * n for k, t, n in segments), ())  # one Slot per segment, repeated

    def total_mb(self, mbs: int) -> int:
        return self.config.global_batch // mbs


def _keep_top(top: list[tuple[float, tuple]], rate: float, key: tuple) -> None:
    """Insert into the best TOP_PER_KIND distinct (rate, key) pairs, best first (hetero._top_distinct's keys)."""
    for i, (r, k) in enumerate(top):
        if k == key:
            if rate <= r:
                return
            del top[i]
            break
    top.append((rate, key))
    top.sort(key=lambda x: -x[0])
    del top[TOP_PER_KIND:]
