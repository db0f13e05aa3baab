"""`hethub demo`: the built-in local default, end to end on this machine, showing what mixing kinds pays.

On the embedded demo-cpu cluster (4 CPU ranks: 2 cpu-fast, 2 cpu-slow, both emulated slower than
this host so the ranks leave the cores room) it measures this CPU's layer times, links and
all-reduce, then plans the `small` model three ways through the planner's public entry point
(``make_plan``): the planner on every kind, the `uniform` baseline, and the planner on each proper
subset of the kinds (each kind alone, for two kinds). It trains the planner's plan, `uniform` and
the best subset's plan through torchrun, prints them side by side with predicted and measured
tokens/s, and says why the mixed plan wins (what the slower kind takes, what that frees the faster
one from). It ends with the report of the planner's run.
"""

from __future__ import annotations

import itertools
import json
import statistics
import time
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from hethub.emulation.effects import HostEffects
from hethub.emulation.host import EmulationModel, host_model, usable_cores
from hethub.emulation.load import ForeignLoad
from hethub.errors import HethubError, RuntimeSetupError
from hethub.plan import Plan
from hethub.predict.profiles import ProfileSet
from hethub.search.config import PlannerConfig
from hethub.search.planner import PlanResult, make_plan
from hethub.spec.cluster import Cluster, load_cluster
from hethub.spec.model import PRESETS, ModelSpec
from hethub.tables import prediction_basis
from hethub.units import fmt_chunks

SPARK = "▁▂▃▄▅▆▇█"
WARMUP_STEPS = 2  # steps left out of the measured median (start-up, first allocations)


@dataclass(frozen=True)
class DemoConfig:
    cluster: str | None = None  # None: the embedded demo-cpu.toml
    model: str = "small"
    global_batch: int = 12
    seq_len: int = 128
    steps: int = 10
    # Tensor parallelism splits a 1.5 M-parameter layer into slivers that two CPU ranks on one host only
    # slow down; planning TP 1 alone also halves the profiling (no TP-2 entries, each a pair of ranks).
    tp_degrees: tuple[int, ...] = (1,)
    out_dir: str = "runs/demo"


@dataclass(frozen=True)
class Contender:
    """One of the plans the demo trains: its key (file names), how it reads in the table, its plan."""

    key: str
    label: str
    result: PlanResult


def default_cluster_path() -> Path:
    return Path(str(resources.files("hethub.spec").joinpath("demo-cpu.toml")))


def sparkline(values: list[float]) -> str:
    lo, hi = min(values), max(values)
    span = (hi - lo) or 1.0
    return "".join(SPARK[min(len(SPARK) - 1, int((v - lo) / span * len(SPARK)))] for v in values)


def measure_profiles(cluster: Cluster, cfg: DemoConfig, out_dir: Path) -> tuple[ProfileSet, HostEffects | None]:
    """Profile this CPU once and use it for every kind (emulated kinds are slowed by the predictor);
    on a local emulation host also the host's effects (wake penalty, core speed spread)."""
    from hethub.profile.format import write_profile
    from hethub.profiler.runner import device_description, profile_for_kinds

    model = PRESETS[cfg.model]
    mbs = (1, 2, 4)
    profiles = profile_for_kinds(model=model, kinds=cluster.kind_names, seq_len=cfg.seq_len, mbs=mbs,
                                 tp=cfg.tp_degrees)
    effects = None
    if cluster.host is not None:
        from hethub.emulation.measure.effects import measure_host_effects

        try:
            effects = measure_host_effects(model, mbs=mbs, seq_len=cfg.seq_len)
        except RuntimeError as err:  # the speed spread's windows cannot be timed on a host this busy
            print(f"note: {err}; predicting without the host's speed spread", flush=True)
            effects = measure_host_effects(model, mbs=mbs, seq_len=cfg.seq_len, speed_spread=False)
    for kind, prof in profiles.by_kind.items():
        write_profile(out_dir / f"profile-{kind}.json", prof, model=model, device=device_description("cpu"),
                      host=effects)
    return profiles, effects


def measure_host(cluster: Cluster, out_dir: Path) -> Cluster:
    """This host's links and all-reduce (what 'hethub bench comm' measures), applied to the cluster."""
    from hethub.emulation.measure.collbench import measure_host_links
    from hethub.predict.links import apply_links_profile, write_links_profile

    links = measure_host_links(cluster, max_bytes=16 * 1024**2, show_progress=False)
    write_links_profile(links, out_dir / "links.json")
    return apply_links_profile(cluster, links)


