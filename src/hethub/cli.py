"""The `hethub` command line. Parsing and printing only; the work lives in the packages.

Every input error is a HethubError: it is printed as one paragraph on stderr and the process exits
with the error's code (see docs/cli.md). Heavy imports (torch) happen inside the commands that need
them, so planning stays fast and works without torch.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from hethub import __version__
from hethub.argtypes import HelpFormatter, headroom_fraction, positive_float, positive_int
from hethub.errors import HethubError, missing_extra
from hethub.plan import OPTIMIZER_SHARES, PLANNED_SHARDINGS, Plan
from hethub.runtimes import DEFAULT_RUNTIME, RUNTIMES
from hethub.schedules import AUTO_CANDIDATES, AUTO_SCHEDULE, P2P_MODES, SCHEDULES
from hethub.spec.model import PRECISIONS

if TYPE_CHECKING:
    from hethub.search.config import PlannerConfig

EXIT_INTERRUPTED = 130


def _add_headroom(sp: argparse.ArgumentParser) -> None:
    from hethub.predict.memory import DEFAULT_MEM_HEADROOM

    sp.add_argument("--mem-headroom", type=headroom_fraction, default=DEFAULT_MEM_HEADROOM, metavar="FRACTION",
                    help="share of each device's memory to keep free (default %(default)s: the memory model's "
                         "error; docs/predictor.md)")


def _load_profiles(arg: str | None, model=None, seq_len: int | None = None):
    if not arg:
        return None
    from hethub.profile.format import load_profiles

    return load_profiles(arg, model=model, seq_len=seq_len)


# ---- plan / predict ---------------------------------------------------------------------------------
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
    profiles = _load_profiles(args.profiles, model, args.seq_len)
    host = host_for(cluster, args.profiles, model=model, seq_len=args.seq_len)
    if args.compare:
        return _compare(cluster=cluster, model=model, config=config, profiles=profiles, host=host, as_json=args.json)
    if config.cost_aware:
        return _cost_plan(cluster=cluster, model=model, config=config, profiles=profiles, host=host, as_json=args.json,
                          out=args.out)
    result = make_plan(cluster=cluster, model=model, config=config, profiles=profiles, host=host)
    result = replace(result, plan=_for_file(result.plan, config), notes=(*result.notes, *_runtime_notes(config)))
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


def _runtime_notes(config: PlannerConfig) -> tuple[str, ...]:
    """What planning for ``config.runtime`` left out of the plan space that hethub's runtime has."""
    r = RUNTIMES[config.runtime]
    if r.stage_recompute:
        return ()
    return (f"runtime {r.name}: no activation recomputation planned ({r.source('stage_recompute')}; hethub "
            "chooses it per stage)",)


def _for_file(plan: Plan, config: PlannerConfig) -> Plan:
    """The plan as written: a ZeRO-1 plan carries its optimizer split at the headroom it was scored
    with (training.optimizer_shard_weights), which the runtime then makes."""
    from hethub.predict.predictor import with_shard_weights

    return with_shard_weights(plan, mem_headroom=config.mem_headroom)


def _cost_plan(*, cluster, model, config, profiles, host, as_json: bool, out: str | None) -> int:
    """The plan for --objective/--budget-per-hour/--min-tokens-per-s, beside the throughput plan."""
    from hethub.commands.cost_plan import plan_for_cost
    from hethub.tables import format_plan_table, format_summary, prediction_basis

    cp = plan_for_cost(cluster=cluster, model=model, config=config, profiles=profiles, host=host)
    chosen = _for_file(cp.chosen.result.plan, config)
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


def _compare(*, cluster, model, config, profiles, host, as_json: bool) -> int:
    from dataclasses import replace

    from hethub.commands.cost_plan import plan_price_per_hour, usd_per_million_tokens
    from hethub.predict.utilisation import cluster_mfu
    from hethub.search.planner import make_plan, merged_bound, reused_searches

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
    gain = _sharding_gain(rows, shardings, notes)
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


