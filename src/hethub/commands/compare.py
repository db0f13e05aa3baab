"""`hethub plan --compare`: every strategy's plan side by side (and hethub's under each schedule and
unsharded), with $ per million tokens, the proven bound, the kind-alone sum and MFU."""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import TYPE_CHECKING

from hethub.errors import HethubError
from hethub.runtimes import RUNTIMES
from hethub.schedules import AUTO_SCHEDULE

if TYPE_CHECKING:
    from hethub.search.planner import PlanResult


def compare(*, cluster, model, config, profiles, host, as_json: bool) -> int:
    from dataclasses import replace

    from hethub.commands.cost_plan import plan_price_per_hour, usd_per_million_tokens
    from hethub.predict.utilisation import cluster_mfu
    from hethub.search.planner import make_plan, reused_searches

    rows: list[tuple] = []
    results = []  # every row's search, whose kinds-alone bounds merge into the one the rows are read against
    shardings: list[str | None] = []  # each row's plan's optimizer sharding
    notes: list[str] = []  # the planner's sharding choice for hethub's row
    chosen_plan = None  # hethub's row's plan
    cp_notes: list[str] = []  # and the planner's context-parallelism choice
    # With the schedule left to the planner, hethub's row under each candidate schedule too.
    runs = [(s, config.schedule) for s in ("hethub", "uniform", "flops-proportional", "homogeneous")]
    if config.schedule == AUTO_SCHEDULE:
        runs[1:1] = [("hethub", name) for name in RUNTIMES[config.runtime].auto_schedules]
    runs = [(s, sch, config.optimizer_sharding, config.sequence_parallel) for s, sch in runs]
    if config.optimizer_sharding == "auto":  # and hethub's best unsharded plan, to show what sharding gains
        runs.insert(1, ("hethub", config.schedule, "none", config.sequence_parallel))
    if config.sequence_parallel:  # and its best plan without sequence parallelism
        runs.insert(1, ("hethub", config.schedule, config.optimizer_sharding, False))
    # The rows share their enumerations and repeated searches (planner.reused_searches).
    with reused_searches():
        for strategy, schedule, sharding, seq_par in runs:
            label = strategy if schedule == config.schedule else f"{strategy} ({schedule})"
            if sharding != config.optimizer_sharding:
                label += " (no sharding)"
            if seq_par != config.sequence_parallel:
                label += " (no SP)"
            try:
                row_config = replace(config, strategy=strategy, schedule=schedule, optimizer_sharding=sharding,
                                     sequence_parallel=seq_par)
                r = make_plan(cluster=cluster, model=model, profiles=profiles, host=host, config=row_config)
                try:  # dollars per million tokens where every kind used has a price
                    usd = usd_per_million_tokens(plan_price_per_hour(r.plan), r.prediction.tokens_per_s)
                except HethubError:
                    usd = None
                results.append(r)
                rows.append((label, r.prediction.tokens_per_s, r.prediction.step_time_s, r.efficiency,
                             len(r.plan.pipelines), r.plan.world_size, usd, "", r.plan.schedule))
                shardings.append(r.plan.optimizer_sharding)
                if label == "hethub":
                    notes = [n for n in r.notes if n.startswith("optimizer sharding:")]
                    chosen_plan = r.plan
                    cp_notes = [n for n in r.notes if n.startswith("context parallelism:")]
            except HethubError as err:
                rows.append((label, 0.0, float("nan"), 0.0, 0, 0, None, str(err).split(". Fix")[0], schedule))
                shardings.append(None)
    # One bound for every row: the job's proven bound, the same whatever each row searched; and one
    # kind-alone reference, each kind's best alone over all the rows' searches.
    bound = max((r.upper_bound_tokens_per_s for r in results), default=0.0)
    alone = sum(merged_bound(results)[0].values())
    if bound > 0:
        rows = [(*r[:3], r[1] / bound, *r[4:]) if not r[7] else r for r in rows]

    def mfu(tokens_per_s: float) -> float:
        return cluster_mfu(cluster=cluster, model=model, seq_len=config.seq_len, precision=config.precision,
                           tokens_per_s=tokens_per_s)
    base = next((r[1] for r in rows if r[0] == "uniform"), 0.0)
    gain = sharding_gain(rows, shardings, notes)
    if as_json:
        print(json.dumps([{"strategy": s, "tokens_per_s": t, "step_time_s": st, "efficiency": e,
                           "upper_bound_tokens_per_s": bound or None, "kinds_alone_tokens_per_s": alone or None,
                           "vs_kinds_alone": t / alone if alone and not err else None,
                           "mfu": mfu(t) if not err else None,
                           "speedup_over_uniform": (t / base if base else None), "num_pipelines": n,
                           "devices_used": d, "usd_per_million_tokens": usd, "error": err or None, "schedule": sch,
                           "optimizer_sharding": z}
                          for (s, t, st, e, n, d, usd, err, sch), z in zip(rows, shardings, strict=True)], indent=2))
        return 0
    from hethub.tables import prediction_basis

    print(f"predicted, {prediction_basis(cluster, *(r.prediction for r in results))}")
    print(f"efficiency: tokens/s over the proven upper bound {bound:,.0f} (every device at its best modelled rate, "
          f"no memory limit, bubble or communication); vs alone: over the sum of kind-alone plans {alone:,.0f} "
          "(above 1 where mixing relieves a kind's memory); MFU: of the cluster's summed dense peak")
    print(f"{'strategy':<28} {'tokens/s':>14} {'$/M tokens':>10} {'step s':>9} {'efficiency':>10} {'vs alone':>8} "
          f"{'MFU':>6} {'vs uniform':>10} {'pipelines':>9} {'devices':>7} {'schedule':>11} {'optimizer':>9}")
    for (s, t, st, e, n, d, usd, err, sch), z in zip(rows, shardings, strict=True):
        if err:
            print(f"{s:<28} {'infeasible':>14}  {err}")
            continue
        speed = f"{t / base:.2f}x" if base else "n/a"
        dollars = f"{usd:,.3f}" if usd is not None else "n/a"
        vs = f"{t / alone:.3f}" if alone else "n/a"
        print(f"{s:<28} {t:>14,.0f} {dollars:>10} {st:>9.3f} {e:>10.3f} {vs:>8} {mfu(t):>6.1%} {speed:>10} {n:>9} "
              f"{d:>7} {sch:>11} {z:>9}")
    if any(r[6] is None and not r[7] for r in rows):
        print("n/a: a kind used has no price_per_hour (catalog or cluster file)")
    if gain:
        print(gain)
    if chosen_plan is not None:
        print(seq_split_gain(rows, chosen_plan))
    for n in cp_notes:
        print(n)
    return 0


