"""The planner's entry points: make_plan and upper_bound.

Every result is reported against the job's proven upper bound (search/proven_bound.py), so its
``efficiency`` is at most 1 whichever variants ran; the sum of kind-alone plans (HETHUB's
reference) is reported beside it as ``vs_kinds_alone``.

The search ranks candidates in closed form (fast, approximate); the final choice among the best
is made by the full predictor, so `hethub plan` and `hethub predict` agree exactly on the result.
"""

from __future__ import annotations

import contextlib
import gc
import io
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

from hethub.errors import InfeasibleError
from hethub.plan import Plan, Recompute
from hethub.predict.context_plans import cp_candidates, cp_note
from hethub.predict.host import HostModel
from hethub.predict.memory import describe_peak, state_bytes_per_param, usable_bytes
from hethub.predict.profiles import ProfileSet
from hethub.predict.result import Prediction
from hethub.predict.stage_cost import StageJob, stage_memory_of
from hethub.predict.stage_links import LinkBook
from hethub.predict.utilisation import cluster_mfu
from hethub.progress import progress
from hethub.runtimes import runtime_profile, runtime_refusals
from hethub.schedules import AUTO_SCHEDULE, SCHEDULES, get_schedule
from hethub.search.baselines import baseline_plans
from hethub.search.combine import Estimate
from hethub.search.config import PlannerConfig
from hethub.search.finalists import BoundParts, bound_parts, finalist_plans, score_plans
from hethub.search.hetero import search
from hethub.search.polish import chunked_candidates, chunks_note, interleave_all, polish
from hethub.search.proven_bound import ProvenBound, proven_bound
from hethub.search.templates import Books, Searcher, tp_options
from hethub.search.variants import (
    SIZED_CHUNKS,
    Variant,
    alone_plans,
    alone_shapes,
    enumerate_shapes,
    enumeration_variants,
    priced_plans,
    variants_of,
)
from hethub.spec.cluster import Cluster
from hethub.spec.kind import GIB
from hethub.spec.model import ModelSpec

ONE_F_ONE_B, INTERLEAVED = "1f1b", "interleaved"
INTERLEAVE_STARTS = 3  # the best 1F1B plans of distinct shapes tried with virtual stages
INTERLEAVE_POOL = 6  # 1F1B plans (predicted anyway as finalists) the starts are chosen among
# Predictions the polish may make from each of its starts, best first: the runners-up too, since
# polish moves layers and never swaps a template for another, so a runner-up a little slower as
# scored may polish to the better plan. Counted in predictions, the same plan comes out however
# busy the machine is.
POLISH_BUDGETS = (16, 6, 6)
SHARD_HOLDERS_OPTIMISM = 8  # sharded stages' assumed holders: this times the unsharded best's replicas
FIRST_SHAPES = 3  # each enumeration's best shapes, laid out and predicted under every variant
PROGRESS_MIN_DEVICES = 256  # smaller clusters plan in well under a second
ONE_REPLICA = ("optimizer sharding: none, although zero1 was asked: the plan has one replica, so each parameter "
               "has a single holder and ZeRO-1 has nothing to shard across (as Megatron's distributed optimizer "
               "at data-parallel size 1); more devices or a smaller model give replicas to shard over")


@dataclass(frozen=True)
class PlanResult:
    plan: Plan
    prediction: Prediction
    search_time_s: float
    # The proven bound (search/proven_bound.py) once make_plan returns; within a search, the
    # kind-alone sum that ranks its variants.
    upper_bound_tokens_per_s: float
    efficiency: float  # prediction.tokens_per_s / upper bound: <= 1 once make_plan returns
    alternatives: tuple[tuple[Plan, Prediction], ...]  # top-k, best first, including the best
    notes: tuple[str, ...]
    # Each kind's best tokens/s alone on the same job (the kind-alone reference's parts, docs/planner.md).
    upper_bound_by_kind: dict[str, float] | None = None
    # Kinds whose part is a plan with the memory limit relaxed (none of its own plans fit).
    relaxed_kinds: frozenset[str] = frozenset()
    # Set by make_plan: the proven bound's parts by kind, the sum of kind-alone plans, the plan's
    # tokens/s over it (above 1 where mixing relieves a kind's memory: docs/planner.md), and MFU
    # against every device's dense peak summed.
    bound_by_kind: dict[str, float] | None = None
    kinds_alone_tokens_per_s: float = 0.0
    vs_kinds_alone: float | None = None
    mfu: float = 0.0


def candidate_config(config: PlannerConfig, name: str) -> PlannerConfig:
    """The search schedule ``auto`` makes for candidate schedule ``name`` (1F1B keeps more plans: the
    interleaving's starts); its result, alternatives cut to ``config.top_k``, is what auto compares."""
    top_k = max(config.top_k, INTERLEAVE_POOL) if name == ONE_F_ONE_B else config.top_k
    return replace(config, schedule=name, top_k=top_k)


