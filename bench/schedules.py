"""1F1B against ZB-H1 and interleaved 1F1B (and any other registered schedule) on one deep local
plan, measured and predicted.

    python bench/schedules.py [--model small] [--seq-len 128] [--micro-batches 8] [--reps 3]
                              [--steps 8] [--warmup 3] [--schedules 1f1b,zb-h1,interleaved]
                              [--chunks 2] [--layers N] [--json OUT]

The plan: 4 stages on examples/clusters/local-cpu.toml, cpu-fast, cpu-fast, cpu-slow, cpu-slow
(EMULATED: the slow kind sleeps 1.5x each compute chunk's CPU time), layers split so the stages'
times are close, ``--micro-batches`` micro-batches; under ``interleaved`` each stage's layers are
split into ``--chunks`` chunks (the planner's layout, ``hethub.search.interleave.with_chunks``; a
one-layer stage gets an empty chunk that passes its input on). Each repetition profiles this machine once and
then runs the plan under every schedule in a shuffled order (``hethub.train`` ranks forked from
this process); the predictor's step time comes from the median of those profiles. Prints, per
schedule, the median measured and the predicted step time, and both as ratios to 1F1B side by
side (measured: the ratio of medians, and the median of each repetition's own ratio, "paired",
which cancels the host's drift between repetitions): the acceptance is the predicted ratio within
5 points of the measured one ("diff" compares with the paired ratio).

The host's cores are shared by the 4 ranks (and by whatever else runs on it): bubbles that one rank
leaves are partly filled by another rank's compute, so a schedule's gain is smaller here than on
devices of their own; the predictor models that sharing (``host_cores``), so the ratios stay
comparable.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _accuracy_plans import PlanDef, build_plan
from hethub.predict.predictor import predict
from hethub.profiler.layers import Repetitions
from hethub.schedules import SCHEDULES
from hethub.search.interleave import with_chunks
from hethub.spec.cluster import load_cluster
from hethub.spec.model import get_model
from predictor_accuracy import CLUSTER, measure_once, median_profiles, profile_for_plan

F, S = "cpu-fast", "cpu-slow"


def deep_plan(*, model: str, seq_len: int, micro_batches: int, layers: int | None = None):
    spec = get_model(model)
    if layers is not None:  # the preset, deeper (e.g. so every stage splits evenly into chunks)
        spec = replace(spec, name=f"{spec.name}-{layers}l", num_layers=layers)
    n = spec.num_layers
    # The slow kind is 2.5x slower: it gets about 1/2.5 of a fast stage's layers.
    slow = max(1, round(n / 7))
    fast = n - 2 * slow
    d = PlanDef("deep", ((2, micro_batches, ((F, (0,), fast - fast // 2), (F, (1,), fast // 2), (S, (2,), slow),
                                            (S, (3,), slow))),))
    return build_plan(d, cluster=load_cluster(CLUSTER), model=spec, seq_len=seq_len)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="small")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--micro-batches", type=int, default=8)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--profile-repeats", type=int, default=3)
    ap.add_argument("--schedules", default=",".join(s for s in SCHEDULES if s != "gpipe"))
    ap.add_argument("--chunks", type=int, default=2, help="model chunks per stage under interleaved")
    ap.add_argument("--layers", type=int, help="the model preset with this many layers instead")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    names = args.schedules.split(",")
    if names[0] != "1f1b":
        names = ["1f1b", *[n for n in names if n != "1f1b"]]
    base = deep_plan(model=args.model, seq_len=args.seq_len, micro_batches=args.micro_batches, layers=args.layers)
    plans = {s: replace(base, schedule=s).validate() for s in names}
    if "interleaved" in plans:
        plans["interleaved"] = replace(base, schedule="interleaved",
                                       pipelines=tuple(with_chunks(p, args.chunks) for p in base.pipelines)).validate()
        print("interleaved chunks per stage: " + " | ".join(
            ",".join(f"{b - a}L" for a, b in st.layer_ranges) for st in plans["interleaved"].pipelines[0].stages))
    print(f"plan: {' | '.join(f'{st.kind} {st.num_layers}L' for st in base.pipelines[0].stages)}, "
          f"{args.micro_batches} micro-batches of {base.pipelines[0].micro_batch_size}, {args.model}, "
          f"seq {args.seq_len}")
    runs: dict[str, list[float]] = {s: [] for s in names}
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
                print(f"  rep {rep} {s:11s} {r['step_s'] * 1e3:8.1f} ms (foreign load {r['foreign']:.2f} cores)",
                      flush=True)
    prof = median_profiles(profiles)
    rows = []
    for s in names:
        rows.append({"schedule": s, "measured_s": statistics.median(runs[s]), "runs_s": runs[s],
                     "predicted_s": predict(plans[s], profiles=prof).step_time_s})
    m0, p0 = rows[0]["measured_s"], rows[0]["predicted_s"]
    print(f"\n{'schedule':11s} {'measured ms':>12s} {'predicted ms':>13s} {'measured/1f1b':>14s} "
          f"{'paired/1f1b':>12s} {'predicted/1f1b':>15s} {'diff (points)':>14s}")
    for r in rows:
        r["measured_ratio"], r["predicted_ratio"] = r["measured_s"] / m0, r["predicted_s"] / p0
        # The same repetition's runs are minutes apart at most: their ratio cancels most of this
        # host's drift and foreign load, which the ratio of medians does not.
        r["paired_ratio"] = statistics.median(a / b for a, b in zip(r["runs_s"], rows[0]["runs_s"], strict=True))
        r["diff_points"] = 100 * (r["predicted_ratio"] - r["paired_ratio"])
        print(f"{r['schedule']:11s} {r['measured_s'] * 1e3:12.1f} {r['predicted_s'] * 1e3:13.1f} "
              f"{r['measured_ratio']:14.3f} {r['paired_ratio']:12.3f} {r['predicted_ratio']:15.3f} "
              f"{r['diff_points']:+14.1f}")
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)}, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
