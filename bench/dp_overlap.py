"""Exposed data-parallel gradient sync per step, with and without overlapping the buckets' reductions
with the last backward, measured side by side in one run on forked CPU ranks.

    python bench/dp_overlap.py [--model small] [--seq-len 128] [--mbs 2] [--micro-batches 2]
        [--bucket-elems 200000] [--steps 10] [--warmup 2] [--threads 1] [--slowdown 2]

A 2-replica plan (each replica the whole model on one rank, gloo over loopback), its kind emulated
``--slowdown`` times slower than this host computes: the ranks sleep part of each backward, as a
host does while its accelerator computes, so the reductions' CPU work can overlap something (with
``--slowdown 1`` every core computes all the time and gloo's threads can only steal from the
backward: the overlap then mostly moves work around). Every rank builds
two Trainers of the same plan, one reducing each gradient bucket as soon as its gradients are final
in the last backward (``overlap_grad_reduce``, the default), one starting every bucket after the
backward; their steps alternate, so both see the same machine load. A rank's ``sync_s`` is the time
from the end of its last backward op to the end of its gradient sync; the rank whose backward ended
last waits for nobody there (the others wait for it at the loss all-reduce), so the step's exposed
sync is the smallest ``sync_s`` over the ranks. The script prints the median over the measured steps
for each mode, their ratio, and the step times. Only ratios measured in this run are printed:
absolute times on a shared VM move with its load.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hethub.comm.factory import make_communicator
from hethub.comm.local_ranks import run_local_ranks
from hethub.plan import Pipeline, Plan, Stage
from hethub.runtime.optim import OptimConfig
from hethub.runtime.trainer import Trainer, TrainerConfig
from hethub.spec.cluster import Cluster, Link, NodeGroup
from hethub.spec.kind import DeviceKind
from hethub.spec.model import get_model


def two_replicas(model: str, *, seq_len: int, mbs: int, micro_batches: int, slowdown: float) -> Plan:
    spec = get_model(model)
    kind = DeviceKind(name="cpu", vendor="cpu", mem_bytes=2**34, peak_flops=1e11, intra_node_bw_bytes_per_s=1.5e9,
                      intra_node_latency_s=5e-5, backend="gloo", emulated_slowdown=slowdown)
    cluster = Cluster(name="local", kinds={"cpu": kind}, groups=(NodeGroup("cpu", 1, 2),),
                      inter_node=Link(1.5e9, 5e-5), cross_kind=Link(1.5e9, 5e-5))
    pipes = tuple(Pipeline(micro_batch_size=mbs, num_micro_batches=micro_batches,
                           stages=(Stage(kind="cpu", devices=(d,), layers=(0, spec.num_layers), embedding=True,
                                         head=True),)) for d in (0, 1))
    return Plan(model=spec, cluster=cluster, global_batch=2 * mbs * micro_batches, seq_len=seq_len,
                pipelines=pipes, precision="fp32").validate()


def _worker(rank: int, plan_dict: dict, args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    plan = Plan.from_dict(plan_dict)
    comm = make_communicator(plan=plan, rank=rank)
    optim = OptimConfig(total_steps=2 * (args.steps + args.warmup))
    trainers = {mode: Trainer(plan, rank=rank, comm=comm,
                              cfg=TrainerConfig(optim=optim, grad_bucket_elems=args.bucket_elems,
                                                overlap_grad_reduce=mode == "overlap"))
                for mode in ("overlap", "after")}
    g = torch.Generator().manual_seed(0)
    out: dict[str, list[tuple[float, float]]] = {m: [] for m in trainers}
    buckets = len(trainers["overlap"].grad_sync.buffer.buckets)
    for step in range(args.warmup + args.steps):
        batch = torch.randint(0, plan.model.vocab_size, (plan.global_batch, plan.seq_len + 1), generator=g)
        order = ("overlap", "after") if step % 2 == 0 else ("after", "overlap")
        for mode in order:
            rec = trainers[mode].train_step(batch, step=step)
            if rec is not None and step >= args.warmup:
                out[mode].append((min(r["sync_s"] for r in rec["ranks"]), rec["step_time_s"]))
    return {"records": out, "buckets": buckets}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="small")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--mbs", type=int, default=2)
    ap.add_argument("--micro-batches", type=int, default=2)
    ap.add_argument("--bucket-elems", type=int, default=200_000,
                    help="gradient bucket size (the runtime's default, 40M, is one bucket for this small model)")
    ap.add_argument("--steps", type=int, default=10, help="measured steps per mode")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--slowdown", type=float, default=2.0,
                    help="emulated device slowdown (docs/runtime.md): each compute chunk is followed by (k-1)x "
                         "its CPU time asleep, a device computing while its host moves the gradients; 1: none")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    plan = two_replicas(args.model, seq_len=args.seq_len, mbs=args.mbs, micro_batches=args.micro_batches,
                        slowdown=args.slowdown)
    t0 = time.perf_counter()
    res = [r for r in run_local_ranks(2, _worker, plan.to_dict(), args, timeout_s=1200) if r["records"]["overlap"]]
    (log,) = res
    rec = log["records"]
    med = {m: (statistics.median(s for s, _ in rec[m]), statistics.median(t for _, t in rec[m])) for m in rec}
    print(f"2 replicas (emulated slowdown {args.slowdown:g}) of '{args.model}' "
          f"({plan.model.num_params / 1e6:.2f}M parameters, fp32 gradients "
          f"{plan.model.num_params * 4 / 2**20:.1f} MiB), {args.micro_batches} micro-batches of {args.mbs} x "
          f"{args.seq_len}, {log['buckets']} buckets of ~{args.bucket_elems:,} elements, gloo on CPU ranks")
    print(f"{'mode':<34}{'exposed sync / step (median)':>30}{'step (median)':>16}")
    for mode, label in (("after", "buckets after the backward"), ("overlap", "buckets inside the last backward")):
        print(f"{label:<34}{med[mode][0] * 1e3:>27.2f} ms{med[mode][1] * 1e3:>13.1f} ms")
    print(f"exposed sync with overlap / without: {med['overlap'][0] / med['after'][0]:.2f} "
          f"(medians of {len(rec['overlap'])} steps each, alternated; {time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