def _best_schedule(*, cluster: Cluster, model: ModelSpec, config: PlannerConfig,
                   profiles: ProfileSet | None, host: HostModel | None) -> PlanResult:
    t0 = time.perf_counter()
    results: dict[str, PlanResult] = {}
    errors: list[InfeasibleError] = []
    for name in runtime_profile(config.runtime).auto_schedules:
        try:
            if name == INTERLEAVED and ONE_F_ONE_B in results:  # interleaving starts from the 1F1B plans
                results[name] = _plan_interleaved(cluster=cluster, model=model, config=config, profiles=profiles,
                                                  host=host, base=results[ONE_F_ONE_B])
                continue
            results[name] = make_plan(cluster=cluster, model=model, config=candidate_config(config, name),
                                      profiles=profiles, host=host)
        except InfeasibleError as err:
            errors.append(err)
    if not results:
        raise errors[0]
    if ONE_F_ONE_B in results:  # its extra alternatives were the interleaving's starts
        one = results[ONE_F_ONE_B]
        results[ONE_F_ONE_B] = replace(one, alternatives=one.alternatives[:config.top_k])
    # The first of equals wins: interleaving that found no v > 1 worth it is 1F1B, listed first.
    name, best = min(results.items(), key=lambda kv: kv[1].prediction.step_time_s)
    best = against_bound(best, *merged_bound(results.values()))
    others = ", ".join(f"{n} {r.prediction.step_time_s:.3f} s" for n, r in results.items() if n != name)
    note = f"schedule {name} chosen: predicted step {best.prediction.step_time_s:.3f} s"
    note += f" vs {others}" if others else ""
    return replace(best, search_time_s=time.perf_counter() - t0, notes=(note, *best.notes))


def _best_sharding(*, cluster: Cluster, model: ModelSpec, config: PlannerConfig,
                   profiles: ProfileSet | None, host: HostModel | None) -> PlanResult:
    """ZeRO-1 as an outer option for the single-kind strategy (the hethub strategy prices both
    shardings from one enumeration, `_plan_variants`): plan unsharded, then sharded assuming
    ``SHARD_HOLDERS_OPTIMISM`` times the unsharded plan's pipelines as each group's holders (the
    predictor checks every finalist with its real ones; if none fits, again with the unsharded
    count), and keep the faster predicted (``auto``) or the sharded one (``zero1``)."""
    t0 = time.perf_counter()
    base: PlanResult | None = None
    with contextlib.suppress(InfeasibleError):  # perhaps only sharded state fits
        base = make_plan(cluster=cluster, model=model, config=replace(config, optimizer_sharding="none"),
                         profiles=profiles, host=host)
    replicas = max(2, len(base.plan.pipelines)) if base is not None else 2
    zero: PlanResult | None = None
    for holders in (SHARD_HOLDERS_OPTIMISM * replicas, replicas):
        try:
            zero = make_plan(cluster=cluster, model=model, profiles=profiles, host=host,
                             config=replace(config, optimizer_sharding="zero1", shard_holders=holders))
            break
        except InfeasibleError:
            if holders == replicas and (base is None or config.optimizer_sharding == "zero1"):
                raise
    if zero is None:
        assert base is not None
        return replace(base, notes=("optimizer sharding: none (no sharded plan fits)", *base.notes))
    faster = base is None or zero.prediction.step_time_s < base.prediction.step_time_s
    if config.optimizer_sharding == "zero1" or faster:
        best, other = zero, base
    else:
        best, other = base, zero
    best = against_bound(best, *merged_bound([r for r in (zero, base) if r is not None]))
    note = f"optimizer sharding: {best.plan.optimizer_sharding}"
    if other is not None:
        gain = other.prediction.step_time_s / best.prediction.step_time_s
        note += (f" (predicted step {best.prediction.step_time_s:.3f} s vs {other.prediction.step_time_s:.3f} s "
                 f"{other.plan.optimizer_sharding}: {gain:.3f}x)")
    return replace(best, search_time_s=time.perf_counter() - t0, notes=(note, *best.notes))


def _plan_interleaved(*, cluster: Cluster, model: ModelSpec, config: PlannerConfig, profiles: ProfileSet | None,
                      host: HostModel | None, base: PlanResult | None = None) -> PlanResult:
    """The interleaved schedule's plan: the 1F1B plans (``base``, if already made) interleaved, and,
    for the hethub strategy, searches with stages sized for v chunks (search/polish.py)."""
    if base is None:
        base = make_plan(cluster=cluster, model=model, profiles=profiles, host=host,
                         config=replace(config, schedule=ONE_F_ONE_B, top_k=max(config.top_k, INTERLEAVE_POOL)))
    sized = []
    if config.strategy == "hethub":
        # Stages sized for v chunks' activations (the split's memory and closed form take v).
        with contextlib.suppress(InfeasibleError):
            v = SIZED_CHUNKS
            sized.append((v, make_plan(cluster=cluster, model=model, profiles=profiles, host=host,
                                       config=replace(config, schedule=INTERLEAVED, virtual_stages=v, polish=False,
                                                      top_k=max(config.top_k, INTERLEAVE_STARTS)))))
    return _interleaved(base, config=replace(config, schedule=INTERLEAVED), profiles=profiles, host=host, sized=sized)


