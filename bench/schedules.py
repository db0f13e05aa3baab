"""1F1B against ZB-H1 and interleaved 1F1B (and any other registered schedule) on one deep local
plan, measured and predicted.

    python bench/schedules.py [--model small] [--layers 16] [--hidden 256] [--seq-len 128]
                              [--micro-batches 8] [--micro-batch-size 1] [--reps 3] [--steps 5]
                              [--warmup 2] [--schedules 1f1b,zb-h1,interleaved] [--chunks 2]
                              [--fast-slowdown 2] [--json OUT]

The plan: 4 stages on examples/clusters/local-cpu.toml, cpu-fast, cpu-fast, cpu-slow, cpu-slow,
layers split so the stages' times are close (16 layers: 6, 6, 2, 2), ``--micro-batches``
micro-batches, the small preset widened to ``--hidden`` (the weight GEMMs that ZB-H1's W runs are a
larger share of a wider layer's backward); under
``interleaved`` each stage's layers are split into ``--chunks`` chunks (the planner's layout,
``hethub.search.polish.with_chunks``; a one-layer stage gets an empty chunk that passes its
input on). Both kinds are EMULATED here: cpu-fast ``--fast-slowdown`` k times slower than this
host's core and cpu-slow 2.5 k (the cluster file's ratio; default k = 2), i.e. after each forward, backward (B) or
weight-gradient pass (W) a rank sleeps (k - 1) x the CPU time it used (hethub.runtime.slowdown).
So a rank needs a core only 1/k of the time and 4 ranks fit on 2 cores: a rank's bubble is idle
time, as on devices of their own, rather than time another rank computes in (with cpu-fast at full
speed, 4 ranks on 2 cores fill each other's bubbles and no schedule can gain much).

Once at the start the bench measures this host's wake penalty and what the runtime's split backward
costs, B and W against one whole backward (``hethub profile --wake-penalty --split-backward``'s
code); each repetition profiles the layers once and then runs the plan under every schedule in a
shuffled order (``hethub.train`` ranks forked from this process). The prediction is the predictor's with
the emulation host hook (``hethub.emulation.host_model``: the ranks' shared cores, the sleep that
needs none, the wake penalty, the measured split backward, and as many always-busy foreign
processes as the median CPU other processes used during the runs) from the median of the
profiles; the ratios predicted for an idle host and without the hook are printed too. Prints, per schedule, the median
measured and the predicted step time, and both as ratios to 1F1B side by side (measured: the
ratio of medians, and the median of each repetition's own ratio, "paired", which cancels the
host's drift between repetitions): the acceptance is the predicted ratio within 5 points of the
measured one ("diff" compares with the paired ratio). The load average and the CPU other
processes used during each run are printed with it.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _accuracy_plans import PlanDef, build_plan
from hethub.emulation.effects import HostEffects
from hethub.emulation.host import host_model, usable_cores
from hethub.emulation.measure.split import measure_split_backward
from hethub.emulation.measure.wake import measure_wake_penalty
from hethub.predict.predictor import predict
from hethub.profiler.layers import Repetitions
from hethub.schedules import SCHEDULES
from hethub.search.polish import with_chunks
from hethub.spec.cluster import Cluster, load_cluster
from hethub.spec.model import get_model
from predictor_accuracy import CLUSTER, measure_once, median_profiles, profile_for_plan

F, S = "cpu-fast", "cpu-slow"


def emulated_cluster(fast_slowdown: float) -> Cluster:
    """examples/clusters/local-cpu.toml with cpu-fast emulated `fast_slowdown` times slower than a
    core and cpu-slow as many times slower again as the file makes it (2.5x)."""
    c = load_cluster(CLUSTER)
    ratio = c.kinds[S].emulated_slowdown / c.kinds[F].emulated_slowdown
    kinds = {k: replace(v, emulated_slowdown=fast_slowdown * (ratio if k == S else 1.0)) for k, v in c.kinds.items()}
    return replace(c, name=f"{c.name}-fast-x{fast_slowdown:g}", kinds=kinds)


def deep_plan(*, model: str, seq_len: int, micro_batches: int, layers: int | None = None,
              cluster: Cluster | None = None, micro_batch_size: int = 2, hidden: int | None = None):
    spec = get_model(model)
    if layers is not None:  # the preset, deeper (e.g. so every stage splits evenly into chunks)
        spec = replace(spec, name=f"{spec.name}-{layers}l", num_layers=layers)
    if hidden is not None:  # wider, same head size, GQA ratio and FFN ratio
        if hidden % (spec.head_dim * spec.num_heads // spec.num_kv_heads):
            raise SystemExit(f"--hidden {hidden}: use a multiple of "
                             f"{spec.head_dim * spec.num_heads // spec.num_kv_heads} for {spec.name}")
        heads = hidden // spec.head_dim
        spec = replace(spec, name=f"{spec.name}-h{hidden}", hidden_size=hidden, num_heads=heads,
                       num_kv_heads=heads * spec.num_kv_heads // spec.num_heads,
                       ffn_hidden_size=round(spec.ffn_hidden_size * hidden / spec.hidden_size))
    n = spec.num_layers
    # The slow kind is 2.5x slower: it gets about 1/2.5 of a fast stage's layers.
    slow = max(1, round(n / 7))
    fast = n - 2 * slow
    stages = ((F, (0,), fast - fast // 2), (F, (1,), fast // 2), (S, (2,), slow), (S, (3,), slow))
    d = PlanDef("deep", ((micro_batch_size, micro_batches, stages),))
    return build_plan(d, cluster=cluster or load_cluster(CLUSTER), model=spec, seq_len=seq_len)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="small")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--micro-batches", type=int, default=8)
    ap.add_argument("--micro-batch-size", type=int, default=1)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--profile-repeats", type=int, default=3)
    ap.add_argument("--schedules", default=",".join(s for s in SCHEDULES if s != "gpipe"))
    ap.add_argument("--chunks", type=int, default=2, help="model chunks per stage under interleaved")
    ap.add_argument("--layers", type=int, default=16,
                    help="the model preset with this many layers (default 16: stages of 6, 6, 2, 2 layers, which "
                         "split into equal chunks)")
    ap.add_argument("--fast-slowdown", type=float, default=2.0,
                    help="cpu-fast emulated this many times slower than a core, cpu-slow 2.5x that (default 2; 1: "
                         "cpu-fast at full speed, the ranks then fill each other's bubbles)")
    ap.add_argument("--hidden", type=int, default=256,
                    help="the preset widened to this hidden size (default 256: the small preset's 128 leaves the "
                         "weight GEMMs, which W runs, ~1/4 of the backward; 256 ~0.3)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if args.steps - args.warmup < 1 or args.reps < 1 or args.fast_slowdown < 1:
        ap.error("need --steps > --warmup, --reps >= 1 and --fast-slowdown >= 1")
    names = args.schedules.split(",")
    if names[0] != "1f1b":
        names = ["1f1b", *[n for n in names if n != "1f1b"]]
    torch.set_num_threads(1)  # as every rank runs; also before forking ranks
    t_start, load_start = time.monotonic(), os.getloadavg()
    cluster = emulated_cluster(args.fast_slowdown)
    base = deep_plan(model=args.model, seq_len=args.seq_len, micro_batches=args.micro_batches, layers=args.layers,
                     cluster=cluster, micro_batch_size=args.micro_batch_size,
                     hidden=None if args.hidden == get_model(args.model).hidden_size else args.hidden)
    plans = {s: replace(base, schedule=s).validate() for s in names}
    if "interleaved" in plans:
        plans["interleaved"] = replace(base, schedule="interleaved",
                                       pipelines=tuple(with_chunks(p, args.chunks) for p in base.pipelines)).validate()
        print("interleaved chunks per stage: " + " | ".join(
            ",".join(f"{b - a}L" for a, b in st.layer_ranges) for st in plans["interleaved"].pipelines[0].stages))
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {usable_cores()} usable cores, load average "
          f"{load_start[0]:.2f} / {load_start[1]:.2f} / {load_start[2]:.2f} (1/5/15 min)")
    print(f"plan: {' | '.join(f'{st.kind} {st.num_layers}L' for st in base.pipelines[0].stages)}, "
          f"{args.micro_batches} micro-batches of {base.pipelines[0].micro_batch_size}, {base.model.name}, "
          f"seq {args.seq_len}; EMULATED cpu-fast x{cluster.kinds[F].emulated_slowdown:g}, "
          f"cpu-slow x{cluster.kinds[S].emulated_slowdown:g}")
    mbs = base.pipelines[0].micro_batch_size
    effects = dict.fromkeys((F, S), HostEffects(
        wake_penalty=measure_wake_penalty(base.model, mbs=mbs, seq_len=args.seq_len),
        split_backward=measure_split_backward(base.model, mbs=mbs, seq_len=args.seq_len)))
    b_share, w_share = effects[F].split_backward or (0.5, 0.5)
    print(f"host: split backward B {b_share:.2f} + W {w_share:.2f} of one whole backward; wake penalty "
          + ", ".join(f"{x * 1e3:.2f} ms after {g * 1e3:.0f} ms" for g, x in effects[F].wake_penalty), flush=True)
    runs: dict[str, list[float]] = {s: [] for s in names}
    foreign: list[float] = []
    profiles = []
    reps = Repetitions(warmup=1, repeats=args.profile_repeats)
    with tempfile.TemporaryDirectory() as d:
        for rep in range(args.reps):
            profiles.append(profile_for_plan(base, reps=reps))
            order = names[:]
            random.Random(rep).shuffle(order)
            for s in order:
                r = measure_once(plans[s], steps=args.steps, warmup=args.warmup, workdir=Path(d), launcher="fork")
                runs[s].append(r["step_s"])
                foreign.append(r["foreign"])
                cpu = sum(rk["compute_cpu_s"] for rk in r["ranks"]) / r["step_s"]
                print(f"  rep {rep} {s:11s} {r['step_s'] * 1e3:8.1f} ms (ranks' compute {cpu:.2f} cores, "
                      f"foreign load {r['foreign']:.2f} cores)", flush=True)
    prof = median_profiles(profiles)
    # Other people's busy processes share the cores with the ranks: the host model takes their
    # measured number (the median CPU they used during the runs, in cores) as an input.
    background = statistics.median(foreign)
    loaded = host_model(cluster, effects=effects, background_procs=background)
    idle = host_model(cluster, effects=effects)
    rows = []
    for s in names:
        rows.append({"schedule": s, "measured_s": statistics.median(runs[s]), "runs_s": runs[s],
                     "predicted_s": predict(plans[s], profiles=prof, host=loaded).step_time_s,
                     "predicted_idle_host_s": predict(plans[s], profiles=prof, host=idle).step_time_s,
                     "predicted_no_host_s": predict(plans[s], profiles=prof).step_time_s})
    m0, p0 = rows[0]["measured_s"], rows[0]["predicted_s"]
    print(f"\n{'schedule':11s} {'measured ms':>12s} {'predicted ms':>13s} {'measured/1f1b':>14s} "
          f"{'paired/1f1b':>12s} {'predicted/1f1b':>15s} {'diff (points)':>14s}")
    for r in rows:
        r["measured_ratio"], r["predicted_ratio"] = r["measured_s"] / m0, r["predicted_s"] / p0
        r["predicted_no_host_ratio"] = r["predicted_no_host_s"] / rows[0]["predicted_no_host_s"]
        r["predicted_idle_host_ratio"] = r["predicted_idle_host_s"] / rows[0]["predicted_idle_host_s"]
        # The same repetition's runs are minutes apart at most: their ratio cancels most of this
        # host's drift and foreign load, which the ratio of medians does not.
        r["paired_ratio"] = statistics.median(a / b for a, b in zip(r["runs_s"], rows[0]["runs_s"], strict=True))
        r["diff_points"] = 100 * (r["predicted_ratio"] - r["paired_ratio"])
        print(f"{r['schedule']:11s} {r['measured_s'] * 1e3:12.1f} {r['predicted_s'] * 1e3:13.1f} "
              f"{r['measured_ratio']:14.3f} {r['paired_ratio']:12.3f} {r['predicted_ratio']:15.3f} "
              f"{r['diff_points']:+14.1f}")
    load_end = os.getloadavg()
    print(f"(predicted: with the host hook and {background:.2f} busy foreign processes, the median measured; "
          "ratio to 1f1b on an idle host: "
          + ", ".join(f"{r['schedule']} {r['predicted_idle_host_ratio']:.3f}" for r in rows)
          + "; without the host hook: "
          + ", ".join(f"{r['schedule']} {r['predicted_no_host_ratio']:.3f}" for r in rows) + ")")
    print(f"foreign load during the runs: median {statistics.median(foreign):.2f} cores (max {max(foreign):.2f}); "
          f"load average at the end {load_end[0]:.2f} / {load_end[1]:.2f} / {load_end[2]:.2f}; "
          f"total {time.monotonic() - t_start:.0f} s")
    if args.json:
        out = {"args": vars(args) | {"json": str(args.json)}, "load_average_start": load_start,
               "load_average_end": load_end, "foreign_cores": foreign, "rows": rows}
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
