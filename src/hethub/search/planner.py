"""The planner's entry points: make_plan and upper_bound.

Every result is reported against the job's proven upper bound (predict/proven_bound.py), so its
``efficiency`` is at most 1 whichever variants ran; the sum of kind-alone plans (HETHUB's
reference) is reported beside it as ``vs_kinds_alone``.

The search ranks candidates in closed form (fast, approximate); the final choice among the best
is made by the full predictor, so `hethub plan` and `hethub predict` agree exactly on the result.
"""

from __future__ import annotations

import contextlib
import io
import time
from dataclasses import dataclass, replace
from functools import partial

from hethub.errors import InfeasibleError
from hethub.fanout import fan_out, sharing
from hethub.memo import search_scope
from hethub.plan import Plan, Recompute, zero_stage_of
from hethub.predict.context_plans import cp_candidates, cp_note
from hethub.predict.host import HostModel
from hethub.predict.interleave import chunked_candidates, interleave_plan
from hethub.predict.memory import describe_peak, state_bytes_per_param, usable_bytes
from hethub.predict.profiles import ProfileSet
from hethub.predict.proven_bound import ProvenBound, proven_bound
from hethub.predict.result import Prediction
from hethub.predict.scoring import Firsts, Screen, score_plans, sharding_of
from hethub.predict.stage_cost import StageJob, stage_memory_of
from hethub.predict.stage_links import LinkBook
from hethub.predict.utilisation import cluster_mfu
from hethub.progress import progress
from hethub.runtimes import runtime_profile, runtime_refusals
from hethub.schedules import AUTO_SCHEDULE, SCHEDULES, get_schedule
from hethub.search.baselines import baseline_plans
from hethub.search.combine import Estimate
from hethub.search.config import PlannerConfig
from hethub.search.finalists import BoundParts, kind_parts
from hethub.search.polish import polish
from hethub.search.templates import Searcher, tp_options
from hethub.search.variants import (
    Variant,
    alone_plans,
    enumerate_shapes,
    enumeration_variants,
    priced_plans,
    variants_of,
)
from hethub.spec.cluster import Cluster
from hethub.spec.kind import GIB
from hethub.spec.model import ModelSpec

ONE_F_ONE_B, INTERLEAVED = "1f1b", "interleaved"
BASELINES = ("uniform", "flops-proportional")  # other systems' layouts (search/baselines.py)
INTERLEAVE_STARTS = 3  # the best 1F1B plans of distinct shapes tried with virtual stages
# Predictions the polish may make from each of its starts, best first, on a plan of up to
# POLISH_FULL_DEVICES devices: the runners-up too, since polish moves layers and never swaps a
# template for another, so a runner-up a little slower as scored may polish to the better plan.
POLISH_BUDGETS = (16, 6, 6)
POLISH_FULL_DEVICES = 1024
SHARD_HOLDERS_OPTIMISM = 8  # sharded stages' assumed holders: this times the unsharded best's replicas
FIRST_SHAPES = 3  # each enumeration's best shapes, laid out and predicted under every variant
PROGRESS_MIN_DEVICES = 256  # smaller clusters plan in well under a second
ONE_REPLICA = ("optimizer sharding: none, although {0} was asked: the plan has one replica, so each parameter "
               "has a single holder and {0} has nothing to shard across (as Megatron's distributed optimizer "
               "at data-parallel size 1); more devices or a smaller model give replicas to shard over")


@dataclass(frozen=True)
class PlanResult:
    plan: Plan
    prediction: Prediction
    search_time_s: float
    # The proven bound (predict/proven_bound.py) and the plan's tokens/s over it, set by make_plan.
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


@dataclass(frozen=True)
class EnumerationKey:
    """A job's enumeration in `reused_searches`: cluster, model, profiles and host by id, and its configs."""
    ids: tuple[int, ...]
    configs: tuple[PlannerConfig, ...]


@dataclass
class Enumerated:
    """Its kind-alone shapes, its mixed ones once asked, and the keyed objects (so no id is reused)."""
    alone: dict[str, list[Estimate]]
    held: tuple[object, ...]
    mixed: list[Estimate] | None = None


_REUSED: dict[EnumerationKey, Enumerated] | None = None  # the enumerations `reused_searches` keeps


@contextlib.contextmanager
def reused_searches():
    """Within it, `make_plan` enumerates a job's shapes once per enumeration config (the same cluster,
    model, profiles and host objects): `hethub plan --compare`'s rows share the ones they have in common."""
    global _REUSED
    outer, _REUSED = _REUSED, ({} if _REUSED is None else _REUSED)
    try:
        with search_scope():  # the rows' memos too
            yield
    finally:
        _REUSED = outer