def _interleaved(base: PlanResult, *, config: PlannerConfig, profiles: ProfileSet | None,
                 host: HostModel | None, sized: Sequence[tuple[int, PlanResult]] = ()) -> PlanResult:
    """``base`` (planned under 1F1B) with the interleaved schedule's v chosen per pipeline where the
    predictor finds it faster within memory (search/polish.py); and the plans of ``sized``,
    searched with stages sized for v chunks, laid out in v chunks where each fits."""
    t0 = time.perf_counter()
    # The best of each shape (kinds and TP degrees per stage): a runner-up of fewer, larger stages
    # may interleave better than the best 1F1B plan and its re-splits (nvidia-amd-32, llama-3-70b).
    starts, rest, shapes = [], [], set()
    for plan, pred in base.alternatives:
        shape = tuple(sorted(tuple((st.kind, len(st.devices)) for st in p.stages) for p in plan.pipelines))
        if shape not in shapes and len(starts) < INTERLEAVE_STARTS:
            shapes.add(shape)
            starts.append((plan, pred))
        else:
            rest.append((replace(plan, schedule=INTERLEAVED), pred))
    tried = interleave_all(starts, profiles=profiles, host=host, mem_headroom=config.mem_headroom)
    for v, r in sized:
        tried += chunked_candidates(r.alternatives, v, profiles=profiles, host=host, mem_headroom=config.mem_headroom)
    elapsed = base.search_time_s + sum(r.search_time_s for _, r in sized) + time.perf_counter() - t0
    bound = base.upper_bound_tokens_per_s
    top = []
    for plan, pred in sorted([*tried, *rest], key=lambda x: x[1].step_time_s)[:config.top_k]:
        eff = pred.tokens_per_s / bound if bound > 0 else 0.0
        top.append((plan.with_meta(predicted_tokens_per_s=pred.tokens_per_s, predicted_step_time_s=pred.step_time_s,
                                   efficiency=eff, search_time_s=elapsed), pred))
    plan, pred = top[0]
    note = f"interleaved: virtual stages per pipeline {chunks_note(plan)} (v 1: the 1F1B order)"
    return replace(base, plan=plan, prediction=pred, search_time_s=elapsed, alternatives=tuple(top),
                   efficiency=pred.tokens_per_s / bound if bound > 0 else 0.0, notes=(note, *base.notes))


# Searches kept by `reused_searches`: (ids of cluster, model, profiles, host; config) -> result or error.
_REUSED: dict[tuple, tuple] | None = None


@contextlib.contextmanager
def reused_searches():
    """Within it, `make_plan` answers a search it already made (the same cluster, model, profiles and
    host objects and an equal config) with the same result or error instead of searching again.
    `hethub plan --compare` plans the schedule ``auto`` (every candidate schedule, sharded and not)
    and then each schedule's and the unsharded row on its own: without this, each of those searches
    ran twice (figures: docs/testing.md)."""
    global _REUSED
    outer, _REUSED = _REUSED, ({} if _REUSED is None else _REUSED)
    try:
        yield
    finally:
        _REUSED = outer


def make_plan(*, cluster: Cluster, model: ModelSpec, config: PlannerConfig,
              profiles: ProfileSet | None = None, host: HostModel | None = None) -> PlanResult:
    """Best memory-feasible plan under `config.strategy`, scored by the predictor (with `host`, the
    local emulation host every rank runs on, if any: ``hethub.emulation.host_model``). With schedule
    ``auto``, the best over the schedules of ``AUTO_CANDIDATES``, each planned on its own (its
    in-flight memory shapes the stages), chosen by predicted step time."""
    with _collector_paused():
        return _reused_or_made(cluster=cluster, model=model, config=config, profiles=profiles, host=host)


def _made(*, cluster: Cluster, model: ModelSpec, config: PlannerConfig,
          profiles: ProfileSet | None, host: HostModel | None) -> PlanResult:
    """The search's answer with what every answer reports (the proven bound, the one-replica note)."""
    result = _make_plan(cluster=cluster, model=model, config=config, profiles=profiles, host=host)
    result = reported(result, proven_bound(cluster=cluster, model=model, config=config, profiles=profiles))
    if config.optimizer_sharding == "zero1" and not result.plan.sharded_optimizer and ONE_REPLICA not in result.notes:
        result = replace(result, notes=(ONE_REPLICA, *result.notes))
    return result


