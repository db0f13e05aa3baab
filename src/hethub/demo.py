"""`hethub demo`: the built-in local default, end to end on this machine.

On the embedded local-cpu cluster (4 CPU ranks: 2 cpu-fast, 2 cpu-slow emulated 2.5x slower) it
measures this CPU's layer times, plans the `small` model with the `uniform` baseline and with the
hethub planner, trains each plan for a few dozen steps through torchrun, and prints for each the
measured and predicted tokens/s and the loss curve. It ends with the report of the planner's run.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass, replace
from importlib import resources
from pathlib import Path

from hethub.emulation.effects import HostEffects
from hethub.emulation.host import host_model
from hethub.errors import RuntimeSetupError
from hethub.plan import Plan
from hethub.predict.profiles import ProfileSet
from hethub.predict.result import Prediction
from hethub.search.config import PlannerConfig
from hethub.search.planner import PlanResult, make_plan
from hethub.spec.cluster import Cluster, load_cluster
from hethub.spec.model import PRESETS

SPARK = "▁▂▃▄▅▆▇█"


@dataclass(frozen=True)
class DemoConfig:
    cluster: str | None = None  # None: the embedded local-cpu.toml
    model: str = "small"
    global_batch: int = 16
    seq_len: int = 128
    steps: int = 30
    out_dir: str = "runs/demo"


def default_cluster_path() -> Path:
    return Path(str(resources.files("hethub.spec").joinpath("local-cpu.toml")))


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
    profiles = profile_for_kinds(model=model, kinds=cluster.kind_names, seq_len=cfg.seq_len, mbs=mbs)
    effects = None
    if cluster.host is not None:
        from hethub.emulation.measure.effects import measure_host_effects

        effects = measure_host_effects(model, mbs=mbs, seq_len=cfg.seq_len)
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


def _train(plan_path: Path, plan: Plan, *, steps: int, metrics: Path) -> list[dict]:
    from hethub.runtime.launch import launch_local

    metrics.unlink(missing_ok=True)
    proc = launch_local(plan_path, nproc=plan.world_size, steps=steps, metrics=metrics, capture=True,
                        extra_args=["--lr", "3e-3", "--warmup-steps", "3", "--trace"])
    if proc.returncode != 0:
        raise RuntimeSetupError(f"demo training of {plan_path} failed (exit {proc.returncode}):\n"
                                f"{proc.stderr[-3000:]}\nFix: run 'make test' to see which part is broken.")
    return [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]


def _describe(plan: Plan) -> str:
    parts = []
    for p in plan.pipelines:
        stages = " | ".join(f"{s.kind}{'x' + str(s.tp) if s.tp > 1 else ''}:{s.num_layers}L" for s in p.stages)
        parts.append(f"[{stages}] x{p.num_micro_batches}mb")
    return "  ".join(parts)


def best_with_every_kind(res: PlanResult, cluster: Cluster) -> tuple[Plan, Prediction] | None:
    """The fastest of the planner's top plans that puts work on every kind of ``cluster`` (None if none)."""
    kinds = set(cluster.kind_names)
    for plan, pred in res.alternatives:
        if {s.kind for p in plan.pipelines for s in p.stages} == kinds:
            return plan, pred
    return None


def why_left_out(res: PlanResult, every: tuple[Plan, Prediction] | None, left_out: list[str]) -> str:
    """One sentence: what using the left-out kinds would cost, by the predictor's numbers."""
    best = res.prediction.tokens_per_s
    if every is None:
        return (f"none of the planner's {len(res.alternatives)} best plans uses every kind; each plan with "
                f"{', '.join(left_out)} is predicted slower than {best:,.0f} tokens/s without it.")
    with_all = every[1].tokens_per_s
    return (f"the best plan that also uses it is predicted at {with_all:,.0f} tokens/s, {1 - with_all / best:.0%} "
            f"below the {best:,.0f} tokens/s without it (the slow ranks' pipeline stages or replicas hold the "
            "step back more than their compute adds). Both are trained below.")


