"""`hethub plan`: the planner's best plan for a cluster and model (``--compare``: commands/compare.py;
``--objective cost`` and budgets: commands/cost_plan.py)."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from typing import TYPE_CHECKING

from hethub.argtypes import positive_float, positive_int
from hethub.commands.options import add_headroom, load_profiles_arg
from hethub.plan import OPTIMIZER_SHARES, PLANNED_SHARDINGS, Plan
from hethub.runtimes import DEFAULT_RUNTIME, RUNTIMES
from hethub.schedules import AUTO_CANDIDATES, AUTO_SCHEDULE, SCHEDULES
from hethub.spec.model import PRECISIONS

if TYPE_CHECKING:
    from hethub.search.config import PlannerConfig


def register(sub: argparse._SubParsersAction) -> None:
    sp = sub.add_parser("plan", help="search the best heterogeneous plan for a cluster and model")
    sp.add_argument("--cluster", required=True, help="cluster TOML file")
    sp.add_argument("--model", required=True, help="preset name (hethub models) or Hugging Face config.json")
    sp.add_argument("--global-batch", type=positive_int, required=True, help="sequences per optimizer step")
    sp.add_argument("--seq-len", type=positive_int, required=True, help="tokens per sequence")
    sp.add_argument("--strategy", default="hethub", choices=["hethub", "uniform", "flops-proportional",
                                                             "homogeneous"],
                    help="hethub: the planner's search; the others are baselines (uniform: equal layers and batch "
                         "shares on every device; flops-proportional: shares by peak FLOP/s; homogeneous: the best "
                         "plan on one kind alone); docs/planner.md")
    sp.add_argument("--schedule", default=AUTO_SCHEDULE, choices=(AUTO_SCHEDULE, *SCHEDULES),
                    help=f"pipeline schedule; {AUTO_SCHEDULE} (default): the best predicted of "
                         f"{', '.join(AUTO_CANDIDATES)}")
    sp.add_argument("--precision", default="bf16-mixed", choices=list(PRECISIONS),
                    help="fp16-mixed (with dynamic loss scaling) for GPUs without bf16 (Volta, Turing); CPU "
                         "ranks always run fp32")
    sp.add_argument("--top-k", type=positive_int, default=1, help="also show the k best plans")
    sp.add_argument("--profiles", help="directory or file of measured layer profiles (hethub or Sailor format)")
    sp.add_argument("--links", help="measured links profile from 'hethub bench comm' (replaces catalog links)")
    sp.add_argument("--optimizer-sharding", default="auto", choices=("auto", *PLANNED_SHARDINGS),
                    help="sharding across each layer's data-parallel holders: zero1 the optimizer state, zero2 "
                         "and the gradients, zero3 and the parameters; auto (default): the fastest predicted "
                         "(zero2/zero3 priced where memory binds, docs/planner.md)")
    sp.add_argument("--optimizer-shares", default="proportional", choices=OPTIMIZER_SHARES,
                    help="how a sharded group's state is split among its holders: in proportion to their "
                         "free memory (default) or equally")
    sp.add_argument("--runtime", choices=tuple(RUNTIMES), default=DEFAULT_RUNTIME,
                    help="the runtime that will train the plan: search only what it runs (its schedules, optimizer "
                         "shardings, equal or unequal batch shares and TP degrees, recomputation) and predict with "
                         "its cost rules (hethub.runtimes; docs/planner.md); deepspeed plans export to Sailor's format")
    sp.add_argument("--compare", action="store_true",
                    help="print every strategy side by side, with $ per million tokens")
    sp.add_argument("--objective", default="throughput", choices=["throughput", "cost"],
                    help="most tokens/s, or fewest dollars per token (may leave devices or kinds idle)")
    sp.add_argument("--budget-per-hour", type=positive_float, default=None,
                    help="dollars per hour the devices used may cost (prices: catalog or cluster file)")
    sp.add_argument("--min-tokens-per-s", type=positive_float, default=None,
                    help="the plan must predict at least this many tokens/s")
    sp.add_argument("--out", help="write the plan JSON here")
    sp.add_argument("--json", action="store_true", help="print one JSON object")
    add_headroom(sp)
    sp.set_defaults(func=cmd_plan)


def plan_config(args: argparse.Namespace) -> PlannerConfig:
    """The planner's config of a parsed ``hethub plan`` command (bench/planner_scale.py times it)."""
    from hethub.search.config import PlannerConfig

    return PlannerConfig(global_batch=args.global_batch, seq_len=args.seq_len, strategy=args.strategy,
                         schedule=args.schedule, precision=args.precision, top_k=args.top_k,
                         objective=args.objective, budget_per_hour=args.budget_per_hour,
                         min_tokens_per_s=args.min_tokens_per_s, mem_headroom=args.mem_headroom,
                         optimizer_sharding=args.optimizer_sharding, optimizer_shares=args.optimizer_shares,
                         runtime=getattr(args, "runtime", None) or DEFAULT_RUNTIME)