@contextlib.contextmanager
def _collector_paused():
    """Python's cyclic garbage collector paused for a search (process-wide, restored after; nested
    calls keep it paused): a search's many cached values live until it returns, so the collector's
    passes over them free nothing. A search leaves no reference cycles (mixed.Family holds its
    searcher weakly), so reference counting frees its caches as it returns."""
    paused = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if paused:
            gc.enable()


def _reused_or_made(*, cluster: Cluster, model: ModelSpec, config: PlannerConfig,
                    profiles: ProfileSet | None, host: HostModel | None) -> PlanResult:
    if _REUSED is None:
        return _made(cluster=cluster, model=model, config=config, profiles=profiles, host=host)
    # The objects themselves are kept in the entry, so their ids cannot be reused while it lives.
    key = (id(cluster), id(model), id(profiles), id(host), config)
    if key not in _REUSED:
        try:
            _REUSED[key] = (_made(cluster=cluster, model=model, config=config, profiles=profiles, host=host),
                            None, (cluster, model, profiles, host))
        except InfeasibleError as err:
            _REUSED[key] = (None, err, (cluster, model, profiles, host))
    result, err, _ = _REUSED[key]
    if err is not None:
        raise err
    return result


def _make_plan(*, cluster: Cluster, model: ModelSpec, config: PlannerConfig,
               profiles: ProfileSet | None = None, host: HostModel | None = None) -> PlanResult:
    if config.strategy == "hethub" and config.schedule != INTERLEAVED and (
            config.schedule == AUTO_SCHEDULE or config.optimizer_sharding == "auto"
            or (config.optimizer_sharding == "zero1" and config.shard_holders < 2)):
        return _plan_variants(cluster=cluster, model=model, config=config, profiles=profiles, host=host)
    if config.schedule == AUTO_SCHEDULE:
        return _best_schedule(cluster=cluster, model=model, config=config, profiles=profiles, host=host)
    if config.schedule == INTERLEAVED and config.virtual_stages == 1:
        return _plan_interleaved(cluster=cluster, model=model, config=config, profiles=profiles, host=host)
    if config.optimizer_sharding != "none" and config.strategy in ("uniform", "flops-proportional"):
        # The baselines are plans other systems would run: unsharded (their plans are built as such).
        config = replace(config, optimizer_sharding="none")
    if config.optimizer_sharding == "auto" or (config.optimizer_sharding == "zero1" and config.shard_holders < 2):
        return _best_sharding(cluster=cluster, model=model, config=config, profiles=profiles, host=host)
    t0 = time.perf_counter()
    _check_job(model, config)
    _check_state_fits(cluster, model, config)
    books = Books()
    # Large clusters take seconds: show the phases (a bar on a terminal, log lines elsewhere).
    bar = progress(3, desc=f"plan {cluster.name}", unit="phases",
                   stream=None if cluster.num_devices >= PROGRESS_MIN_DEVICES else io.StringIO())

    def bound_part() -> BoundParts:
        return bound_parts(cluster=cluster, model=model, config=config, profiles=profiles, books=books, host=host)

    def mixed_part(s: Searcher) -> list[tuple[Plan, Prediction]]:
        # The polish's starts and the top_k alternatives are read from the first ones only.
        keep = max(config.top_k, len(POLISH_BUDGETS) if config.polish else 0)
        return score_plans(_hethub_candidates(s, config=config), profiles, host=host, headroom=config.mem_headroom,
                      keep=keep)

    mixed = None
    b = bound_part()
    parts, notes, alone, relaxed = b.parts, b.notes, b.alone, b.relaxed
    bound = sum(parts.values())
    bar.update()
    # The kind-alone plans were scored for the bound already; predict() is deterministic, so reuse it.
    if config.strategy == "homogeneous":
        scored = sorted(alone, key=lambda x: x[1].step_time_s)
    elif config.strategy == "hethub":
        # Single-kind plans are part of the space; carrying them over guarantees hethub >= homogeneous.
        if mixed is None:
            mixed = mixed_part(Searcher(cluster=cluster, model=model, config=config, profiles=profiles, books=books))
        scored = sorted([*mixed, *alone], key=lambda x: x[1].step_time_s)
    else:
        s = Searcher(cluster=cluster, model=model, config=config, profiles=profiles, books=books)
        n = config.finalists + config.top_k
        plans = [p.with_runtime(config.runtime) for _, p in baseline_plans(s, strategy=config.strategy)[:n]]
        scored = score_plans(plans, profiles, host=host, headroom=config.mem_headroom, keep=config.top_k)
    bar.update()
    if not scored:
        bar.close()
        raise InfeasibleError(infeasible_message(cluster=cluster, model=model, config=config))
    if config.strategy == "hethub" and config.polish:
        # A short local search with the predictor itself, bounded so it never dominates the search:
        # POLISH_SHARE of the search time. The best start gets at least POLISH_MIN_S, so a fast search
        # does not starve it (on large plans the budget, not a local optimum, often ends it, and each
        # step is a prediction of the whole plan).
        scored = _polished(scored, config=config, profiles=profiles, host=host)
    bar.update()
    bar.close()
    elapsed = time.perf_counter() - t0
    top = []
    for plan, pred in scored[: config.top_k]:
        eff = pred.tokens_per_s / bound if bound > 0 else 0.0
        plan = replace(plan, strategy=config.strategy).with_meta(
            strategy=config.strategy, predicted_tokens_per_s=pred.tokens_per_s,
            predicted_step_time_s=pred.step_time_s, efficiency=eff, search_time_s=elapsed,
            upper_bound_tokens_per_s=bound)
        top.append((plan, pred))
    best_plan, best_pred = top[0]
    return PlanResult(plan=best_plan, prediction=best_pred, search_time_s=elapsed, upper_bound_tokens_per_s=bound,
                      efficiency=best_pred.tokens_per_s / bound if bound > 0 else 0.0, alternatives=tuple(top),
                      notes=notes, upper_bound_by_kind=parts, relaxed_kinds=relaxed)


