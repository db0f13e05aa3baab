"""Predicted vs measured memory per part, for the local CPU plans, through the real runtime.

    python bench/memory_accuracy.py [--model small] [--seq-len 128] [--steps 2]
        [--sets tuning,math,recompute,bf16] [--json OUT]

For every plan of bench/_accuracy_plans.py's TUNING set on examples/clusters/local-cpu.toml (and two
of them again with math attention on every kind; set ``recompute``: those two with their stages
recomputing selective, full, none, ... in turn, flash and math; set ``bf16``: those two in
bf16-mixed, every rank autocasting on the CPU), it runs the plan's ranks (forked gloo
processes, ``hethub.comm.local_ranks``) through the runtime's own Trainer for ``--steps`` steps and
accounts, on each rank (``hethub.profiler.stage_memory.measure_rank_memory``):

* weights, gradients and AdamW state: storage bytes of the module's parameters (in bf16-mixed: the
  bf16 parameters, their fp32 masters, and the peak of any bf16 copies the GEMMs hold, which the
  model counts as weights), the gradient buffer after backward, and the optimizer's per-parameter
  tensors after the step;
* activations: the tensors autograd holds for backward *at the same time*, followed from save to
  release through the real 1F1B/GPipe schedule (``saved_tensors_hooks``): the in-flight peak;
* point-to-point buffers: the send and receive buffers the executor holds at once (its trace,
  ``StepTrace.max_p2p_bytes``: distinct live storages after each op's sends are posted), the largest over
  the stage's TP ranks (the model prices the busiest: rank 0 sends and receives on both boundaries);
* gradient-sync buffer: the float buffers the gradient sync reduces beside its gradient buffer
  (full-size buckets where holders differ in TP degree; none otherwise).

It prints, per rank, predicted / measured for each part and the relative error, then the largest
error per part. Target: every part within 10%. CPU has no framework context, collective buffers or
allocator fragmentation (the cpu kind's catalog entries are 0): those parts are GPU-only and
checked by bench/gpu_memory_check.py where a GPU is lent.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _accuracy_plans import TUNING, build_plan
from hethub.comm.factory import make_communicator
from hethub.comm.local_ranks import run_local_ranks
from hethub.plan import Plan
from hethub.predict.predictor import predict
from hethub.profiler.stage_memory import measure_rank_memory
from hethub.spec.cluster import load_cluster
from hethub.spec.model import get_model

REPO = Path(__file__).resolve().parents[1]
CLUSTER = REPO / "examples" / "clusters" / "local-cpu.toml"
PARTS = ("weights", "grads", "optimizer", "activations", "p2p_buffers", "grad_sync_buffer")
MATH_PLANS = ("2 stages fast/fast 4|4", "TP2 fast 5 | slow 3")
MIXED = "bf16-mixed"
TARGET = 0.10


def _worker(rank: int, plan_dict: dict, steps: int) -> dict:
    plan = Plan.from_dict(plan_dict)
    comm = make_communicator(plan=plan, rank=rank)
    precision = plan.precision if plan.precision != "fp32" else None
    return asdict(measure_rank_memory(plan, rank=rank, comm=comm, steps=steps, precision=precision))


def plans(*, sets: list[str], model_name: str, seq_len: int) -> list[Plan]:
    cluster, model = load_cluster(CLUSTER), get_model(model_name)
    out = []
    for d in TUNING:
        plan = build_plan(d, cluster=cluster, model=model, seq_len=seq_len)
        if "tuning" in sets:
            out.append(plan)
        if "math" in sets and d.name in MATH_PLANS:
            settings = {k: {"attention": "math"} for k in cluster.kind_names}
            out.append(Plan.from_dict({**plan.with_meta(bench=f"{d.name}, math attention").to_dict(),
                                       "training": {**plan.to_dict()["training"], "kinds": settings}}))
        if "recompute" in sets and d.name in MATH_PLANS:
            out += [_recomputing(plan, name=d.name, attention=att, cluster_kinds=cluster.kind_names)
                    for att in ("flash", "math")]
        if "bf16" in sets and d.name in MATH_PLANS:
            out.append(_mixed(plan, name=d.name))
    return out


def _mixed(plan: Plan, *, name: str) -> Plan:
    """``plan`` in bf16-mixed: its CPU kinds told they run it (the Trainer autocasts them on request)."""
    kinds = {n: replace(k, precisions=(MIXED, "fp32")) for n, k in plan.cluster.kinds.items()}
    return replace(plan, cluster=replace(plan.cluster, kinds=kinds), precision=MIXED,
                   meta={**plan.meta, "bench": f"{name}, {MIXED}"}).validate()


def _recomputing(plan: Plan, *, name: str, attention: str, cluster_kinds: tuple[str, ...]) -> Plan:
    """``plan`` with its stages recomputing selective, full, none, ... in turn, on ``attention``."""
    modes = ("selective", "full", "none")
    d = plan.with_meta(bench=f"{name}, sel/full/none, {attention}").to_dict()
    i = 0
    for p in d["pipelines"]:
        for st in p["stages"]:
            st["recompute"] = modes[i % len(modes)]
            i += 1
    d["training"] = {**d["training"], "kinds": {k: {"attention": attention} for k in cluster_kinds}}
    return Plan.from_dict(d)


def rows_for(plan: Plan, *, steps: int) -> list[dict]:
    pred = {(s.pipeline, s.stage): s for s in predict(plan).stages}
    measured = run_local_ranks(plan.world_size, _worker, plan.to_dict(), steps, timeout_s=600)
    # A stage's point-to-point term is its busiest TP rank's (rank 0 sends and receives on both
    # boundaries; on a hop to fewer TP ranks the others send nothing): compared with that rank.
    p2p_of_stage: dict[tuple[int, int], int] = {}
    for m in measured:
        key = (m["pipeline"], m["stage"])
        p2p_of_stage[key] = max(p2p_of_stage.get(key, 0), m["p2p_buffers_bytes"])
    rows = []
    for m in measured:
        sp = pred[(m["pipeline"], m["stage"])]
        mem = sp.memory
        predicted = {"weights": mem.weights_bytes + mem.master_weights_bytes, "grads": mem.grads_bytes,
                     "optimizer": mem.optimizer_bytes, "activations": mem.activations_bytes,
                     "p2p_buffers": mem.p2p_buffers_bytes, "grad_sync_buffer": mem.grad_sync_buffer_bytes}
        got = {"weights": m["weights_bytes"] + m["weight_copies_bytes"], "grads": m["grads_bytes"],
               "optimizer": m["optimizer_bytes"], "activations": m["activations_peak_bytes"],
               "p2p_buffers": p2p_of_stage[(m["pipeline"], m["stage"])],
               "grad_sync_buffer": m["grad_sync_buffer_bytes"]}
        rows.append({"plan": plan.meta.get("bench", ""), "rank": m["rank"], "stage": (m["pipeline"], m["stage"]),
                     "attention": sp.attention, "in_flight": sp.in_flight, "pred": predicted, "meas": got})
    return rows


def rel_err(pred: float, meas: float) -> float | None:
    """Relative error of the prediction; None where both are below 1 KiB (the part is absent: no
    sync without replicas, where only the scalar loss and norm are all-reduced)."""
    if pred < 1024 and meas < 1024:
        return None
    return (pred - meas) / meas if meas else float("inf")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="small")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=2,
                    help="steps per plan (AdamW's state exists after the first; the second runs with it)")
    ap.add_argument("--sets", default="tuning,math,recompute,bf16")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()
    torch.set_num_threads(1)  # as every rank runs; also before forking ranks
    t0 = time.perf_counter()
    worst: dict[str, float] = {p: 0.0 for p in PARTS}
    all_rows = []
    head = f"{'plan':<40} {'rank':>4} {'att':>5} " + " ".join(f"{p[:11]:>20}" for p in PARTS)
    print(head)
    print(" " * 51 + " ".join(f"{'pred/meas KiB  err':>20}" for _ in PARTS))
    for plan in plans(sets=args.sets.split(","), model_name=args.model, seq_len=args.seq_len):
        for r in rows_for(plan, steps=args.steps):
            cells = []
            for p in PARTS:
                e = rel_err(r["pred"][p], r["meas"][p])
                if e is not None:
                    worst[p] = max(worst[p], abs(e))
                cells.append(f"{r['pred'][p] / 1024:>7.0f}/{r['meas'][p] / 1024:<7.0f}"
                             + (f"{e:+5.1%}" if e is not None else "    -"))
            print(f"{r['plan'][:40]:<40} {r['rank']:>4} {r['attention']:>5} " + " ".join(f"{c:>20}" for c in cells))
            all_rows.append(r)
    print()
    for p in PARTS:
        verdict = "ok" if worst[p] <= TARGET else "OVER TARGET"
        print(f"largest |error| {p:<17} {worst[p]:6.1%}  (target {TARGET:.0%}: {verdict})")
    print(f"{len(all_rows)} ranks in {time.perf_counter() - t0:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(all_rows, indent=1, default=str))


if __name__ == "__main__":
    main()