def kind_subsets(cluster: Cluster) -> list[Cluster]:
    """Every proper, non-empty subset of the cluster's kinds as a cluster of its own (all their nodes)."""
    kinds = cluster.kind_names
    return [cluster.only_kinds(sub) for n in range(len(kinds) - 1, 0, -1) for sub in itertools.combinations(kinds, n)]


def work_shares(plan: Plan) -> dict[str, float]:
    """Each kind's share of the step's decoder-layer work (sequences x layers), over the plan's kinds."""
    out: dict[str, float] = {}
    total = plan.global_batch * plan.model.num_layers
    for p in plan.pipelines:
        sequences = p.micro_batch_size * p.num_micro_batches
        for s in p.stages:
            out[s.kind] = out.get(s.kind, 0.0) + sequences * s.num_layers / total
    return out


def kind_role(plan: Plan, kind: str) -> str:
    """What ``kind`` does in ``plan``: whole replicas (and of how many sequences) or pipeline stages."""
    whole = [p for p in plan.pipelines if len(p.stages) == 1 and p.stages[0].kind == kind]
    parts = [s for p in plan.pipelines if len(p.stages) > 1 for s in p.stages if s.kind == kind and s.num_layers]
    out = []
    if whole:
        sizes = sorted({p.micro_batch_size * p.num_micro_batches for p in whole})
        out.append(f"{len(whole)} replica{'s' * (len(whole) > 1)} of {'/'.join(map(str, sizes))} sequences each")
    if parts:
        ranges = sorted({fmt_chunks(s.layer_ranges) for s in parts})
        out.append(f"{len(parts)} pipeline stage{'s' * (len(parts) > 1)} (layers {', '.join(ranges)})")
    return " and ".join(out) or "nothing"


def idle_kinds(plan: Plan) -> list[str]:
    """The cluster's kinds that get no decoder layer of work in ``plan``."""
    shares = work_shares(plan)
    return [k for k in plan.cluster.kind_names if shares.get(k, 0.0) <= 0.0]


def why_mixed_wins(mixed: PlanResult, alone: PlanResult, uniform: PlanResult) -> str:
    """One sentence from the plans and their predictions: what the kinds the best subset lacks take
    in the mixed plan, what that frees the others from, and why uniform falls behind."""
    shares = work_shares(mixed.plan)
    kept = set(work_shares(alone.plan))
    added = [k for k in mixed.plan.cluster.kind_names if k not in kept and shares.get(k, 0.0) > 0]
    if not added:
        return ("the planner's plan uses no kind beyond the best subset's, so it cannot win by mixing "
                f"(predicted {mixed.prediction.tokens_per_s:,.0f} vs {alone.prediction.tokens_per_s:,.0f} tokens/s).")
    cluster = mixed.plan.cluster
    freed = sum(shares[k] for k in added)
    speed = ", ".join(f"{k} {cluster.kinds[k].emulated_slowdown:g}x" for k in cluster.kind_names
                      if cluster.kinds[k].emulated)
    what = "; ".join(f"{k} takes {shares[k]:.0%} of the work as {kind_role(mixed.plan, k)}" for k in added)
    rest = ", ".join(f"{k}'s {kind_role(mixed.plan, k)}" for k in mixed.plan.cluster.kind_names
                     if k in kept and shares.get(k, 0.0) > 0)
    pace = _pace_setter(uniform)
    return (f"{what} (emulated speeds: {speed} slower than a core), beside {rest}; that "
            f"frees {', '.join(sorted(kept))} from {freed:.0%} of the work it does alone, so the step is predicted "
            f"at {mixed.prediction.step_time_s:.2f} s against {alone.prediction.step_time_s:.2f} s "
            f"alone. uniform gives every device the same share, so {pace} set its pace "
            f"({uniform.prediction.step_time_s:.2f} s).")


def _pace_setter(res: PlanResult) -> str:
    """The kind whose stages compute longest per step in the prediction (the one a uniform split waits for)."""
    busiest = max(res.prediction.stages, key=lambda s: s.compute_s)
    return f"the {busiest.kind} ranks"


