"""The search's one path (planner._make_plan): one enumeration of candidate shapes, priced under every
schedule and optimizer sharding the config leaves open.

A *variant* is a schedule and an optimizer sharding. A shape (kind-pure templates, their replicas
and fills, mixed pipelines) does not depend on the variant; its layer splits (in-flight memory),
closed-form times and memory do. The search enumerates shapes once per closed form that prunes
differently (ZB-H1, 1F1B), each at the loosest memory (ZeRO-1 with more holders than devices where
sharding is open), so the pool holds every shape some variant can fit; each kind alone likewise. Every variant then
splits and prices every shape of the pool with its own closed form and memory (`reprice`), which
drops the shapes it cannot fit. The predictor scores each variant's best, the best are polished, and
the interleaved schedule starts from the best 1F1B plans (and, where it is asked for, from the shapes
priced with stages sized for two chunks).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from functools import partial

from hethub.fanout import fan_out
from hethub.memo import Ranked, reference
from hethub.plan import PLANNED_SHARDINGS, Plan, zero_stage_of
from hethub.predict.profiles import ProfileSet
from hethub.predict.result import Prediction
from hethub.predict.scoring import Screen, score_plans
from hethub.predict.stage_links import LinkBook
from hethub.runtimes import runtime_profile
from hethub.schedules import AUTO_SCHEDULE
from hethub.search.combine import Estimate, Group, estimate_samples
from hethub.search.config import PlannerConfig
from hethub.search.finalists import finalist_plans, unequal_refused
from hethub.search.hetero import plan_key, search
from hethub.search.templates import Books, Searcher
from hethub.spec.cluster import Cluster
from hethub.spec.model import ModelSpec

ONE_F_ONE_B, INTERLEAVED = "1f1b", "interleaved"
SIZED_CHUNKS = 2  # the v the interleaved schedule's stages are also sized for
ENUM_SCHEDULES = ("zb-h1", "1f1b")  # enumeration_variants says why
# Distinct shapes of the enumeration priced under every variant (its first `finalists + top_k` are
# what one variant's own search would have kept; the rest is room for the variants' reorder).
SHAPES_POOL = 48


@dataclass(frozen=True)
class Variant:
    """A schedule (its model chunks per stage) and an optimizer sharding, ``one_holder``: at one replica's memory."""

    schedule: str
    sharding: str
    chunks: int = 1
    one_holder: bool = False

    def config(self, config: PlannerConfig, *, holders: int = 1) -> PlannerConfig:
        return replace(config, schedule=self.schedule, optimizer_sharding=self.sharding, virtual_stages=self.chunks,
                       shard_holders=1 if self.sharding == "none" or self.one_holder else holders)

    def pool(self, shapes: list[Estimate], firsts: frozenset[int]) -> tuple[list[Estimate], frozenset[int]]:
        """The shapes a variant the config does not ask prices (and which are the enumerations' firsts):
        unsharded, those of one replica (`variants_of`); ZeRO-1 all; ZeRO-2/3 the enumerations' firsts
        where memory binds (some stage recomputes or runs SP): their per-micro-batch collectives cost time."""
        if self.sharding == "none":
            ones = [i for i, e in enumerate(shapes) if sum(g.count for g in e.groups) == 1]
            return [shapes[i] for i in ones], frozenset(j for j, i in enumerate(ones) if i in firsts)
        if zero_stage_of(self.sharding) < 2:
            return shapes, firsts
        if not any(any(g.pipe.recompute) or any(g.pipe.sp) for e in shapes for g in e.groups):
            return [], frozenset()
        return [shapes[i] for i in sorted(firsts)], frozenset(range(len(firsts)))

    def searcher(self, config: PlannerConfig, *, cluster: Cluster, model: ModelSpec, profiles: ProfileSet | None,
                 links: LinkBook, holders: int = 1) -> Searcher:
        """The variant's searcher (its stage models, splits and checks), on the job's one ``links``."""
        return Searcher(cluster=cluster, model=model, config=self.config(config, holders=holders), profiles=profiles,
                        books=Books(links=links))