def cmd_plan(args: argparse.Namespace) -> int:
    from hethub.commands.host import host_for
    from hethub.search.planner import make_plan
    from hethub.spec.cluster import load_cluster
    from hethub.spec.model import get_model
    from hethub.tables import format_plan_table, format_summary

    if args.out:  # before the search: a bad path must not cost it
        from hethub.outfiles import prepare_output

        prepare_output(args.out)
    cluster = load_cluster(args.cluster)
    if args.links:
        from hethub.predict.links import apply_links_profile, read_links_profile

        cluster = apply_links_profile(cluster, read_links_profile(args.links))
    model = get_model(args.model)
    if args.seq_len > model.max_seq_len:  # a flag's value (exit 2), not a search that found nothing
        from hethub.errors import SpecError

        raise SpecError(f"--seq-len {args.seq_len} exceeds {model.name}'s max_seq_len {model.max_seq_len}. Fix: use "
                        f"--seq-len {model.max_seq_len} or less, or a model with a longer context.")
    config = plan_config(args)
    profiles = load_profiles_arg(args.profiles, model, args.seq_len)
    host = host_for(cluster, args.profiles, model=model, seq_len=args.seq_len)
    if args.compare:
        from hethub.commands.compare import compare

        return compare(cluster=cluster, model=model, config=config, profiles=profiles, host=host, as_json=args.json)
    if config.cost_aware:
        return cost_plan(cluster=cluster, model=model, config=config, profiles=profiles, host=host, as_json=args.json,
                          out=args.out)
    result = make_plan(cluster=cluster, model=model, config=config, profiles=profiles, host=host)
    plan = for_file(result.plan, config)
    result = replace(result, plan=plan, notes=(*result.notes, *runtime_notes(config, plan)))
    if args.out:
        result.plan.save(args.out)
    pred = result.prediction
    if args.json:
        out = {
            "strategy": args.strategy,
            "runtime": result.plan.runtime,
            "tokens_per_s": pred.tokens_per_s,
            "step_time_s": pred.step_time_s,
            "upper_bound_tokens_per_s": result.upper_bound_tokens_per_s,
            "upper_bound_tokens_per_s_by_kind": result.bound_by_kind,
            "efficiency": result.efficiency,
            "kinds_alone_tokens_per_s": result.kinds_alone_tokens_per_s or None,
            "kinds_alone_tokens_per_s_by_kind": result.upper_bound_by_kind,
            "vs_kinds_alone": result.vs_kinds_alone,
            "mfu": result.mfu,
            "search_time_s": result.search_time_s,
            "feasible": pred.fits_memory,
            "peak_mem_bytes_by_kind": pred.peak_mem_bytes_by_kind,
            "num_pipelines": len(result.plan.pipelines),
            "devices_used": result.plan.world_size,
            "compute_sources": pred.compute_sources,
            "notes": list(result.notes),
            "plan_file": args.out,
            "alternatives": [{"tokens_per_s": p.tokens_per_s, "step_time_s": p.step_time_s,
                              "num_pipelines": len(pl.pipelines)} for pl, p in result.alternatives],
        }
        if not args.out:
            out["plan"] = result.plan.to_dict()
        print(json.dumps(out, indent=2))
        return 0
    print(format_summary(result.plan, pred, upper_bound_tokens_per_s=result.upper_bound_tokens_per_s,
                         search_time_s=result.search_time_s,
                         kinds_alone_tokens_per_s=result.kinds_alone_tokens_per_s))
    for note in result.notes:
        print(f"note: {note}")
    print()
    print(format_plan_table(result.plan, pred))
    for i, (alt_plan, alt_pred) in enumerate(result.alternatives[1:], start=2):
        print(f"\n#{i}: {alt_pred.tokens_per_s:,.0f} tokens/s, {len(alt_plan.pipelines)} pipelines")
    if args.out:
        print(f"\nplan written to {args.out}")
    return 0