def _train(plan_path: Path, plan: Plan, *, steps: int, metrics: Path) -> tuple[list[dict], float | None]:
    """The run's metrics records and the foreign load (cores other processes kept busy) during it."""
    from hethub.runtime.launch import launch_local

    metrics.unlink(missing_ok=True)
    load = ForeignLoad()
    # Each plan is measured as planned: online re-balancing would move the uniform baseline's shares.
    proc = launch_local(plan_path, nproc=plan.world_size, steps=steps, metrics=metrics, capture=True,
                        extra_args=["--lr", "3e-3", "--warmup-steps", "3", "--trace", "--rebalance", "off"])
    foreign = load.cores()
    if proc.returncode != 0:
        raise RuntimeSetupError(f"demo training of {plan_path} failed (exit {proc.returncode}):\n"
                                f"{proc.stderr[-3000:]}\nFix: run 'make test' to see which part is broken.")
    return [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()], foreign


def describe(plan: Plan) -> str:
    parts = []
    for p in plan.pipelines:
        stages = " | ".join(f"{s.kind}{'x' + str(s.tp) if s.tp > 1 else ''}:{s.num_layers}L" for s in p.stages)
        parts.append(f"[{stages}] {p.micro_batch_size}x{p.num_micro_batches}mb")
    return "  ".join(parts)


def plan_contenders(cluster: Cluster, model: ModelSpec, cfg: DemoConfig, *, profiles: ProfileSet | None,
                    host: EmulationModel | None) -> tuple[list[Contender], list[tuple[str, PlanResult | None]]]:
    """The planner's plan on every kind, uniform's, and the best plan on a proper subset of the kinds
    (trained, in that order); and every subset's plan (None: nothing fits there), for the print-out."""
    def plan(on: Cluster, strategy: str) -> PlanResult:
        return make_plan(cluster=on, model=model, profiles=profiles, host=host,
                         config=PlannerConfig(global_batch=cfg.global_batch, seq_len=cfg.seq_len, strategy=strategy,
                                              precision="fp32", tp_degrees=cfg.tp_degrees))

    mixed, uniform = plan(cluster, "hethub"), plan(cluster, "uniform")
    subsets: list[tuple[str, PlanResult | None]] = []
    for sub in kind_subsets(cluster):
        name = " + ".join(sub.kind_names) + " alone"
        try:
            subsets.append((name, plan(sub, "hethub")))
        except HethubError:  # no plan fits on these kinds alone
            subsets.append((name, None))
    feasible = [(n, r) for n, r in subsets if r is not None]
    out = [Contender("hethub", "hethub (every kind)", mixed), Contender("uniform", "uniform", uniform)]
    if feasible:
        name, best = max(feasible, key=lambda nr: nr[1].prediction.tokens_per_s)
        out.append(Contender("subset", f"best subset: {name}", best))
    return out, subsets