def make_plan(*, cluster: Cluster, model: ModelSpec, config: PlannerConfig,
              profiles: ProfileSet | None = None, host: HostModel | None = None) -> PlanResult:
    """Best memory-feasible plan under `config.strategy` over every schedule and optimizer sharding the
    config leaves open (`_make_plan`), scored by the predictor (with `host`, the local emulation host
    every rank runs on, if any: ``hethub.emulation.host_model``), read against the proven bound."""
    with search_scope(), sharing(cluster, model, profiles, host):
        result = _make_plan(cluster=cluster, model=model, config=config, profiles=profiles, host=host)
        result = reported(result, job_bound(cluster=cluster, model=model, config=config, profiles=profiles))
    if (z := config.optimizer_sharding) not in ("none", "auto") and not result.plan.sharded_optimizer:
        result = replace(result, notes=(ONE_REPLICA.format(z), *result.notes))
    return result


def _refined(scored: list[tuple[Plan, Prediction]], *, polish: bool, interleave: bool, config: PlannerConfig,
             profiles: ProfileSet | None, host: HostModel | None) -> list[tuple[Plan, Prediction]]:
    """``scored`` (fastest first) with its first plans polished where ``polish`` (`polish_budget`) and then,
    where ``interleave``, the best 1F1B plans laid out in chunks (`interleave_plan` on `_interleave_starts`),
    fastest first. The chunkings of the starts as they stand before the polish run beside it, in one
    fan-out; only those of starts the polish changed run after it: the plans of polishing first."""
    starts = _interleave_starts(scored) if interleave else []
    n = len(POLISH_BUDGETS) if polish else 0
    got = fan_out([*(partial(_polish, i, cand, config=config, profiles=profiles, host=host)
                     for i, cand in enumerate(scored[:n])),
                   *(partial(_chunked, x, config=config, profiles=profiles, host=host) for x in starts)])
    if polish:
        polished = got[:len(scored[:n])]
        scored = sorted([*polished, *scored[len(polished):]], key=lambda x: x[1].step_time_s)
    if not interleave:
        return scored
    # By value: a start the polish kept comes back from a worker as an equal copy.
    early = list(zip((x[0] for x in starts), got[len(got) - len(starts):], strict=True))
    now = [(x, next((r for p, r in early if p == x[0]), None)) for x in _interleave_starts(scored)]
    late = iter(fan_out([partial(_chunked, x, config=config, profiles=profiles, host=host)
                         for x, r in now if r is None]))
    tried = [next(late) if r is None else r for _, r in now]
    chunked = [(p, r) for p, r in tried if any(q.virtual_stages > 1 for q in p.pipelines)]
    return sorted([*scored, *chunked], key=lambda x: x[1].step_time_s)


def _polish(start: int, cand: tuple[Plan, Prediction], *, config: PlannerConfig, profiles: ProfileSet | None,
            host: HostModel | None) -> tuple[Plan, Prediction]:
    """``cand``, the ``start``-th best, polished (`polish.polish`); unpolished where its runtime refuses the result."""
    got = polish(*cand, profiles=profiles, budget=polish_budget(start, cand[0]), host=host,
                 allow_recompute=config.allow_recompute, allow_sp=config.sequence_parallel,
                 mem_headroom=config.mem_headroom, tp_degrees=config.tp_degrees)
    return cand if runtime_refusals(got[0]) else got


def _chunked(start: tuple[Plan, Prediction], *, config: PlannerConfig, profiles: ProfileSet | None,
             host: HostModel | None) -> tuple[Plan, Prediction]:
    """A 1F1B plan with the interleaved schedule's v chosen per group of identical pipelines where it pays."""
    return interleave_plan(*start, profiles=profiles, host=host, mem_headroom=config.mem_headroom)