def _polished(scored: list[tuple[Plan, Prediction]], *, config: PlannerConfig, profiles: ProfileSet | None,
              host: HostModel | None) -> list[tuple[Plan, Prediction]]:
    """``scored`` (fastest first) with its first plans polished (POLISH_BUDGETS), fastest first."""
    polished = [polish(*cand, profiles=profiles, budget=budget, allow_recompute=config.allow_recompute,
                       allow_sp=config.sequence_parallel, host=host,
                       mem_headroom=config.mem_headroom, tp_degrees=config.tp_degrees)
                for cand, budget in zip(scored, POLISH_BUDGETS, strict=False)]
    polished = [p if not runtime_refusals(p[0]) else c for p, c in zip(polished, scored, strict=False)]
    return sorted([*polished, *scored[len(polished):]], key=lambda x: x[1].step_time_s)


def _plan_variants(*, cluster: Cluster, model: ModelSpec, config: PlannerConfig, profiles: ProfileSet | None,
                   host: HostModel | None) -> PlanResult:
    """The best plan over every variant (schedule, optimizer sharding) the config leaves open, every
    variant pricing the one enumeration's pool of shapes and each kind alone (search/variants.py)."""
    t0 = time.perf_counter()
    _check_job(model, config)
    _check_state_fits(cluster, model, config)
    variants, shardings = variants_of(config)
    names = [v.schedule for v in variants]
    links = LinkBook(cluster, runtime=config.runtime)  # one per job: hops and rings depend on the cluster
    bar = progress(len(variants) + 3, desc=f"plan {cluster.name}", unit="steps",
                   stream=None if cluster.num_devices >= PROGRESS_MIN_DEVICES else io.StringIO())
    # As many holders as devices: the loosest memory any sharded plan could have.
    enums = [v.searcher(config, cluster=cluster, model=model, profiles=profiles, links=links,
                        holders=SHARD_HOLDERS_OPTIMISM * cluster.num_devices)
             for v in enumeration_variants(variants, shardings)]
    s0 = enums[0]
    shapes, alone = _enumeration(enums, host=host)
    bar.update()
    # Sharded stages assume SHARD_HOLDERS_OPTIMISM times the best shape's replicas as holders (the
    # predictor checks every finalist with its real ones).
    holders = max(2, sum(g.count for g in shapes[0].groups)) if shapes else 2
    searchers = {v: v.searcher(config, cluster=cluster, model=model, profiles=profiles, links=links,
                               holders=SHARD_HOLDERS_OPTIMISM * holders) for v in variants}
    keep = max(config.top_k, len(POLISH_BUDGETS) if config.polish else 0)
    by_variant: dict[Variant, list[tuple[Plan, Prediction]]] = {}
    # A schedule's variants screen their plans against each other's predictions (finalists.score_plans),
    # so every schedule keeps its own best plans (the interleaving starts from 1F1B's).
    steps: dict[str, list[float]] = {v.schedule: [] for v in variants}
    for v in variants:
        pool, first = v.pool(shapes, frozenset(range(min(len(shapes), FIRST_SHAPES * len(enums)))))
        got = priced_plans(searchers[v], config=config, host=host, shapes=pool, keep=keep, firsts=len(first),
                           steps=steps[v.schedule]) if pool else []
        if v.schedule == INTERLEAVED:  # its best plans laid out in v chunks where each fits
            got = chunked_candidates(got[:INTERLEAVE_STARTS], v.chunks, profiles=profiles, host=host,
                                     mem_headroom=config.mem_headroom)
        by_variant[v] = got
        bar.update()
    # Each kind alone is part of the space (hethub >= homogeneous) and the bound's parts.
    plain = [searchers[v] for v in variants if v.schedule != INTERLEAVED and v.sharding in shardings]
    b = bound_parts(cluster=cluster, model=model, config=s0.config, profiles=profiles, books=s0.books, host=host,
                    candidates=lambda kind: alone_plans(plain, alone[kind], config=config))
    notes = list(b.notes)
    bar.update()
    scored = sorted([*(x for got in by_variant.values() for x in got), *b.alone], key=lambda x: x[1].step_time_s)
    if not scored:
        bar.close()
        raise InfeasibleError(infeasible_message(cluster=cluster, model=model, config=config))
    starts = scored[:FIRST_SHAPES]  # context parallelism offered on the best plans (predict/context_plans.py)
    scored = sorted([*scored, *cp_candidates(starts, profiles=profiles, host=host, config=config)],
                    key=lambda x: x[1].step_time_s)
    if config.polish:
        scored = _polished(scored, config=config, profiles=profiles, host=host)
    if INTERLEAVED in names:
        scored = sorted([*scored, *_interleavings(scored, config=config, profiles=profiles, host=host)],
                        key=lambda x: x[1].step_time_s)
    bar.update()
    bar.close()
    parts, relaxed = b.parts, b.relaxed
    bound = sum(parts.values())
    elapsed = time.perf_counter() - t0
    top = []
    for plan, pred in scored[:config.top_k]:
        eff = pred.tokens_per_s / bound if bound > 0 else 0.0
        plan = replace(plan, strategy="hethub").with_meta(
            strategy="hethub", predicted_tokens_per_s=pred.tokens_per_s, predicted_step_time_s=pred.step_time_s,
            efficiency=eff, search_time_s=elapsed, upper_bound_tokens_per_s=bound)
        top.append((plan, pred))
    best_plan, best_pred = top[0]
    return PlanResult(plan=best_plan, prediction=best_pred, search_time_s=elapsed, upper_bound_tokens_per_s=bound,
                      efficiency=best_pred.tokens_per_s / bound if bound > 0 else 0.0, alternatives=tuple(top),
                      notes=(*_variant_notes(scored, names, shardings), cp_note(scored, starts=starts), *notes),
                      upper_bound_by_kind=parts, relaxed_kinds=relaxed)