def run_demo(cfg: DemoConfig) -> dict[str, dict]:
    t_start = time.perf_counter()
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cluster = load_cluster(cfg.cluster or default_cluster_path())
    model = PRESETS[cfg.model]
    print(f"hethub demo: {model.name} ({model.num_params / 1e6:.2f} M parameters), global batch {cfg.global_batch} "
          f"x {cfg.seq_len} tokens, on '{cluster.name}': {cluster.num_devices} CPU ranks on this host "
          f"({usable_cores()} cores).")
    emulated = [f"{k.name} {k.emulated_slowdown:g}x" for k in cluster.kinds.values() if k.emulated]
    if emulated:
        print(f"EMULATION: {', '.join(emulated)} slower than one core of this host (ranks sleep after each "
              "compute chunk); not real hardware.")
    print("measuring this CPU's layer times, links and all-reduce for the predictor ...", flush=True)
    profiles, effects = measure_profiles(cluster, cfg, out)
    if cluster.num_devices > 1:
        cluster = measure_host(cluster, out)
    host = host_model(cluster, effects=dict.fromkeys(cluster.kind_names, effects) if effects else None)
    contenders, subsets = plan_contenders(cluster, model, cfg, profiles=profiles, host=host)
    for name, res in subsets:
        got = f"{res.prediction.tokens_per_s:,.0f} tokens/s  {describe(res.plan)}" if res else "no plan fits"
        print(f"  planned on {name}: predicted {got}")
    mixed = contenders[0].result
    left_out = idle_kinds(mixed.plan)
    if left_out:
        print(f"NOTE: the planner's plan gives {', '.join(left_out)} no work: by this host's measurements it does "
              "not pay here (the comparison below shows what the other plans do).")
    results: dict[str, dict] = {}
    for c in contenders:
        res = c.result
        plan_path = out / f"plan-{c.key}.json"
        res.plan.save(plan_path)
        print(f"\n[{c.label}] {describe(res.plan)}")
        print(f"[{c.label}] training {cfg.steps} steps on {res.plan.world_size} ranks ...", flush=True)
        rows, foreign = _train(plan_path, res.plan, steps=cfg.steps, metrics=out / f"metrics-{c.key}.jsonl")
        steady = rows[WARMUP_STEPS:] or rows
        measured = statistics.median(r["tokens_per_s"] for r in steady)
        losses = [r["loss"] for r in rows]
        pred = res.prediction
        load = f"{foreign:.1f} cores" if foreign is not None else "unknown"
        results[c.key] = {"label": c.label, "measured_tokens_per_s": measured,
                          "predicted_tokens_per_s": pred.tokens_per_s, "foreign_load_cores": foreign,
                          "work_shares": work_shares(res.plan), "losses": losses, "plan": str(plan_path)}
        print(f"[{c.label}] measured {measured:,.0f} tokens/s (median of steps {len(rows) - len(steady) + 1}-"
              f"{len(rows)}; other processes kept {load} busy), predicted {pred.tokens_per_s:,.0f} tokens/s "
              f"({(pred.tokens_per_s - measured) / measured:+.0%}; {prediction_basis(res.plan.cluster, pred)})")
        print(f"[{c.label}] loss {losses[0]:.3f} -> {losses[-1]:.3f}  {sparkline(losses)}")
    _print_table(contenders, results)
    if "subset" in results:
        print(f"why: {why_mixed_wins(mixed, contenders[2].result, contenders[1].result)}")
    print(_verdict(results))
    report_dir = out / "report"
    from hethub.predict.predictor import predict
    from hethub.report import write_report

    plan = Plan.load(results["hethub"]["plan"])
    paths = write_report(plan=plan, prediction=predict(plan, profiles=profiles, timeline=True, host=host),
                         out_dir=report_dir, metrics_path=out / "metrics-hethub.jsonl")
    print(f"report of the planner's run: {report_dir}/ ({', '.join(p.name for p in paths.written)})")
    if paths.note:
        print(f"note: {paths.note}")
    (out / "demo.json").write_text(json.dumps(results, indent=2))
    print(f"demo finished in {time.perf_counter() - t_start:.0f} s; results in {out}/demo.json")
    return results


def _print_table(contenders: list[Contender], results: dict[str, dict]) -> None:
    h = results["hethub"]
    print(f"\n{'plan (EMULATION)':<34} {'kinds with work':<20} {'predicted tok/s':>15} {'measured tok/s':>14} "
          f"{'hethub is, measured (predicted)':>32}")
    for c in contenders:
        r = results[c.key]
        kinds = ", ".join(k for k in c.result.plan.cluster.kind_names if r["work_shares"].get(k, 0.0) > 0)
        ratio = (f"{h['measured_tokens_per_s'] / r['measured_tokens_per_s']:.2f}x "
                 f"({h['predicted_tokens_per_s'] / r['predicted_tokens_per_s']:.2f}x)") if c.key != "hethub" else ""
        print(f"{c.label:<34} {kinds:<20} {r['predicted_tokens_per_s']:>15,.0f} {r['measured_tokens_per_s']:>14,.0f} "
              f"{ratio:>32}")


def _verdict(results: dict[str, dict]) -> str:
    """Whether the mixed plan won, measured in this run, against each other contender."""
    h = results["hethub"]["measured_tokens_per_s"]
    others = [(r["label"], h / r["measured_tokens_per_s"]) for k, r in results.items() if k != "hethub"]
    loads = [r["foreign_load_cores"] for r in results.values() if r["foreign_load_cores"] is not None]
    busy = f"other processes kept up to {max(loads):.1f} cores busy meanwhile" if loads else "load unknown"
    lost = [label for label, ratio in others if ratio <= 1.0]
    if not lost:
        return (f"result: measured in this run, the mixed plan trained "
                f"{' and '.join(f'{ratio:.2f}x as fast as {label}' for label, ratio in others)} ({busy}).")
    return (f"result: measured in this run, the mixed plan was NOT faster than {' and '.join(lost)} ({busy}; "
            "a shared host's load shifts these measurements: run it again on a quieter machine).")
