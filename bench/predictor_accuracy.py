"""How close the predictor is to real runs: step time and per-rank memory, on this machine.

    python bench/predictor_accuracy.py [--model small] [--seq-len 128] [--steps 6] [--warmup 2] [--reps 3]
                                       [--profiles 1] [--sets tuning,held-out] [--json OUT]

1. Profiles this machine (``hethub profile``'s code: mbs 1,2,4, TP 1,2, decoder stacks of 1/2/4/8
   layers) for cpu-fast; cpu-slow gets the same profile, the predictor multiplies it by the kind's
   emulated slowdown. With ``--profiles P`` > 1 it profiles again between repetitions (P times in
   all) and predicts with the median profile, time by time.
2. For every plan of bench/_accuracy_plans.py on examples/clusters/local-cpu.toml (host cores set
   to this machine's usable cores): predicts the step time with the profile, runs the plan through
   torchrun (``launch_local``) ``--reps`` times and takes the median over runs of each run's median
   step time after warm-up steps. Repetitions go round-robin over all plans (every plan once, then
   every plan again), so slow drift of the machine hits all plans alike; the spread (min-max of
   the runs) is printed per plan.
3. Compares each stage's predicted memory (weights + grads + optimizer state, activations) with
   storage accounting of the runtime's own modules (hethub.profile.stage_memory).

Prints one row per plan, then the median and maximum relative errors of each set, separately.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _accuracy_plans import HELD_OUT, TUNING, PlanDef, build_plan
from hethub.plan import Plan
from hethub.predict.predictor import predict
from hethub.predict.profiles import LayerTimes, ProfileSet
from hethub.profile.layers import Repetitions
from hethub.profile.runner import profile_for_kinds
from hethub.profile.stage_memory import measure_stage_memory
from hethub.spec.cluster import load_cluster
from hethub.spec.model import get_model
from runtime_overhead import measured_step_time_s

REPO = Path(__file__).resolve().parents[1]
CLUSTER = REPO / "examples" / "clusters" / "local-cpu.toml"


def usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def profile_machine(model_name: str, *, seq_len: int) -> ProfileSet:
    return profile_for_kinds(model=get_model(model_name), kinds=("cpu-fast", "cpu-slow"), seq_len=seq_len,
                             mbs=(1, 2, 4), tp=(1, 2), reps=Repetitions(warmup=3, repeats=15))


def median_profiles(sets: list[ProfileSet]) -> ProfileSet:
    """Entry by entry, part by part, the median of each time over several profiles of the same shape."""
    if len(sets) == 1:
        return sets[0]

    def med(ts: list[LayerTimes]) -> LayerTimes:
        return LayerTimes(*(statistics.median(getattr(t, a) for t in ts) for a in ("fwd_s", "bwd_s", "update_s")))

    by_kind = {}
    for kind, first in sets[0].by_kind.items():
        profs = [s.by_kind[kind] for s in sets]
        entries = {}
        for key, e0 in first.entries.items():
            es = [p.entries[key] for p in profs]
            depths = tuple((k, med([dict(e.layer_by_depth)[k] for e in es])) for k, _ in e0.layer_by_depth)
            entries[key] = replace(e0, embedding=med([e.embedding for e in es]), layer=med([e.layer for e in es]),
                                   head=med([e.head for e in es]), layer_by_depth=depths)
        by_kind[kind] = replace(first, entries=entries, source=f"median of {len(sets)} profiles")
    return ProfileSet(by_kind=by_kind)


def _cpu_busy_s() -> float:
    """Seconds all cores of the machine spent busy since boot (/proc/stat), for other users' load."""
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    vals = [float(v) for v in fields]
    idle = vals[3] + vals[4]  # idle + iowait
    return (sum(vals[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def wait_for_quiet(*, max_wait_s: float, busy_cores_below: float = 0.3) -> float:
    """Wait (up to max_wait_s) until other processes use under `busy_cores_below` cores; returns that use.

    This machine is shared: other people's test runs steal cores, which no predictor of *our* ranks
    can know. We measure in quiet moments and report the foreign load seen during each run.
    """
    t_end = time.monotonic() + max_wait_s
    while True:
        b0, t0 = _cpu_busy_s(), time.monotonic()
        time.sleep(0.5)
        busy = (_cpu_busy_s() - b0) / (time.monotonic() - t0)
        if busy < busy_cores_below or time.monotonic() > t_end:
            return busy


def measure_once(plan: Plan, *, steps: int, warmup: int, workdir: Path) -> tuple[float, float]:
    """One run of the plan: (median step time s, foreign load in cores during the run)."""
    path = workdir / "plan.json"
    plan.save(path)
    wait_for_quiet(max_wait_s=10.0)
    own0, busy0, t0 = _children_cpu_s(), _cpu_busy_s(), time.monotonic()
    measured = measured_step_time_s(path, nproc=plan.world_size, steps=steps, warmup=warmup)
    wall = time.monotonic() - t0
    foreign = max(0.0, (_cpu_busy_s() - busy0) - (_children_cpu_s() - own0)) / wall
    return measured, foreign


def time_row(plan: Plan, *, profiles: ProfileSet, runs: list[tuple[float, float]]) -> dict:
    pred = predict(plan, profiles=profiles)
    times = [m for m, _ in runs]
    measured = statistics.median(times)
    foreign = statistics.median(f for _, f in runs)
    # The same prediction told about the foreign load measured during the runs (an oracle input,
    # reported separately): what the contention model makes of other users' processes.
    aware = predict(plan, profiles=profiles, host_background_procs=foreign).step_time_s
    return {"predicted_s": pred.step_time_s, "measured_s": measured, "runs_s": times,
            "spread": (max(times) - min(times)) / measured, "foreign_load_cores": foreign,
            "error": (pred.step_time_s - measured) / measured, "sources": pred.compute_sources,
            "load_aware_s": aware, "load_aware_error": (aware - measured) / measured}


def _children_cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def memory_rows(plan: Plan) -> list[dict]:
    rows = []
    for sp in predict(plan).stages:
        got = measure_stage_memory(plan, pipeline=sp.pipeline, stage=sp.stage)
        state = sp.weights_bytes + sp.grads_bytes + sp.optimizer_bytes
        rows.append({"stage": f"p{sp.pipeline}s{sp.stage}", "state_pred": state, "state_meas": got.state.total_bytes,
                     "acts_pred": sp.activations_bytes, "acts_meas": got.activations_bytes,
                     "total_error": (sp.peak_mem_bytes - got.total_bytes) / got.total_bytes})
    return rows


def _summary(label: str, errors: list[float]) -> str:
    abs_err = [abs(e) for e in errors]
    return (f"{label}: median |error| {statistics.median(abs_err):.1%}, max |error| {max(abs_err):.1%} "
            f"({len(errors)} plans)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="small")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=6, help="steps per run (default 6)")
    ap.add_argument("--warmup", type=int, default=2, help="unmeasured steps at the start of each run (default 2)")
    ap.add_argument("--reps", type=int, default=3, help="runs per plan, round-robin over plans (default 3)")
    ap.add_argument("--profiles", type=int, default=1,
                    help="profiles taken, between repetitions; the median is used (default 1)")
    ap.add_argument("--sets", default="tuning,held-out")
    ap.add_argument("--json", help="write all rows here")
    args = ap.parse_args()
    t_start = time.monotonic()
    model = get_model(args.model)
    cluster = replace(load_cluster(CLUSTER), host_cores=usable_cores())
    print(f"machine: {usable_cores()} usable cores, load average {os.getloadavg()[0]:.2f}; model {model.name} "
          f"({model.num_params / 1e6:.2f} M params), seq_len {args.seq_len}", flush=True)
    if args.steps - args.warmup < 1 or args.reps < 1 or args.profiles < 1:
        ap.error("need --steps > --warmup, --reps >= 1 and --profiles >= 1")
    sets: dict[str, tuple[PlanDef, ...]] = {"tuning": TUNING, "held-out": HELD_OUT}
    chosen = [s.strip() for s in args.sets.split(",") if s.strip()]
    plans = [(name, pd, build_plan(pd, cluster=cluster, model=model, seq_len=args.seq_len))
             for name in chosen for pd in sets[name]]
    # One profile before each of the first `--profiles` repetitions (the rest, if any, after the last).
    taken: list[ProfileSet] = []
    runs: list[list[tuple[float, float]]] = [[] for _ in plans]
    with tempfile.TemporaryDirectory() as d:
        for rep in range(args.reps):
            if len(taken) < args.profiles:
                taken.append(profile_machine(args.model, seq_len=args.seq_len))
            t_rep = time.monotonic()
            for i, (_, _, plan) in enumerate(plans):
                runs[i].append(measure_once(plan, steps=args.steps, warmup=args.warmup, workdir=Path(d)))
            print(f"repetition {rep + 1}/{args.reps}: {len(plans)} plans in {time.monotonic() - t_rep:.0f} s",
                  flush=True)
        while len(taken) < args.profiles:
            taken.append(profile_machine(args.model, seq_len=args.seq_len))
    profiles = median_profiles(taken)
    out: dict[str, list[dict]] = {}
    print(f"\n{'set':<9} {'plan':<34} {'ranks':>5} {'predicted':>10} {'measured':>10} {'spread':>17} "
          f"{'error':>7} {'mem error':>9} {'foreign load':>12} {'load-aware':>10}", flush=True)
    for (name, pd, plan), plan_runs in zip(plans, runs, strict=True):
        row = {"plan": pd.name, "ranks": plan.world_size, **time_row(plan, profiles=profiles, runs=plan_runs),
               "memory": memory_rows(plan)}
        mem = max(abs(m["total_error"]) for m in row["memory"])
        out.setdefault(name, []).append(row)
        lo, hi = min(row["runs_s"]) * 1e3, max(row["runs_s"]) * 1e3
        print(f"{name:<9} {pd.name:<34} {plan.world_size:>5} {row['predicted_s'] * 1e3:>8.1f}ms "
              f"{row['measured_s'] * 1e3:>8.1f}ms {lo:>6.1f}-{hi:>6.1f}ms {row['error']:>+7.1%} {mem:>9.1%} "
              f"{row['foreign_load_cores']:>7.2f} cores {row['load_aware_error']:>+10.1%}", flush=True)
    print()
    for name, rows in out.items():
        spreads = [r["spread"] for r in rows]
        print(_summary(f"step time, {name:<8}", [r["error"] for r in rows])
              + f"; run-to-run spread (max-min)/median: median {statistics.median(spreads):.1%}, "
                f"max {max(spreads):.1%}")
        print(_summary(f"  load-aware, {name:<8}", [r["load_aware_error"] for r in rows]))
    for name, rows in out.items():
        mems = [m for r in rows for m in r["memory"]]
        exact = all(m["state_pred"] == m["state_meas"] for m in mems)
        acts = [(m["acts_pred"] - m["acts_meas"]) / m["acts_meas"] for m in mems]
        print(f"memory, {name:<8}: weights+grads+optimizer {'exact' if exact else 'NOT exact'} on {len(mems)} "
              f"stages; activations error median {statistics.median(abs(a) for a in acts):.1%}, max "
              f"{max(abs(a) for a in acts):.1%}; total max {max(abs(m['total_error']) for m in mems):.1%}")
    print(f"load average at the end {os.getloadavg()[0]:.2f}; total {time.monotonic() - t_start:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