def polish_budget(start: int, plan: Plan) -> int:
    """Predictions the polish may make from its ``start``-th start (0: the best), ``plan``: its
    `POLISH_BUDGETS` entry, scaled down on plans of more than `POLISH_FULL_DEVICES` devices, as a
    prediction's cost grows with the plan's devices (its pipelines' timelines, its ranks' memory),
    so that the polish stays a bounded share of the search; at least one. Counted in predictions
    and fixed by the plan, the same plan comes out however busy the machine is."""
    return max(1, POLISH_BUDGETS[start] * POLISH_FULL_DEVICES // max(plan.world_size, POLISH_FULL_DEVICES))


def _make_plan(*, cluster: Cluster, model: ModelSpec, config: PlannerConfig, profiles: ProfileSet | None,
               host: HostModel | None) -> PlanResult:
    """The best plan of ``config.strategy`` over every variant (schedule, optimizer sharding) the
    config leaves open (one where it fixes both), every variant pricing the one enumeration's pool of
    shapes and each kind alone (search/variants.py). The baselines price their own layouts
    (search/baselines.py) unsharded, as the systems they stand for build them; homogeneous prices
    each kind alone under every variant."""
    if config.strategy in BASELINES:
        config = replace(config, optimizer_sharding="none")
    t0 = time.perf_counter()
    _check_job(model, config, cluster)
    variants, shardings = variants_of(config)
    names = list(runtime_profile(config.runtime).auto_schedules) if config.schedule == AUTO_SCHEDULE \
        else [config.schedule]  # the schedules open (the baselines' interleaving has no variant)
    links = LinkBook(cluster, runtime=config.runtime)  # one per job: hops and rings depend on the cluster
    bar = progress(len(variants) + len(cluster.kind_names) + 2, desc=f"plan {cluster.name}", unit="steps",
                   stream=None if cluster.num_devices >= PROGRESS_MIN_DEVICES else io.StringIO())
    # As many holders as devices: the loosest memory any sharded plan could have.
    enums = [v.searcher(config, cluster=cluster, model=model, profiles=profiles, links=links,
                        holders=SHARD_HOLDERS_OPTIMISM * cluster.num_devices)
             for v in enumeration_variants(variants, shardings)]
    shapes, alone = _enumeration(enums, host=host, mixed=config.strategy == "hethub")
    bar.update()
    # Sharded stages assume SHARD_HOLDERS_OPTIMISM times the best shape's replicas as holders (the
    # predictor checks every finalist with its real ones).
    bests = shapes[:1] or [a[0] for a in alone.values() if a]
    holders = max([2, *(sum(g.count for g in e.groups) for e in bests)])
    searchers = {v: v.searcher(config, cluster=cluster, model=model, profiles=profiles, links=links,
                               holders=SHARD_HOLDERS_OPTIMISM * holders) for v in variants}
    keep = max(config.top_k, len(POLISH_BUDGETS) if config.polish else 0)
    firsts = frozenset(range(min(len(shapes), FIRST_SHAPES * len(enums))))

    def schedule_plans(group: list[Variant]) -> list[list[tuple[Plan, Prediction]]]:
        steps, out = [], []  # its variants, in order, screen by each other's predictions (scoring.Screen)
        starts = Firsts(INTERLEAVE_STARTS, start_shape)  # 1F1B's, of distinct shapes, over the group
        for v in group:  # a sharding the config asks for prices the whole pool; one priced beside them, its part
            pool, first = (shapes, firsts) if v.sharding in shardings else v.pool(shapes, firsts)
            own = len(enums) == 1 and searchers[v].config == enums[0].config  # the pool's one enumeration is v's
            screen = Screen(keep, host, steps, _kept_firsts(v, names, starts))
            got = priced_plans(searchers[v], config=config, shapes=pool, screen=screen, firsts=len(first),
                               own=own) if pool else []
            if config.strategy in BASELINES:
                plans = [p.with_runtime(config.runtime) for p in baseline_plans(searchers[v], strategy=config.strategy)]
                got = score_plans(plans[:config.finalists + config.top_k], profiles, host=host,
                                  headroom=config.mem_headroom, keep=keep)
            elif config.strategy == "homogeneous" and v.sharding in shardings:  # each kind alone under the variant
                plans = (p for ests in alone.values() for p in alone_plans([searchers[v]], ests, config=config,
                                                                            bar=screen.bar))
                got = score_plans(plans, profiles, host=host, headroom=config.mem_headroom, screen=screen)
            if v.schedule == INTERLEAVED:  # its best plans laid out in v chunks where each fits
                got = chunked_candidates(got[:INTERLEAVE_STARTS], v.chunks, profiles=profiles, host=host,
                                         mem_headroom=config.mem_headroom)
            out.append(got)
        return out

    # Each kind alone is part of the space (hethub >= homogeneous) and the bound's parts.
    plain = [searchers[v] for v in variants if v.schedule != INTERLEAVED and v.sharding in shardings]
    parts = kind_parts(cluster=cluster, model=model, config=enums[0].config, profiles=profiles, books=enums[0].books,
                       host=host, candidates=lambda kind, bar: alone_plans(plain, alone[kind], config=config, bar=bar))
    # Side by side (hethub.fanout): each schedule's variants, then each kind's part of the bound.
    groups = [[v for v in variants if v.schedule == n] for n in dict.fromkeys(v.schedule for v in variants)]
    got = fan_out([partial(schedule_plans, g) for g in groups] + parts,
                  order=task_order(len(groups), [len(alone.get(k, ())) for k in cluster.kind_names]),
                  done=lambda i, _: bar.update(len(groups[i]) if i < len(groups) else 1))
    by_variant = {v: x for g, xs in zip(groups, got, strict=False) for v, x in zip(g, xs, strict=True)}
    own, b = [x for v in variants for x in by_variant[v]], BoundParts.of(got[len(groups):])
    hethub = config.strategy == "hethub"
    scored = sorted([*own, *b.alone] if hethub else own, key=lambda x: x[1].step_time_s)
    # offered context parallelism (predict/context_plans.py)
    starts = scored[:FIRST_SHAPES] if hethub and config.context_parallel else []
    scored = sorted([*scored, *cp_candidates(starts, profiles=profiles, host=host, config=config)],
                    key=lambda x: x[1].step_time_s)
    scored = _refined(scored, polish=config.polish and hethub, interleave=INTERLEAVED in names, config=config,
                      profiles=profiles, host=host)
    if config.schedule == INTERLEAVED:  # the 1F1B plans are the interleaved schedule's at v 1
        scored = [(replace(p, schedule=INTERLEAVED), r) for p, r in scored if p.zero_stage < 3]
    bar.update()
    bar.close()
    if not scored:
        raise InfeasibleError(infeasible_message(cluster=cluster, model=model, config=config))
    notes = [*_variant_notes(scored, names, shardings), cp_note(scored, starts=starts) if hethub else ""]
    if config.schedule == INTERLEAVED:
        v = ", ".join(str(p.virtual_stages) for p in scored[0][0].pipelines)
        notes = [f"interleaved: virtual stages per pipeline v {v} (v 1: the 1F1B order)", *notes]
    elapsed = time.perf_counter() - t0
    # Bound and efficiency: `reported`'s (the proven bound).
    top = tuple((replace(plan, strategy=config.strategy).with_meta(
        strategy=config.strategy, predicted_tokens_per_s=pred.tokens_per_s, predicted_step_time_s=pred.step_time_s,
        search_time_s=elapsed), pred) for plan, pred in scored[:config.top_k])
    return PlanResult(plan=top[0][0], prediction=top[0][1], search_time_s=elapsed, upper_bound_tokens_per_s=0.0,
                      efficiency=0.0, alternatives=top, notes=(*(n for n in notes if n), *b.notes),
                      upper_bound_by_kind=b.parts, relaxed_kinds=b.relaxed)


def task_order(n_groups: int, pools: list[int]) -> list[int]:
    """The start order of the fan-out of ``n_groups`` variant groups then a kind part per entry of ``pools``
    (its kind-alone shapes): the groups as given (the longest tasks), then the parts, the largest pool
    first (a part's time is mostly its pool repriced under every plain variant), so that the last task
    to start is a short one and the workers end together; ties in kind order. It changes only which
    worker runs a task, never a result (hethub.fanout)."""
    return [*range(n_groups), *sorted(range(n_groups, n_groups + len(pools)), key=lambda i: -pools[i - n_groups])]


def _enumeration(enums: list[Searcher], *, host: HostModel | None, mixed: bool,
                 ) -> tuple[list[Estimate], dict[str, list[Estimate]]]:
    """`variants.enumerate_shapes` (mixed shapes only if ``mixed``), kept within `reused_searches`
    (``--compare``'s rows ask the same ones; the strategy changes neither)."""
    if _REUSED is None:
        return enumerate_shapes(enums, mixed=mixed)
    held = (enums[0].cluster, enums[0].model, enums[0].job.profiles, host)
    key = EnumerationKey(tuple(map(id, held)), tuple(replace(e.config, top_k=1, strategy="hethub") for e in enums))
    if (got := _REUSED.get(key)) is None or (mixed and got.mixed is None):
        shapes, alone = enumerate_shapes(enums, mixed=mixed, alone=got is None)
        got = _REUSED[key] = Enumerated(alone=got.alone if got else alone, held=held, mixed=shapes if mixed else None)
    return (got.mixed or []) if mixed else [], got.alone


def _interleave_starts(scored: list[tuple[Plan, Prediction]]) -> list[tuple[Plan, Prediction]]:
    """What `_refined` lays out in chunks: the first `INTERLEAVE_STARTS` 1F1B plans of distinct shapes
    (`start_shape`) in ``scored`` (ZeRO-3 runs no virtual stages)."""
    starts, shapes = [], set()
    for plan, pred in scored:
        if plan.schedule != ONE_F_ONE_B or plan.zero_stage == 3:
            continue
        if (shape := start_shape(plan)) not in shapes:
            shapes.add(shape)
            starts.append((plan, pred))
        if len(starts) == INTERLEAVE_STARTS:
            break
    return starts


def start_shape(plan: Plan) -> tuple:
    """What `_interleave_starts` tells its starts apart by: each pipeline's stages' kinds and device counts."""
    return tuple(sorted(tuple((st.kind, len(st.devices)) for st in p.stages) for p in plan.pipelines))


def _kept_firsts(v: Variant, names: list[str], starts: Firsts) -> tuple[Firsts, ...]:
    """What a variant's scoring keeps exact besides its schedule's first few (`scoring.Screen`): its best
    of each optimizer sharding (`_variant_notes`; a sharded variant's plans of one replica are unsharded),
    and the plans read past those: an interleaved variant's first `INTERLEAVE_STARTS` (`chunked_candidates`)
    and, where the interleaved schedule is open, 1F1B's ``starts`` (`_interleave_starts`)."""
    if v.schedule == INTERLEAVED:
        return (Firsts(INTERLEAVE_STARTS),)
    own = Firsts(2, sharding_of)  # its sharding's and the unsharded
    if v.schedule == ONE_F_ONE_B and INTERLEAVED in names and zero_stage_of(v.sharding) < 3:
        return own, starts
    return (own,)


def _variant_notes(scored: list[tuple[Plan, Prediction]], schedules: list[str], shardings: list[str]) -> list[str]:
    """What the chosen plan's schedule and sharding beat: the best plan of each other one."""
    best = scored[0]
    notes = []
    if len(set(schedules)) > 1:
        own = {}
        for plan, pred in scored:
            own.setdefault(plan.schedule, pred.step_time_s)
        others = ", ".join(f"{n} {t:.3f} s" for n, t in own.items() if n != best[0].schedule)
        # Under auto the interleaved plans are the best 1F1B plans' chunkings that pay (_refined).
        unpaid = "; interleaved: no chunking of the best 1F1B plans pays" if INTERLEAVED in schedules \
            and INTERLEAVED not in own else ""
        notes.append(f"schedule {best[0].schedule} chosen: predicted step {best[1].step_time_s:.3f} s"
                     + (f" vs {others}" if others else "") + unpaid)
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
    b = BoundParts.of(fan_out(kind_parts(cluster=cluster, model=model, config=config, profiles=profiles, host=host)))
    return sum(b.parts.values()), b.notes


def job_bound(*, cluster: Cluster, model: ModelSpec, config: PlannerConfig,
              profiles: ProfileSet | None = None) -> ProvenBound:
    """The proven bound (predict/proven_bound.py) over the plans the config's search may write."""
    return proven_bound(cluster=cluster, model=model, seq_len=config.seq_len, precision=config.precision,
                        tp_by_kind={k: tp_options(cluster, model, k, config.tp_degrees) for k in cluster.kind_names},
                        micro_batch_sizes=config.micro_batch_sizes, profiles=profiles)


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


def _check_job(model: ModelSpec, config: PlannerConfig, cluster: Cluster | None = None) -> None:
    """Refuse at once what no plan can run, with the fix; with ``cluster``, also a model whose weights,
    gradients and optimizer state exceed the whole cluster's usable memory (the search would take
    minutes to find that no split holds it)."""
    if config.seq_len > model.max_seq_len:
        raise InfeasibleError(f"seq_len {config.seq_len} exceeds {model.name}'s max_seq_len {model.max_seq_len}. "
                              f"Fix: use --seq-len {model.max_seq_len} or less.")
    if not config.usable_micro_batch_sizes:
        raise InfeasibleError(f"no micro-batch size in {config.micro_batch_sizes} divides the global batch "
                              f"{config.global_batch}. Fix: use a global batch divisible by one of them.")
    if cluster is not None and _state_bytes(model, config) > _usable_bytes(cluster, config):
        raise InfeasibleError(infeasible_message(cluster=cluster, model=model, config=config))


def _state_bytes(model: ModelSpec, config: PlannerConfig) -> float:
    return model.num_params * sum(state_bytes_per_param(config.precision).values())


def _usable_bytes(cluster: Cluster, config: PlannerConfig) -> float:
    return sum(n * usable_bytes(cluster.kinds[k], headroom=config.mem_headroom)
               for k, n in cluster.count_by_kind().items())


# ---- Why nothing fits, in words a person can act on.
def infeasible_message(*, cluster: Cluster, model: ModelSpec, config: PlannerConfig) -> str:
    state, usable = _state_bytes(model, config), _usable_bytes(cluster, config)
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
    for k in cluster.count_by_kind():
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