def _enumeration(enums: list[Searcher], *, host: HostModel | None,
                 ) -> tuple[list[Estimate], dict[str, list[Estimate]]]:
    """`variants.enumerate_shapes` and `variants.alone_shapes`, kept within `reused_searches`
    (``--compare`` asks the same ones per row)."""
    if _REUSED is None:
        return enumerate_shapes(enums), alone_shapes(enums)
    s = enums[0]
    key = ("enumeration", id(s.cluster), id(s.model), id(s.job.profiles), id(host),
           tuple(replace(e.config, top_k=1) for e in enums))
    if key not in _REUSED:
        got = enumerate_shapes(enums), alone_shapes(enums)
        _REUSED[key] = (got, None, (s.cluster, s.model, s.job.profiles, host))
    return _REUSED[key][0]


def _interleavings(scored: list[tuple[Plan, Prediction]], *, config: PlannerConfig, profiles: ProfileSet | None,
                   host: HostModel | None) -> list[tuple[Plan, Prediction]]:
    """The best 1F1B plans of distinct shapes with the interleaved schedule's v chosen per group of
    identical pipelines where it pays (search/polish.py)."""
    starts, shapes = [], set()
    for plan, pred in scored:
        if plan.schedule != ONE_F_ONE_B or plan.zero_stage == 3:  # ZeRO-3 runs no virtual stages
            continue
        shape = tuple(sorted(tuple((st.kind, len(st.devices)) for st in p.stages) for p in plan.pipelines))
        if shape not in shapes:
            shapes.add(shape)
            starts.append((plan, pred))
        if len(starts) == INTERLEAVE_STARTS:
            break
    tried = interleave_all(starts, profiles=profiles, host=host, mem_headroom=config.mem_headroom)
    return [(p, r) for p, r in tried if any(q.virtual_stages > 1 for q in p.pipelines)]


def _merged_parts(parts_by: list[dict[str, float]], relaxed_by: list[frozenset[str]],
                  ) -> tuple[dict[str, float], frozenset[str]]:
    """Each kind's best part over several bounds, a relaxed-memory part counting only where no bound
    found one that fits (`merged_bound`)."""
    fitting: dict[str, float] = {}
    relaxed: dict[str, float] = {}
    for parts, rel in zip(parts_by, relaxed_by, strict=True):
        for kind, tps in parts.items():
            into = relaxed if kind in rel else fitting
            into[kind] = max(into.get(kind, 0.0), tps)
    parts = {k: fitting.get(k, relaxed.get(k, 0.0)) for k in dict.fromkeys([*fitting, *relaxed])}
    return parts, frozenset(relaxed) - frozenset(fitting)