def _sharding_gain(rows: list[tuple], shardings: list[str | None], notes: list[str]) -> str:
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


def cmd_predict(args: argparse.Namespace) -> int:
    from hethub.commands.host import host_for
    from hethub.plan import Plan
    from hethub.predict.predictor import predict
    from hethub.tables import format_plan_table, format_summary

    plan = Plan.load(args.plan)
    if args.runtime is not None:
        plan = plan.with_runtime(args.runtime)
    if args.p2p is not None:
        from dataclasses import replace

        plan = replace(plan, p2p=args.p2p)
    plan.validate()
    if args.links:
        from hethub.predict.links import plan_with_links, read_links_profile

        plan = plan_with_links(plan, read_links_profile(args.links))
    profiles = _load_profiles(args.profiles, plan.model, plan.seq_len)
    pred = predict(plan, profiles=profiles,
                   host=host_for(plan.cluster, args.profiles, model=plan.model, seq_len=plan.seq_len),
                   mem_headroom=args.mem_headroom)
    upper = plan.meta.get("upper_bound_tokens_per_s")
    for w in pred.warnings:  # stderr, so --json output stays one object
        print(f"hethub predict: warning: {w}", file=sys.stderr)
    if args.json:
        out = {**pred.to_dict(), "upper_bound_tokens_per_s": upper,
               "efficiency": pred.tokens_per_s / upper if upper else None, "feasible": pred.fits_memory,
               "p2p": plan.p2p, "runtime": plan.runtime}
        print(json.dumps(out, indent=2))
        return 0
    print(format_summary(plan, pred, upper_bound_tokens_per_s=upper,
                         kinds_alone_tokens_per_s=plan.meta.get("kinds_alone_tokens_per_s")))
    print()
    print(format_plan_table(plan, pred))
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    from hethub.spec.model import PRESETS

    if args.json:
        print(json.dumps({name: m.to_dict() | {"num_params": m.num_params} for name, m in PRESETS.items()}, indent=2))
        return 0
    print(f"{'preset':<14} {'params':>8} {'layers':>6} {'hidden':>6} {'heads':>5} {'kv':>3} {'ffn':>6} "
          f"{'vocab':>7} {'max seq':>7}  arch")
    for name, m in PRESETS.items():
        n = m.num_params
        size = f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"
        print(f"{name:<14} {size:>8} {m.num_layers:>6} {m.hidden_size:>6} {m.num_heads:>5} {m.num_kv_heads:>3} "
              f"{m.ffn_hidden_size:>6} {m.vocab_size:>7} {m.max_seq_len:>7}  {m.arch}")
    print("\nAny --model also takes the path of a Hugging Face config.json (llama- or gpt-style).")
    return 0


# Shown at the end of each command's --help.
EXAMPLES = {
    "plan": ["hethub plan --cluster examples/clusters/a100-v100-32.toml --model llama-3-8b --global-batch 512 "
             "--seq-len 2048 --out plan.json",
             "hethub plan --cluster examples/clusters/local-cpu.toml --model small --global-batch 16 --seq-len 128 "
             "--precision fp32 --profiles profiles/ --compare"],
    "predict": ["hethub predict --plan plan.json", "hethub predict --plan local.json --profiles profiles/ "
                "--links links.json --json"],
    "report": ["hethub report --plan local.json --metrics run.jsonl --out report/"],
    "profile": ["hethub profile --model small --mbs 1,2 --seq-len 128 --kind cpu-fast,cpu-slow --out profiles/",
                "hethub profile --model llama-3-8b --device cuda --mbs 1,2,4 --tp 1,2 --seq-len 2048 "
                "--kind a100-40gb --out profiles/a100-40gb.json"],
    "import-plan": ["hethub import-plan --format sailor examples/sailor/opt350m-a100-v100-plan.json "
                    "--cluster examples/clusters/a100-v100-32.toml --model opt-350m --out imported.json"],
    "export-plan": ["hethub export-plan --format sailor plan.json --out sailor-plan.json"],
    "demo": ["hethub demo", "hethub demo --steps 10 --out runs/quick"],
    "bench": ["hethub bench comm --cluster examples/clusters/local-cpu.toml --out links.json"],
    "models": ["hethub models", "hethub models --json"],
}