def runtime_notes(config: PlannerConfig, plan: Plan) -> tuple[str, ...]:
    """What planning for ``config.runtime`` left out of the plan space that hethub's runtime has, and,
    for DeepSpeed's engine (what Sailor runs), why ``plan`` does not go to Sailor's plan format where
    it does not: the export's own refusal, so a user planning for Sailor sees the fix before exporting."""
    from hethub.errors import PlanError
    from hethub.interop.sailor import export_sailor_plan

    r = RUNTIMES[config.runtime]
    notes = [] if r.stage_recompute else [f"runtime {r.name}: no activation recomputation planned "
                                          f"({r.source('stage_recompute')}; hethub chooses it per stage)"]
    if r.name == "deepspeed":
        try:
            export_sailor_plan(plan)
        except PlanError as e:
            notes.append(f"runtime deepspeed: {e}")
    return tuple(notes)


def for_file(plan: Plan, config: PlannerConfig) -> Plan:
    """The plan as written: a ZeRO-1 plan carries its optimizer split at the headroom it was scored
    with (training.optimizer_shard_weights), which the runtime then makes."""
    from hethub.predict.predictor import with_shard_weights

    return with_shard_weights(plan, mem_headroom=config.mem_headroom)


def cost_plan(*, cluster, model, config, profiles, host, as_json: bool, out: str | None) -> int:
    """The plan for --objective/--budget-per-hour/--min-tokens-per-s, beside the throughput plan."""
    from hethub.commands.cost_plan import plan_for_cost
    from hethub.tables import format_plan_table, format_summary, prediction_basis

    cp = plan_for_cost(cluster=cluster, model=model, config=config, profiles=profiles, host=host)
    chosen = for_file(cp.chosen.result.plan, config)
    if out:
        chosen.save(out)
    rows = [("chosen", cp.chosen), ("throughput plan", cp.throughput)]
    if as_json:
        print(json.dumps({
            "objective": config.objective, "budget_per_hour": config.budget_per_hour,
            "min_tokens_per_s": config.min_tokens_per_s, "sub_fleets_searched": cp.considered,
            **{key: {"tokens_per_s": c.tokens_per_s, "price_per_hour": c.price_per_hour,
                     "usd_per_million_tokens": c.usd_per_million_tokens, "devices_used": c.result.plan.world_size,
                     "devices_left_out": c.left_out, "num_pipelines": len(c.result.plan.pipelines),
                     **({"plan": chosen.to_dict()} if key == "chosen" and not out else {})}
               for key, c in (("chosen", cp.chosen), ("throughput_plan", cp.throughput))},
            "plan_file": out}, indent=2))
        return 0
    print(f"objective {config.objective}"
          + (f", budget ${config.budget_per_hour:,.2f}/h" if config.budget_per_hour else "")
          + (f", at least {config.min_tokens_per_s:,.0f} tokens/s" if config.min_tokens_per_s else "")
          + f"; {cp.considered} sub-fleets searched; predicted, "
          + prediction_basis(cluster, cp.chosen.result.prediction, cp.throughput.result.prediction))
    print(f"{'':<16} {'tokens/s':>12} {'$/h':>9} {'$/M tokens':>10} {'devices':>7}  left out")
    for name, c in rows:
        left = ", ".join(f"{n} x {k}" for k, n in c.left_out.items()) or "none"
        print(f"{name:<16} {c.tokens_per_s:>12,.0f} {c.price_per_hour:>9,.2f} {c.usd_per_million_tokens:>10,.3f} "
              f"{c.result.plan.world_size:>7}  {left}")
    print()
    r = cp.chosen.result
    print(format_summary(r.plan, r.prediction, search_time_s=r.search_time_s))
    print()
    print(format_plan_table(r.plan, r.prediction))
    if out:
        print(f"\nplan written to {out}")
    return 0