def _variant_notes(scored: list[tuple[Plan, Prediction]], schedules: list[str], shardings: list[str]) -> list[str]:
    """What the chosen plan's schedule and sharding beat: the best plan of each other one."""
    best = scored[0]
    notes = []
    if len(set(schedules)) > 1:
        own = {}
        for plan, pred in scored:
            own.setdefault(plan.schedule, pred.step_time_s)
        others = ", ".join(f"{n} {t:.3f} s" for n, t in own.items() if n != best[0].schedule)
        notes.append(f"schedule {best[0].schedule} chosen: predicted step {best[1].step_time_s:.3f} s"
                     + (f" vs {others}" if others else ""))
    if len(shardings) > 1:
        firsts: dict[str, tuple[Plan, Prediction]] = {}  # each sharding's best
        for p, r in scored:
            firsts.setdefault(p.optimizer_sharding, (p, r))
        others = [x for z, x in firsts.items() if z != best[0].optimizer_sharding]
        note = f"optimizer sharding: {best[0].optimizer_sharding}"
        if others:
            gain = others[0][1].step_time_s / best[1].step_time_s
            note += (f" (predicted step {best[1].step_time_s:.3f} s vs {others[0][1].step_time_s:.3f} s "
                     f"{others[0][0].optimizer_sharding}: {gain:.3f}x"
                     + "".join(f"; {p.optimizer_sharding} {r.step_time_s:.3f} s" for p, r in others[1:]) + ")")
        notes.append(note)
    return notes


def upper_bound(*, cluster: Cluster, model: ModelSpec, config: PlannerConfig,
                profiles: ProfileSet | None = None, host: HostModel | None = None) -> tuple[float, tuple[str, ...]]:
    """Sum over kinds of the best tokens/s each kind reaches alone on the same job (HETHUB's bound)."""
    _check_job(model, config)
    b = bound_parts(cluster=cluster, model=model, config=config, profiles=profiles, host=host)
    return sum(b.parts.values()), b.notes


def merged_bound(results: Iterable[PlanResult]) -> tuple[dict[str, float], frozenset[str]]:
    """Each kind's part of the bound over several searches of the same job (schedules, sharding): the
    best any of them found for that kind alone (a result's own bound covers only its own variant, so
    a plan of another variant could read above it). Also the kinds whose merged part is still a
    relaxed-memory plan."""
    done = list(results)
    return _merged_parts([r.upper_bound_by_kind or {} for r in done], [r.relaxed_kinds for r in done])


def against_bound(result: PlanResult, parts: dict[str, float], relaxed: frozenset[str] = frozenset()) -> PlanResult:
    """``result`` with its bound (``parts``; ``relaxed``: the kinds whose part is a relaxed-memory
    plan), efficiency and its alternatives' efficiencies taken against it."""
    bound = sum(parts.values())
    if bound <= 0:
        return result

    def eff(tokens_per_s: float) -> float:
        return tokens_per_s / bound

    alts = tuple((plan.with_meta(efficiency=eff(pred.tokens_per_s), upper_bound_tokens_per_s=bound), pred)
                 for plan, pred in result.alternatives)
    plan = result.plan.with_meta(efficiency=eff(result.prediction.tokens_per_s), upper_bound_tokens_per_s=bound)
    return replace(result, plan=plan, alternatives=alts, upper_bound_tokens_per_s=bound, upper_bound_by_kind=parts,
                   efficiency=eff(result.prediction.tokens_per_s), relaxed_kinds=relaxed)


def reported(result: PlanResult, bound: ProvenBound) -> PlanResult:
    """``result`` (and its alternatives, in their plans' meta) read against the proven ``bound``,
    with the ratio to the sum of its kind-alone plans and MFU beside it."""
    alone = sum((result.upper_bound_by_kind or {}).values())
    plan = result.plan

    def mfu(tokens_per_s: float) -> float:
        return cluster_mfu(cluster=plan.cluster, model=plan.model, seq_len=plan.seq_len, precision=plan.precision,
                           tokens_per_s=tokens_per_s)

    def figures(tokens_per_s: float) -> dict[str, float | None]:
        return {"upper_bound_tokens_per_s": bound.tokens_per_s, "efficiency": bound.efficiency(tokens_per_s),
                "kinds_alone_tokens_per_s": alone or None, "vs_kinds_alone": tokens_per_s / alone if alone else None,
                "mfu": mfu(tokens_per_s)}

    alts = tuple((plan.with_meta(**figures(pred.tokens_per_s)), pred) for plan, pred in result.alternatives)
    tps = result.prediction.tokens_per_s
    return replace(result, plan=result.plan.with_meta(**figures(tps)), alternatives=alts,
                   upper_bound_tokens_per_s=bound.tokens_per_s, efficiency=bound.efficiency(tps),
                   bound_by_kind=bound.by_kind, kinds_alone_tokens_per_s=alone,
                   vs_kinds_alone=tps / alone if alone else None, mfu=mfu(tps))


