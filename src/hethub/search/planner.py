"""The planner's entry points: make_plan and upper_bound.

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
from hethub.plan import Plan
from hethub.predict.host import HostModel
from hethub.predict.memory import usable_bytes
from hethub.predict.predictor import predict
from hethub.predict.profiles import ProfileSet
from hethub.predict.result import Prediction
from hethub.progress import progress
from hethub.schedules import AUTO_CANDIDATES, AUTO_SCHEDULE
from hethub.search.baselines import baseline_plans
from hethub.search.config import PlannerConfig
from hethub.search.diagnose import infeasible_message
from hethub.search.finalists import finalist_plans, score_plans
from hethub.search.hetero import prepare_size, search
from hethub.search.interleave import chunked_candidates, chunks_note, interleave_all
from hethub.search.kind_alone import BoundParts, bound_parts
from hethub.search.parallel import FORK_AVAILABLE, Forked, usable_cpus
from hethub.search.polish import polish
from hethub.search.recompute import choose_recompute
from hethub.search.templates import Books, Searcher
from hethub.spec.cluster import Cluster
from hethub.spec.model import ModelSpec

ONE_F_ONE_B, INTERLEAVED = "1f1b", "interleaved"
INTERLEAVE_STARTS = 3  # the best 1F1B plans of distinct shapes tried with virtual stages
INTERLEAVE_POOL = 6  # 1F1B plans (predicted anyway as finalists) the starts are chosen among
SIZED_CHUNKS = (2,)  # v the search also sizes stages for (each a search of its own, so one)
POLISH_MIN_S = 0.25  # the best polish start's least budget; the runners-up get only POLISH_SHARE of the search
# The polish's budget as a share of the search time (docs/planner.md: a quarter until its moves were
# screened by a step floor, which halved the predictions it needs on 512 devices).
POLISH_SHARE = 0.1
SHARD_HOLDERS_OPTIMISM = 8  # see _best_sharding
POLISH_STARTS = 3  # candidates polished, best first, while the budget lasts
PROGRESS_MIN_DEVICES = 256  # smaller clusters plan in well under a second
# Devices from which a forked child runs the bound's searches (and the template scans of every
# micro-batch size but the smallest) beside the mixed search: smaller clusters plan in about a second,
# and there the parent gains about half what the child costs (docs/planner.md, "Two processes").
FORK_MIN_DEVICES = 256


@dataclass(frozen=True)
class PlanResult:
    plan: Plan
    prediction: Prediction
    search_time_s: float
    upper_bound_tokens_per_s: float
    efficiency: float  # prediction.tokens_per_s / upper bound
    alternatives: tuple[tuple[Plan, Prediction], ...]  # top-k, best first, including the best
    notes: tuple[str, ...]
    # Each kind's part of the upper bound: the best tokens/s it reaches alone (docs/planner.md).
    upper_bound_by_kind: dict[str, float] | None = None
    # Kinds whose part is a plan with the memory limit relaxed (none of its own plans fit).
    relaxed_kinds: frozenset[str] = frozenset()


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
    for name in AUTO_CANDIDATES:
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
    """ZeRO-1 as an outer option: plan unsharded, then sharded, and keep the faster predicted
    (``auto``) or the sharded one (``zero1``). The search checks a sharded stage's memory before its
    replicas are chosen, so it assumes each parameter group has ``SHARD_HOLDERS_OPTIMISM`` times as
    many holders as the unsharded plan has pipelines: optimistic, so that shallower pipelines, fewer
    recomputed stages or bigger micro-batches are tried; the predictor re-scores every finalist with
    its real holders and slices and drops those that do not fit (measured: with exactly the unsharded
    plan's replica count the search missed the better sharded plans on both README clusters). If none
    fits, it plans again assuming the unsharded plan's count. Sharding pays where the freed memory
    buys such a change; otherwise its reduce-scatter + all-gather costs about the all-reduce (padded
    slices inside an island; a two-level exchange across vendors' bridges) and the unsharded plan stays."""
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
    if base is not None:
        zero = _with_unsharded_layouts(zero, base, config=config, profiles=profiles, host=host)
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


def _with_unsharded_layouts(zero: PlanResult, base: PlanResult, *, config: PlannerConfig,
                            profiles: ProfileSet | None, host: HostModel | None) -> PlanResult:
    """The sharded search's plans plus the unsharded search's, sharded as they are with each stage's
    recomputation chosen again (the freed memory may let a stage recompute less). The sharded search
    checks memory with assumed holders, so its finalists can miss the unsharded layouts (hethub-768,
    ZB-H1: 96.48 s searched vs 95.17 s for the best unsharded layout sharded)."""
    extra = []
    for plan, _ in base.alternatives:
        sharded = choose_recompute(replace(plan, optimizer_sharding="zero1", optimizer_shares=config.optimizer_shares),
                                   allow_recompute=config.allow_recompute, mem_headroom=config.mem_headroom)
        pred = predict(sharded, profiles=profiles, host=host, mem_headroom=config.mem_headroom)
        if pred.fits_memory:
            extra.append((sharded, pred))
    if not extra or min(p.step_time_s for _, p in extra) >= zero.prediction.step_time_s:
        return zero
    bound = zero.upper_bound_tokens_per_s
    top = sorted([*zero.alternatives, *extra], key=lambda x: x[1].step_time_s)[:config.top_k]
    top = [(plan.with_meta(predicted_tokens_per_s=pred.tokens_per_s, predicted_step_time_s=pred.step_time_s,
                           efficiency=pred.tokens_per_s / bound if bound > 0 else 0.0), pred) for plan, pred in top]
    return replace(zero, plan=top[0][0], prediction=top[0][1], alternatives=tuple(top),
                   efficiency=top[0][1].tokens_per_s / bound if bound > 0 else 0.0,
                   notes=("optimizer sharding: the best unsharded layout, sharded, beat the sharded search's",
                          *zero.notes))


def _plan_interleaved(*, cluster: Cluster, model: ModelSpec, config: PlannerConfig, profiles: ProfileSet | None,
                      host: HostModel | None, base: PlanResult | None = None) -> PlanResult:
    """The interleaved schedule's plan: the 1F1B plans (``base``, if already made) interleaved, and,
    for the hethub strategy, searches with stages sized for v chunks (search/interleave.py)."""
    if base is None:
        base = make_plan(cluster=cluster, model=model, profiles=profiles, host=host,
                         config=replace(config, schedule=ONE_F_ONE_B, top_k=max(config.top_k, INTERLEAVE_POOL)))
    sized = []
    if config.strategy == "hethub":
        # Stages sized for v chunks' activations (the split's memory and closed form take v).
        for v in SIZED_CHUNKS:
            try:
                sized.append((v, make_plan(cluster=cluster, model=model, profiles=profiles, host=host,
                                           config=replace(config, schedule=INTERLEAVED, virtual_stages=v,
                                                          polish=False, top_k=max(config.top_k, INTERLEAVE_STARTS)))))
            except InfeasibleError:
                pass
    return _interleaved(base, config=replace(config, schedule=INTERLEAVED), profiles=profiles, host=host, sized=sized)


def _interleaved(base: PlanResult, *, config: PlannerConfig, profiles: ProfileSet | None,
                 host: HostModel | None, sized: Sequence[tuple[int, PlanResult]] = ()) -> PlanResult:
    """``base`` (planned under 1F1B) with the interleaved schedule's v chosen per pipeline where the
    predictor finds it faster within memory (search/interleave.py); and the plans of ``sized``,
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


@contextlib.contextmanager
def _collector_paused():
    """Python's cyclic garbage collector paused for a search (process-wide, restored after; nested
    calls keep it paused). A search builds ~10^5 cached values that live until it returns and
    allocates millions of short-lived ones that reference counting frees: the collector's passes
    over the live caches found nothing to free and took ~15 % of a 512-device search (three full
    passes, ~0.15 s). A search leaves no reference cycles (families.Family holds its searcher weakly),
    so reference counting frees its caches as it returns."""
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
        return _make_plan(cluster=cluster, model=model, config=config, profiles=profiles, host=host)
    # The objects themselves are kept in the entry, so their ids cannot be reused while it lives.
    key = (id(cluster), id(model), id(profiles), id(host), config)
    if key not in _REUSED:
        try:
            _REUSED[key] = (_make_plan(cluster=cluster, model=model, config=config, profiles=profiles, host=host),
                            None, (cluster, model, profiles, host))
        except InfeasibleError as err:
            _REUSED[key] = (None, err, (cluster, model, profiles, host))
    result, err, _ = _REUSED[key]
    if err is not None:
        raise err
    return result


def _make_plan(*, cluster: Cluster, model: ModelSpec, config: PlannerConfig,
               profiles: ProfileSet | None = None, host: HostModel | None = None) -> PlanResult:
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
        keep = max(config.top_k, POLISH_STARTS if config.polish else 0)
        return score_plans(_hethub_candidates(s, config=config), profiles, host=host, headroom=config.mem_headroom,
                      keep=keep)

    mixed = None
    if config.strategy == "hethub" and _forks(cluster, config):
        # The child scans the mixed search's templates (kind, micro-batch size) of every size but the
        # smallest and prepares the second size, sends them, then runs the bound; the parent scans the
        # smallest and searches it meanwhile, then takes the child's answer (hetero.search) and searches on.
        s = Searcher(cluster=cluster, model=model, config=config, profiles=profiles, books=books)
        sizes = config.usable_micro_batch_sizes
        theirs = [(k, b) for b in sizes[1:] for k in s.counts]

        def scans() -> tuple:  # the second size's bar-free part first: its splits change the scans it sends
            prepared = prepare_size(s, sizes[1]) if len(sizes) > 1 else None
            return s.pure_scans(theirs), prepared

        with Forked(scans=scans, bound=bound_part) as child:
            try:
                s.pure_scans([(k, sizes[0]) for k in s.counts])
                s.scans_elsewhere = lambda: child.result("scans")
                mixed = mixed_part(s)
            except Exception:
                child.result("bound")  # the bound's error first, as one process raises it
                raise
            parts, notes, alone, relaxed = child.result("bound")
    else:
        parts, notes, alone, relaxed = bound_part()
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
        scored = score_plans([plan for _, plan in baseline_plans(s, strategy=config.strategy)[:n]], profiles, host=host,
                        headroom=config.mem_headroom, keep=config.top_k)
    bar.update()
    if not scored:
        bar.close()
        raise InfeasibleError(infeasible_message(cluster=cluster, model=model, config=config))
    if config.strategy == "hethub" and config.polish:
        # A short local search with the predictor itself, bounded so it never dominates the search:
        # POLISH_SHARE of the search time. The best start gets at least POLISH_MIN_S, so a fast search
        # does not starve it (on large plans the budget, not a local optimum, often ends it, and each
        # step is a prediction of the whole plan).
        share_s = POLISH_SHARE * (time.perf_counter() - t0)
        start = time.perf_counter()
        polished = []
        # The runners-up while the share lasts, where the best reached its local optimum early (small
        # plans): polish moves layers and never swaps a template for another, so a runner-up a little
        # slower as scored may polish to the better plan.
        for cand in scored[:POLISH_STARTS]:
            end = start + (share_s if polished else max(POLISH_MIN_S, share_s))
            left = end - time.perf_counter()
            if polished and left <= 0:
                break
            polished.append(polish(*cand, profiles=profiles, budget_s=max(left, 0.0),
                                   allow_recompute=config.allow_recompute, host=host,
                                   mem_headroom=config.mem_headroom))
        scored = sorted([*polished, *scored[len(polished):]], key=lambda x: x[1].step_time_s)
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


def upper_bound(*, cluster: Cluster, model: ModelSpec, config: PlannerConfig,
                profiles: ProfileSet | None = None, host: HostModel | None = None) -> tuple[float, tuple[str, ...]]:
    """Sum over kinds of the best tokens/s each kind reaches alone on the same job (HETHUB's bound)."""
    _check_job(model, config)
    parts, notes, _, _ = bound_parts(cluster=cluster, model=model, config=config, profiles=profiles, host=host)
    return sum(parts.values()), notes


def merged_bound(results: Iterable[PlanResult]) -> tuple[dict[str, float], frozenset[str]]:
    """Each kind's part of the bound over several searches of the same job (schedules, sharding): the
    best any of them found for that kind alone. A result's own bound covers only its own variant, so
    a plan of another variant could beat it (hethub-768: the 1F1B-sharded plan read 1.009 against the
    1F1B-sharded bound, 0.877 against the ZB-H1-sharded one). Also the kinds whose merged part is
    still a relaxed-memory plan."""
    fitting: dict[str, float] = {}
    relaxed: dict[str, float] = {}
    for r in results:
        for kind, tps in (r.upper_bound_by_kind or {}).items():
            into = relaxed if kind in r.relaxed_kinds else fitting
            into[kind] = max(into.get(kind, 0.0), tps)
    # A relaxed-memory plan is no plan: it counts only where no search found one that fits (hethub-768:
    # the sharded search's mi250x part was relaxed, 1.5x the unsharded search's fitting one).
    parts = {k: fitting.get(k, relaxed.get(k, 0.0)) for k in dict.fromkeys([*fitting, *relaxed])}
    return parts, frozenset(relaxed) - frozenset(fitting)


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


def _forks(cluster: Cluster, config: PlannerConfig) -> bool:
    """Whether make_plan runs the bound in a second process (search/parallel.py): where fork exists,
    the config allows it, the cluster is large enough to gain from it (FORK_MIN_DEVICES) and this
    process may run on two CPUs."""
    return (FORK_AVAILABLE and config.search_processes >= 2 and cluster.num_devices >= FORK_MIN_DEVICES
            and usable_cpus() >= 2)


def _hethub_candidates(s: Searcher, *, config: PlannerConfig) -> list[Plan]:
    return finalist_plans(s, search(s), config=config, strategy="hethub", per_size=config.per_size_finalists)