def run_demo(cfg: DemoConfig) -> dict[str, dict]:
    t_start = time.perf_counter()
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cluster = load_cluster(cfg.cluster or default_cluster_path())
    model = PRESETS[cfg.model]
    print(f"hethub demo: {model.name} ({model.num_params / 1e6:.2f} M parameters) on '{cluster.name}': "
          f"{cluster.num_devices} CPU ranks on this host.")
    emulated = [f"{k.name} {k.emulated_slowdown:g}x slower" for k in cluster.kinds.values() if k.emulated]
    if emulated:
        print(f"EMULATION: {', '.join(emulated)} (ranks sleep after each compute chunk); not real hardware.")
    print("measuring this CPU's layer times, links and all-reduce for the predictor ...", flush=True)
    profiles, effects = measure_profiles(cluster, cfg, out)
    if cluster.num_devices > 1:
        cluster = measure_host(cluster, out)
    host = host_model(cluster, effects=dict.fromkeys(cluster.kind_names, effects) if effects else None)
    results: dict[str, dict] = {}
    runs: list[tuple[str, PlanResult | None]] = [("uniform", None), ("hethub", None)]
    for i, (strategy, given) in enumerate(runs):
        res: PlanResult = given or make_plan(
            cluster=cluster, model=model, profiles=profiles, host=host,
            config=PlannerConfig(global_batch=cfg.global_batch, seq_len=cfg.seq_len, strategy=strategy,
                                 precision="fp32", top_k=16 if strategy == "hethub" else 1))
        if strategy == "hethub":
            left_out = sorted(set(cluster.kind_names) - {s.kind for p in res.plan.pipelines for s in p.stages})
            if left_out:  # say why, and also run the best plan that uses every kind
                every = best_with_every_kind(res, cluster)
                print(f"\n[hethub] leaves out {', '.join(left_out)}: {why_left_out(res, every, left_out)}")
                if every is not None:
                    runs.insert(i + 1, ("hethub-every-kind", replace(res, plan=every[0], prediction=every[1])))
        plan_path = out / f"plan-{strategy}.json"
        res.plan.save(plan_path)
        print(f"\n[{strategy}] {_describe(res.plan)}")
        print(f"[{strategy}] training {cfg.steps} steps on {res.plan.world_size} ranks ...", flush=True)
        rows = _train(plan_path, res.plan, steps=cfg.steps, metrics=out / f"metrics-{strategy}.jsonl")
        steady = rows[2:] or rows
        measured = statistics.median(r["tokens_per_s"] for r in steady)
        losses = [r["loss"] for r in rows]
        results[strategy] = {"measured_tokens_per_s": measured, "predicted_tokens_per_s": res.prediction.tokens_per_s,
                             "losses": losses, "plan": str(plan_path)}
        print(f"[{strategy}] measured {measured:,.0f} tokens/s, predicted {res.prediction.tokens_per_s:,.0f} "
              f"tokens/s ({(res.prediction.tokens_per_s - measured) / measured:+.0%})")
        print(f"[{strategy}] loss {losses[0]:.3f} -> {losses[-1]:.3f}  {sparkline(losses)}")
    u, h = results["uniform"], results["hethub"]
    print(f"\nplanner vs uniform: {h['measured_tokens_per_s'] / u['measured_tokens_per_s']:.2f}x measured, "
          f"{h['predicted_tokens_per_s'] / u['predicted_tokens_per_s']:.2f}x predicted (emulated slow kind).")
    if "hethub-every-kind" in results:
        e = results["hethub-every-kind"]
        print(f"planner's best plan vs its best plan using every kind: "
              f"{h['measured_tokens_per_s'] / e['measured_tokens_per_s']:.2f}x measured, "
              f"{h['predicted_tokens_per_s'] / e['predicted_tokens_per_s']:.2f}x predicted.")
    report_dir = out / "report"
    from hethub.predict.predictor import predict
    from hethub.report import write_report

    plan = Plan.load(h["plan"])
    paths = write_report(plan=plan, prediction=predict(plan, profiles=profiles, timeline=True, host=host),
                         out_dir=report_dir, metrics_path=out / "metrics-hethub.jsonl")
    print(f"report of the planner's run: {report_dir}/ ({', '.join(p.name for p in paths.written)})")
    if paths.note:
        print(f"note: {paths.note}")
    (out / "demo.json").write_text(json.dumps(results, indent=2))
    print(f"demo finished in {time.perf_counter() - t_start:.0f} s; results in {out}/demo.json")
    return results
