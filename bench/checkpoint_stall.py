"""How long a checkpoint save stops training: synchronous writes against background writes, side by side.

    python bench/checkpoint_stall.py [--hidden 256] [--layers 4] [--steps 9] [--every 2] [--rounds 2]
                                     [--dir DIR]

Two gloo ranks (forked from this process, one thread each) train a two-stage plan of a Llama-shaped
model, saving every ``--every`` steps with ``CheckpointSaver`` (runtime/checkpoint_saver.py), once
with ``asynchronous=False`` and once with ``asynchronous=True``, alternated ``--rounds`` times in one
run. Printed per mode: the training thread's stall per save (the wall time it spends in the saver's
calls after each step: the snapshot, and the write too when synchronous, plus the commit), the
background write time, the wait at the end of the run for the last save (nothing is left to overlap
it), the median step time, and the wall time of the whole run; then the ratios. On this
CPU box the "device-to-host copy" is a host memcpy, and the writer thread competes with training
for the GIL and the two cores, which the wall-time ratio shows.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

from hethub.comm.communicator import Communicator
from hethub.comm.local_ranks import run_local_ranks
from hethub.plan import Pipeline, Plan, Stage
from hethub.runtime.checkpoint_saver import CheckpointSaver
from hethub.runtime.optim import OptimConfig
from hethub.runtime.trainer import Trainer, TrainerConfig
from hethub.spec.cluster import Cluster, Link, NodeGroup
from hethub.spec.kind import DeviceKind
from hethub.spec.model import ModelSpec


def two_stage_plan(hidden: int, layers: int) -> Plan:
    spec = ModelSpec(name="bench", num_layers=layers, hidden_size=hidden, num_heads=8, num_kv_heads=4,
                     ffn_hidden_size=hidden * 11 // 4, vocab_size=8192, max_seq_len=64)
    kind = DeviceKind(name="cpu", vendor="cpu", mem_bytes=2**34, peak_flops=1e11, intra_node_bw_bytes_per_s=1e10,
                      intra_node_latency_s=1e-6, backend="gloo")
    cluster = Cluster(name="local", kinds={"cpu": kind}, groups=(NodeGroup("cpu", 1, 2),),
                      inter_node=Link(1e9, 1e-5), cross_kind=Link(1e9, 1e-5))
    half = layers // 2
    stages = (Stage("cpu", (0,), (0, half), embedding=True), Stage("cpu", (1,), (half, layers), head=True))
    return Plan(model=spec, cluster=cluster, global_batch=4, seq_len=32,
                pipelines=(Pipeline(2, 2, stages),), precision="fp32").validate()


def run(rank: int, plan: Plan, root: str, asynchronous: bool, steps: int, every: int) -> dict:
    cfg = TrainerConfig(optim=replace(OptimConfig(lr=1e-4), total_steps=steps, warmup_steps=1))
    trainer = Trainer(plan, rank=rank, comm=Communicator(), cfg=cfg)
    saver = CheckpointSaver(trainer, root=Path(root), keep=2, run="bench", asynchronous=asynchronous)
    g = torch.Generator().manual_seed(0)
    data = [torch.randint(0, plan.model.vocab_size, (plan.global_batch, plan.seq_len + 1), generator=g)
            for _ in range(steps)]
    step_s, stall_s, saves = [], 0.0, 0
    t_run = time.perf_counter()
    for step in range(steps):
        t0 = time.perf_counter()
        trainer.train_step(data[step], step=step)
        t1 = time.perf_counter()
        saver.poll()
        if (step + 1) % every == 0 and step + 1 < steps:
            saver.save(step + 1)
            saves += 1
        stall_s += time.perf_counter() - t1
        step_s.append(t1 - t0)
    t1 = time.perf_counter()
    saver.close()
    end_wait = time.perf_counter() - t1
    wall = time.perf_counter() - t_run
    return {"stall_per_save_s": stall_s / saves, "end_wait_s": end_wait,
            "write_s": statistics.median(r.write_s for r in saver.records),
            "step_s": statistics.median(step_s[1:]), "wall_s": wall,
            "bytes": sum(r.bytes for r in saver.records) / len(saver.records)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=9)
    ap.add_argument("--every", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary folder)")
    args = ap.parse_args()
    plan = two_stage_plan(args.hidden, args.layers)
    print(f"model: {plan.model.num_params / 1e6:.1f} M parameters, 2 ranks (two stages), save every {args.every} "
          f"of {args.steps} steps, {args.rounds} rounds alternated")
    got: dict[str, list[dict]] = {"sync": [], "async": []}
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        for r in range(args.rounds):
            for mode in ("sync", "async"):
                root = Path(tmp) / f"{mode}-{r}"
                res = run_local_ranks(2, run, plan, str(root), mode == "async", args.steps, args.every)
                # A save stalls the job for as long as its slowest rank is stalled.
                got[mode].append({"stall_per_save_s": max(x["stall_per_save_s"] for x in res),
                                  "end_wait_s": max(x["end_wait_s"] for x in res),
                                  "write_s": max(x["write_s"] for x in res), "step_s": max(x["step_s"] for x in res),
                                  "wall_s": max(x["wall_s"] for x in res), "bytes": sum(x["bytes"] for x in res)})
    print(f"{'mode':<6} {'stall/save s':>12} {'write s':>8} {'end wait s':>10} {'step s':>7} {'run wall s':>10} "
          f"{'MiB/save':>9}")
    med = {m: {k: statistics.median(x[k] for x in v) for k in v[0]} for m, v in got.items()}
    for m in ("sync", "async"):
        print(f"{m:<6} {med[m]['stall_per_save_s']:>12.3f} {med[m]['write_s']:>8.3f} {med[m]['end_wait_s']:>10.3f} "
              f"{med[m]['step_s']:>7.3f} "
              f"{med[m]['wall_s']:>10.2f} {med[m]['bytes'] / 2**20:>9.1f}")
    print(f"stall per save, async / sync: {med['async']['stall_per_save_s'] / med['sync']['stall_per_save_s']:.3f}; "
          f"run wall time, async / sync: {med['async']['wall_s'] / med['sync']['wall_s']:.3f} "
          f"(medians of {args.rounds} rounds)")


if __name__ == "__main__":
    main()