def _check_job(model: ModelSpec, config: PlannerConfig) -> None:
    if config.seq_len > model.max_seq_len:
        raise InfeasibleError(f"seq_len {config.seq_len} exceeds {model.name}'s max_seq_len {model.max_seq_len}. "
                              f"Fix: use --seq-len {model.max_seq_len} or less.")
    if not config.usable_micro_batch_sizes:
        raise InfeasibleError(f"no micro-batch size in {config.micro_batch_sizes} divides the global batch "
                              f"{config.global_batch}. Fix: use a global batch divisible by one of them.")


def _check_state_fits(cluster: Cluster, model: ModelSpec, config: PlannerConfig) -> None:
    """Refuse at once a model whose weights, gradients and optimizer state exceed the whole cluster's
    usable memory: no split can hold it, and the search would take minutes to find that out (llama-140b
    on the 4 local CPU devices: over a minute)."""
    state = model.num_params * sum(ModelSpec.state_bytes_per_param(config.precision).values())
    usable = sum(n * usable_bytes(cluster.kinds[k], headroom=config.mem_headroom)
                 for k, n in cluster.count_by_kind().items())
    if state > usable:
        raise InfeasibleError(infeasible_message(cluster=cluster, model=model, config=config))


def _hethub_candidates(s: Searcher, *, config: PlannerConfig) -> list[Plan]:
    return finalist_plans(s, search(s), config=config, strategy="hethub", per_size=config.per_size_finalists)


# ---- Why nothing fits, in words a person can act on.
def infeasible_message(*, cluster: Cluster, model: ModelSpec, config: PlannerConfig) -> str:
    state = model.num_params * sum(state_bytes_per_param(config.precision).values())
    counts = cluster.count_by_kind()
    usable = sum(n * usable_bytes(cluster.kinds[k], headroom=config.mem_headroom) for k, n in counts.items())
    head = (f"no {config.strategy} plan for {model.name} ({model.num_params / 1e9:.1f}B parameters, "
            f"{model.num_layers} layers) at seq_len {config.seq_len} fits cluster {cluster.name!r} "
            f"({cluster.num_devices} devices)")
    if state > usable:
        return (f"{head}: weights, gradients and Adam state alone need {state / GIB:.0f} GiB but the cluster's "
                f"usable memory is {usable / GIB:.0f} GiB. Fix: use a larger cluster or a smaller model "
                "(fewer layers or a narrower hidden size).")
    # The state fits in aggregate, so activations or per-device granularity are the problem: show
    # the smallest per-device footprint of one layer on each kind (largest TP, micro-batch 1).
    parts = []
    job = StageJob.planned(model=model, cluster=cluster, seq_len=config.seq_len, precision=config.precision,
                           profiles=None)
    for k in counts:
        tps = tp_options(cluster, model, k, config.tp_degrees)
        if not tps:
            parts.append(f"{k} has no TP degree in {config.tp_degrees} that divides its node size and the "
                         "model's heads")
            continue
        kind = cluster.kinds[k]
        one = stage_memory_of(job, kind, layers=1, embedding=False, head=False, tp=tps[-1], mbs=1, in_flight=1,
                              recompute=Recompute.of(config.allow_recompute), synced=False, neighbours=0)
        cap = usable_bytes(kind, headroom=config.mem_headroom)
        parts.append(f"one layer at TP {tps[-1]} needs {one.total_bytes / GIB:.1f} GiB per {k} device "
                     f"({describe_peak(one, limit=2)}) of {cap / GIB:.1f} GiB usable "
                     f"({config.mem_headroom:.0%} headroom)")
    fixes = ["a smaller --seq-len", "a larger cluster", "a model with fewer layers"]
    if config.schedule != AUTO_SCHEDULE and get_schedule(config.schedule).max_in_flight(stage=0, num_stages=1) is None:
        bounded = [n for n in SCHEDULES if get_schedule(n).max_in_flight(stage=0, num_stages=1) is not None]
        fixes.insert(0, f"schedule {' or '.join(bounded)} ({config.schedule} keeps every micro-batch's activations)")
    if not config.allow_recompute:
        fixes.insert(0, "allowing activation recomputation")
    if config.strategy in ("uniform", "flops-proportional"):
        fixes.insert(0, "strategy hethub (it may leave devices out and splits layers unevenly)")
    return f"{head}: {'; '.join(parts)}. Fix: try {', or '.join(fixes)}."