# ---- parser ---------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hethub", description="Plan, predict and train LLMs on mixed accelerators.",
                                epilog="Exit codes and every command's flags: docs/cli.md. Start with the README's "
                                       "tour, or 'hethub demo'.", formatter_class=HelpFormatter)
    p.add_argument("--version", action="version", version=f"hethub {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

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
    _add_headroom(sp)
    sp.set_defaults(func=cmd_plan)

    sp = sub.add_parser("predict", help="predict step time, throughput and memory of a plan")
    sp.add_argument("--plan", required=True, help="plan JSON (from 'hethub plan', 'import-plan' or written by hand)")
    sp.add_argument("--profiles", help="measured layer profiles (directory or file)")
    sp.add_argument("--links", help="measured links profile from 'hethub bench comm'")
    sp.add_argument("--p2p", choices=P2P_MODES, default=None,
                    help="how the runtime sends between stages, overriding the plan's training.p2p: async (hethub's "
                         "runtime), blocking (a stage waits for its send, as in Megatron-LM) or lockstep (DeepSpeed's "
                         "pipeline engine, which Sailor uses: its instruction order, each send and receive a "
                         "rendezvous; 1F1B only); see docs/predictor.md")
    sp.add_argument("--runtime", choices=tuple(RUNTIMES), default=None,
                    help="predict the plan as this runtime runs it, overriding training.runtime: what it overlaps "
                         "(gradient buckets, TP all-reduces under weight-gradient GEMMs), how it sends and which "
                         "attention kernels it has (hethub.runtimes; docs/predictor.md)")
    sp.add_argument("--json", action="store_true", help="print one JSON object (warnings go to stderr)")
    _add_headroom(sp)
    sp.set_defaults(func=cmd_predict)

    sp = sub.add_parser("models", help="list the model presets --model accepts")
    sp.add_argument("--json", action="store_true", help="print one JSON object: preset -> shape")
    sp.set_defaults(func=cmd_models)

    for register in _extra_commands():
        register(sub)
    for name, sp in sub.choices.items():
        _teach(sp, EXAMPLES.get(name, []))
    return p


def _teach(sp: argparse.ArgumentParser, examples: list[str]) -> None:
    """Defaults in every option's help and examples at the end, for a command and its subcommands."""
    sp.formatter_class = HelpFormatter
    if examples and not sp.epilog:
        sp.epilog = "examples:\n" + "\n".join(f"  {e}" for e in examples)
    for action in sp._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                _teach(child, [])


def _extra_commands() -> list[Callable[[argparse._SubParsersAction], None]]:
    """Commands defined in hethub.commands (keeps this file about the core commands)."""
    from hethub.commands import bench, export, interop, launch, profile, report, run

    return [run.register, launch.register, report.register, interop.register, profile.register, bench.register,
            export.register]


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["train"] and "--" in argv:
        # Older spelling: training flags after '--'. They are flags of 'hethub train' itself now.
        argv.remove("--")
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except HethubError as err:
        print(f"hethub {args.command}: error: {err}", file=sys.stderr)
        return err.exit_code
    except ModuleNotFoundError as err:
        # Planning needs only the core; training, profiling and benchmarks need the train extra.
        missing = missing_extra(err, what=f"'hethub {args.command}'")
        if missing is None:
            raise
        print(f"hethub {args.command}: error: {missing}", file=sys.stderr)
        return missing.exit_code
    except KeyboardInterrupt:
        print("hethub: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # The reader (e.g. `| head`) went away; that is not an error of ours.
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