def variants_of(config: PlannerConfig) -> tuple[list[Variant], list[str]]:
    """The variants the config leaves open (the interleaved schedule's sized one where it is asked) and the
    shardings asked; the unsharded ones always, as a plan of one replica is (finalists.finalist_plans)."""
    runtime = runtime_profile(config.runtime)  # what it runs (hethub.runtimes)
    schedules = list(runtime.auto_schedules) if config.schedule == AUTO_SCHEDULE else [config.schedule]
    schedules = [ONE_F_ONE_B, *schedules] if schedules == [INTERLEAVED] else schedules  # it starts from 1F1B's
    shardings = [z for z in ("none", "zero1") if z in runtime.shardings] if config.optimizer_sharding == "auto" \
        else [config.optimizer_sharding]
    # ZeRO-2/3 free memory the way ZeRO-1 does, more of it: their shapes are the enumerations' (priced
    # under them where memory binds, `Variant.pool`), not enumerated again.
    priced = [z for z in PLANNED_SHARDINGS if z in runtime.shardings] if config.optimizer_sharding == "auto" \
        else list(dict.fromkeys([*shardings, "none"]))
    out = [Variant(sch, z) for sch in schedules if sch != INTERLEAVED for z in priced]
    # Stages sized for chunks where the interleaved schedule is asked for; under auto its plans are the
    # best 1F1B plans in chunks (planner._refined), as the sized ones never won (docs/planner.md).
    if config.schedule == INTERLEAVED and config.strategy == "hethub":
        out += [Variant(INTERLEAVED, z, SIZED_CHUNKS) for z in priced if zero_stage_of(z) < 3]
    return out, shardings


def enumeration_variants(variants: list[Variant], shardings: list[str]) -> list[Variant]:
    """The variants the enumeration runs under: ZB-H1 and 1F1B where open (the interleaved schedule's are
    1F1B's; ZB-H1's small bubble favours deeper pipelines, 1F1B's fill shallower ones), under ZeRO-1 where
    open (the loosest memory: the pool holds every shape a variant fits); an asked ZeRO-2/3 also at one
    holder, ranking first the one-replica shapes, which pay no per-micro-batch collective unsharded."""
    names = [v.schedule for v in variants if v.schedule != INTERLEAVED] or [ONE_F_ONE_B]
    zero = "zero1" if "zero1" in shardings else shardings[0]
    out = [Variant(n, zero) for n in ENUM_SCHEDULES if n in names] or [Variant(names[0], zero)]
    return out + [Variant(v.schedule, z, one_holder=True) for v in out for z in shardings if zero_stage_of(z) >= 2]


def distinct(ests: list[Estimate], n: int) -> list[Estimate]:
    """The first ``n`` candidates of distinct plans (`hetero.plan_key`), in order."""
    out: dict[tuple, Estimate] = {}
    for est in ests:
        out.setdefault(plan_key(est), est)
    return list(out.values())[:n]


def enumerate_shapes(searchers: list[Searcher], *, mixed: bool = True, alone: bool = True,
                     ) -> tuple[list[Estimate], dict[str, list[Estimate]]]:
    """The enumeration under each searcher's variant (`hethub.fanout`): its best distinct candidates (``mixed``)
    and each kind's alone (``alone``, on its books: the bound's parts, repriced per variant like the pool), each
    pooled over the searchers in turns (each one's first ``SHAPES_POOL``), best closed form first. The kind-alone
    searches are tasks of their own, after the mixed ones, so the worker that ends its mixed search first
    takes them."""
    mixes = [partial(_mixed, s) for s in searchers] if mixed else []
    found = fan_out([*mixes, *(partial(_alone, s) for s in searchers)] if alone else mixes)
    kinds = searchers[0].counts if alone else ()
    return (_in_turns(found[:len(mixes)]) if mixed else [],
            {kind: _in_turns([f[i] for f in found[len(mixes):]]) for i, kind in enumerate(kinds)})


def _mixed(s: Searcher) -> list[Estimate]:
    """The first `SHAPES_POOL` distinct candidates of ``s``'s enumeration (its variant's mixed shapes)."""
    return distinct(search(s, first=SHAPES_POOL), SHAPES_POOL)


def _alone(s: Searcher) -> list[list[Estimate]]:
    """Each kind's first `SHAPES_POOL` distinct candidates alone under ``s``'s variant, on its books."""
    return [distinct(search(Searcher(cluster=s.cluster, model=s.model, config=s.config, profiles=s.job.profiles,
                                     kinds=(kind,), books=s.books), kinds_alone=True), SHAPES_POOL)
            for kind in s.counts]