def seq_split_gain(rows: list[tuple], plan) -> str:
    """Where hethub's chosen plan splits sequences (SP, CP) and what that gains over its best plan
    without sequence parallelism (the "(no SP)" row)."""
    stages = [s for p in plan.pipelines for s in p.stages]
    sp = sum(s.sequence_parallel for s in stages)
    cp = sorted({s.cp for s in stages if s.cp > 1})
    chosen = next((r for r in rows if r[0] == "hethub" and not r[7]), None)
    without = next((r for r in rows if r[0] == "hethub (no SP)" and not r[7]), None)
    head = (f"sequence parallelism: on {sp} of {sum(s.tp > 1 for s in stages)} TP > 1 stages"
            + (f", context parallelism {'/'.join(map(str, cp))}" if cp else ", no context parallelism"))
    if chosen is not None and without is not None:
        head += f"; predicted {without[2] / chosen[2]:.3f}x the best plan without SP (step {without[2]:.3f} s)"
    return head


def sharding_gain(rows: list[tuple], shardings: list[str | None], notes: list[str]) -> str:
    """hethub's chosen plan against its best unsharded one (the "(no sharding)" row), and the planner's
    own comparison under the chosen schedule; "" when no sharding was left to the planner."""
    chosen = next((r for r in rows if r[0] == "hethub" and not r[7]), None)
    unsharded = next((r for r in rows if r[0] == "hethub (no sharding)" and not r[7]), None)
    if chosen is None or unsharded is None:
        return ""
    z = shardings[rows.index(chosen)]
    head = (f"optimizer sharding: {z} chosen, predicted {unsharded[2] / chosen[2]:.3f}x the best unsharded plan "
            f"(step {chosen[2]:.3f} s vs {unsharded[2]:.3f} s)")
    if z == "none":
        head = "optimizer sharding: none chosen, no sharded plan predicted faster than the best unsharded one"
    planner = notes[0].removeprefix("optimizer sharding: ") if notes else ""
    return head + (f"; the planner's choice under the chosen schedule: {planner}" if planner else "")


def merged_bound(results: Iterable[PlanResult]) -> tuple[dict[str, float], frozenset[str]]:
    """Each kind's part of the kind-alone bound over several searches of the same job (`--compare`'s
    rows): the best any of them found for that kind alone, a relaxed-memory part counting only where
    no search found one that fits. Also the kinds whose merged part is still a relaxed-memory plan."""
    fitting: dict[str, float] = {}
    relaxed: dict[str, float] = {}
    for r in results:
        for kind, tps in (r.upper_bound_by_kind or {}).items():
            into = relaxed if kind in r.relaxed_kinds else fitting
            into[kind] = max(into.get(kind, 0.0), tps)
    parts = {k: fitting.get(k, relaxed.get(k, 0.0)) for k in dict.fromkeys([*fitting, *relaxed])}
    return parts, frozenset(relaxed) - frozenset(fitting)
