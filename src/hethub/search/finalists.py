"""The search's finalists: the plans of its best distinct candidates laid out, then scored with the
predictor (the step floor screening those that could not be among the first few); and each kind
alone, the upper bound's parts. Used by the planner's searches and the reference search alike."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace

from hethub.layout import single_holder_units
from hethub.layout_assemble import build_plan
from hethub.memo import Ranked, reference
from hethub.plan import Plan, zero23_refusal, zero_stage_of
from hethub.predict.host import HostModel
from hethub.predict.plan_costs import PlanCosts
from hethub.predict.predictor import may_fit_below
from hethub.predict.profiles import ProfileSet
from hethub.predict.result import Prediction
from hethub.predict.scoring import Screen, score_plans
from hethub.predict.stage_modes import ModeFits, choose_modes, modes_floor_s, stage_modes
from hethub.runtimes import runtime_profile, runtime_refusals
from hethub.search.combine import Estimate
from hethub.search.config import PlannerConfig
from hethub.search.hetero import plan_key, search, size_key
from hethub.search.templates import Books, Searcher
from hethub.spec.cluster import Cluster
from hethub.spec.model import ModelSpec


def finalist_plans(s: Searcher, ests: Iterable | Ranked, *, config: PlannerConfig, strategy: str, per_size: int = 0,
                   bar: Callable[[Plan], float] | None = None, require_fit: bool = True) -> Iterator[Plan]:
    """The plans of the best `finalists + top_k` distinct candidates of `ests` (best first) and, with
    `per_size`, of the best `per_size` of each micro-batch size (hetero.Results says why), laid out as
    read. A `Ranked` order is read only as far as that, shapes of filled sizes skipped unchecked.
    ``bar``: the reader's (`scoring.Screen.bar`): a plan whose floor under every mode (`modes_floor_s`) reaches
    it takes its place unread, its modes not chosen (where the runtime's refusals do not depend on
    them; never on the reference path). ``require_fit``: the reader drops plans over memory
    (`score_plans`'s), so one with a stage no mode fits takes its place unread where the exact memory
    check (`may_fit_below`) proves it over (not on the reference path)."""
    seen, taken, costs, keep = set(), Counter(), None, config.finalists + config.top_k
    bar = bar if runtime_profile(config.runtime).runs_stage_modes and not reference() else None
    modes = dict(allow_recompute=config.allow_recompute, allow_sp=config.sequence_parallel)
    def full(est: Estimate) -> bool:  # stays so: `taken` only grows; one size for a shape's splits
        return taken.total() >= keep and taken[size_key(est) if per_size else ()] >= per_size
    for est in ests.read(lambda e: not full(e)) if isinstance(ests, Ranked) else ests:
        if plan_key(est) in seen or full(est) or (unequal_refused(est, config.optimizer_sharding) and not reference()):
            continue  # the last: refused below, read off the estimate before it is laid out
        plan = build_plan(cluster=s.cluster, model=s.model, est=est, global_batch=config.global_batch,
                          seq_len=config.seq_len, schedule=config.schedule, precision=config.precision,
                          strategy=strategy).with_runtime(config.runtime)
        # Before the recomputation choice, which it frees memory for; a plan of one replica has nothing
        # to shard across and stays unsharded (the runtime refuses it sharded, planner.make_plan notes it).
        if config.optimizer_sharding != "none" and not single_holder_units(plan):
            plan = replace(plan, optimizer_sharding=config.optimizer_sharding, optimizer_shares=config.optimizer_shares)
            if plan.zero_stage >= 2 and zero23_refusal(plan) is not None:
                continue  # not offered: e.g. pipelines of unequal micro-batch counts
        seen.add(plan_key(est))
        costs = costs or (PlanCosts(plan, s.job.profiles) if bar else None)  # one job: stage costs are shared
        fits, orders = ModeFits(plan, config.mem_headroom), stage_modes(plan, **modes)  # the floors' and choice's
        # The floor over every mode first; where it is below the bar, the floor over the modes not
        # proven over memory (their proofs then serve the choice).
        unread = bar is not None and (b := bar(plan)) < math.inf and (
            modes_floor_s(plan, costs=costs, orders=orders, **modes) >= b
            or modes_floor_s(plan, costs=costs, fits=fits, orders=orders, **modes) >= b)
        if not unread:
            chosen = choose_modes(plan, mem_headroom=config.mem_headroom, fits=fits, orders=orders, **modes)
            plan = chosen.plan
            unread = (require_fit and not chosen.every_stage_fits and not reference()
                      and not may_fit_below(plan, mem_headroom=config.mem_headroom))
        if runtime_refusals(plan):  # what the runtime cannot run (Megatron: replicas or TP degrees that differ)
            continue
        taken[size_key(est) if per_size else ()] += 1
        if not unread:
            yield plan
        if taken.total() >= keep and not per_size:
            break


def unequal_refused(est: Estimate, sharding: str) -> bool:
    """Whether ``est`` laid out under ``sharding`` is a plan `plan.zero23_refusal` refuses for unequal micro-batch
    counts: ZeRO-2/3 and two counts, so two or more pipelines, each holding every layer: no unit has one holder
    and `finalist_plans` shards it. Read off the estimate, as a layout of thousands of devices costs."""
    return zero_stage_of(sharding) >= 2 and len({m for ms in est.micro_batches for m in ms}) > 1


# ---- Each kind alone: the upper bound's parts and each kind's best single-kind plans.
@dataclass(frozen=True)
class BoundParts:
    """Each kind alone: its part of the upper bound (tokens/s), notes on kinds that cannot hold the
    model alone, the kind-alone plans scored (the best two per kind), and the kinds whose part is a
    relaxed-memory plan."""

    parts: dict[str, float]
    notes: tuple[str, ...]
    alone: list[tuple[Plan, Prediction]]
    relaxed: frozenset[str]

    @staticmethod
    def of(each: list[BoundParts]) -> BoundParts:
        return BoundParts({k: v for b in each for k, v in b.parts.items()}, tuple(n for b in each for n in b.notes),
                          [x for b in each for x in b.alone], frozenset().union(*(b.relaxed for b in each)))


def kind_parts(*, cluster: Cluster, model: ModelSpec, config: PlannerConfig, profiles: ProfileSet | None,
               books: Books | None = None, host: HostModel | None = None,
               candidates: Callable[[str, Callable[[Plan], float]], Iterable[Plan]] | None = None,
               ) -> list[Callable[[], BoundParts]]:
    """A task per kind (each screens by its own bar): its part of the upper bound, notes, best feasible single-kind
    candidates, scored, and relaxed-memory flag. ``candidates``: a kind's plans where the caller has them (the
    default path's, under every variant), laid out as the scoring reaches them (`Screen.bar`); else searched anew."""
    def part(kind: str) -> BoundParts:
        screen = Screen(keep=2, host=host)
        plans = (candidates(kind, screen.bar) if candidates is not None else
                 _kind_alone(cluster=cluster, model=model, config=config, profiles=profiles, kind=kind, relax=False,
                             books=books))
        # The part is the best, and the combined search takes the best two.
        if scored := score_plans(plans, profiles, host=host, headroom=config.mem_headroom, screen=screen):
            return BoundParts({kind: scored[0][1].tokens_per_s}, (), scored[:2], frozenset())
        relaxed = score_plans(_kind_alone(cluster=cluster, model=model, config=config, profiles=profiles, kind=kind,
                                     relax=True, books=books), profiles, require_fit=False, host=host,
                         headroom=config.mem_headroom, keep=1)
        alone = f"kind {kind} alone ({cluster.count_by_kind()[kind]} devices)"
        return BoundParts({kind: relaxed[0][1].tokens_per_s if relaxed else 0.0}, (
            f"{alone} cannot hold {model.name} at seq_len {config.seq_len}; the upper bound uses its best plan with "
            "the memory limit relaxed" if relaxed else f"{alone} has no plan for {model.name} even with memory "
            "relaxed (no usable TP degree or too few devices); it adds nothing to the upper bound",), [],
            frozenset([kind] if relaxed else []))
    return [lambda kind=kind: part(kind) for kind in cluster.kind_names]


def _kind_alone(*, cluster: Cluster, model: ModelSpec, config: PlannerConfig, profiles: ProfileSet | None,
                kind: str, relax: bool, books: Books | None) -> Iterator[Plan]:
    s = Searcher(cluster=cluster, model=model, config=config, profiles=profiles, relax_memory=relax, kinds=(kind,),
                 books=books)
    return finalist_plans(s, search(s, kinds_alone=True), config=config, strategy="homogeneous",
                          per_size=config.per_size_finalists, require_fit=not relax)