def _in_turns(found: list[list[Estimate]]) -> list[Estimate]:
    """The searchers' distinct candidate lists merged in turns (first of each, then second...), distinct."""
    return distinct([e for t in itertools.zip_longest(*found) for e in t if e is not None], SHAPES_POOL * len(found))


def reprice(s: Searcher, est: Estimate) -> list[Estimate]:
    """``est``'s shape (each group's stage kinds, TP degrees and replicas) split and priced in closed form
    under the searcher's variant, unchecked (`repriced`). Two splits per group: the one of the same kind
    (with or without recomputation) as the enumerated shape's, and the min-max split, as a variant with
    less memory (ZB-H1 beside 1F1B) may need recomputation to keep the layers where the enumeration put them."""
    options = []
    for g in est.groups:
        pipes = s.splits(g.pipe.slots, g.pipe.mbs)
        if not pipes:
            return []
        same = next((p for p in pipes if any(p.recompute) == any(g.pipe.recompute)), pipes[0])
        options.append((g.count, same, pipes[0]))
    out = []
    for picks in dict.fromkeys((tuple(o[1] for o in options), tuple(o[2] for o in options))):
        groups = [Group(pipe, count) for pipe, (count, _, _) in zip(picks, options, strict=True)]
        sizes = {g.pipe.mbs for g in groups}
        out.append(s.estimate(groups, sizes.pop()) if len(sizes) == 1 else estimate_samples(
            groups, total_samples=s.config.global_batch, links=s.links, model=s.model, precision=s.config.precision,
            equal=s.config.equal_shares))
    return [e for e in out if e is not None]


def repriced(s: Searcher, shapes: list[Estimate]) -> Ranked[Estimate]:
    """The shapes priced under ``s``'s variant, each as the fastest of its splits that fits (`Searcher.fits`,
    checked only where the order is read that far), best closed form first."""
    return Ranked([reprice(s, est) for est in shapes], key=lambda e: e.step_time_s, check=s.fits)


def priced_plans(s: Searcher, *, config: PlannerConfig, shapes: list[Estimate], screen: Screen, firsts: int = 0,
                 own: bool = False) -> list[tuple[Plan, Prediction]]:
    """The shapes priced under the variant of ``s`` (its searcher: sharded stages assume its holders),
    the best distinct laid out and predicted, with those of the first ``firsts`` shapes; fastest
    first. ``config``: the user's (finalists, top_k); ``screen``: `scoring.score_plans`'s (its host's);
    ``own``: the shapes were enumerated by ``s`` itself, so priced as they are (a reprice keeps only
    the min-max split or one like the shape's, not the split the search chose)."""
    got = Ranked([[e] for e in shapes], key=lambda e: e.step_time_s) if own else repriced(s, shapes)
    if all(unequal_refused(e, s.config.optimizer_sharding) for o in got.options for e in o) and not reference():
        return []  # nothing to lay out: the reader refuses every split, whichever the order reads
    # The closed form ranks variants with errors of their own (ZB-H1's split backward is an assumed
    # half), so the shapes the enumeration ranked first are laid out too and the predictor decides.
    n = config.finalists + config.top_k
    cfg = replace(s.config, top_k=config.top_k, finalists=config.finalists + got.promote(n, range(firsts)))
    plans = finalist_plans(s, got, config=cfg, strategy="hethub", per_size=config.per_size_finalists, bar=screen.bar)
    return score_plans(plans, s.job.profiles, host=screen.host, headroom=config.mem_headroom, screen=screen,
                       in_floor_order=True)


def alone_plans(searchers: list[Searcher], shapes: list[Estimate], *, config: PlannerConfig,
                bar: Callable[[Plan], float] | None = None) -> Iterator[Plan]:
    """One kind's single-kind ``shapes`` priced under every variant's searcher, each variant's best laid out
    as its own search of the kind alone would (``config``'s finalists, top_k and per-size places): the
    candidates of the kind's part of the bound, which `finalists.bound_parts` scores (``bar``: its)."""
    priced = [(s, repriced(s, shapes)) for s in searchers]
    # The variant of the best closed form first: its plans raise the screen's bar soonest.
    for s, ests in sorted(priced, key=lambda x: min((e.step_time_s for e in x[1].first(1)), default=math.inf)):
        cfg = replace(s.config, finalists=config.finalists, top_k=config.top_k)
        yield from finalist_plans(s, ests, config=cfg, strategy="homogeneous", per_size=config.per_size_finalists,
                                  bar=bar)
