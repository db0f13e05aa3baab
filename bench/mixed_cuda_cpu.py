"""A real mixed pipeline: stage 0 on a CUDA GPU (nccl inside its kind), stage 1 on the CPU (gloo),
trained through the bridge, checked against a single-device run.

    python bench/mixed_cuda_cpu.py [--steps 3] [--cpu-only]

Rank 0 is kind "gpu" (catalog-style NVIDIA kind, backend nccl) on cuda:0; rank 1 is kind "host"
(backend gloo) on the CPU. The factory's "auto" mode sees two backends and bridges them: rank 0's
activations are staged in pinned host memory and sent over gloo; rank 1's gradients come back the
same way and are copied onto the GPU. The loss of step 0, every gradient of step 0 and every
parameter after ``--steps`` AdamW steps are compared with the same model trained on one CPU device.
TF32 is switched off so the GPU computes in true fp32; the remaining difference is kernel rounding.

Without a GPU it prints "skipped: no CUDA" and exits 0. ``--cpu-only`` runs both ranks on the CPU
with the bridge forced (the same code path except the device copies), which is how this script is
tested on machines without a GPU. With one GPU, the nccl group of kind "gpu" has one rank (NCCL
does not allow two ranks on one GPU), so its in-kind collectives are no-ops and every message of
this run crosses the bridge.
"""

from __future__ import annotations

import argparse
import sys
from datetime import timedelta
from typing import Any

import torch

from hethub.comm.factory import make_communicator
from hethub.comm.local_ranks import run_local_ranks
from hethub.plan import Pipeline, Plan, Stage
from hethub.runtime.optim import OptimConfig
from hethub.runtime.reference import train_single_device
from hethub.runtime.trainer import Trainer, TrainerConfig
from hethub.spec.cluster import Cluster, Link, NodeGroup
from hethub.spec.kind import DeviceKind
from hethub.spec.model import ModelSpec

TIMEOUT = timedelta(seconds=60)
SPEC = ModelSpec(name="mixed6", num_layers=6, hidden_size=64, num_heads=4, num_kv_heads=2, ffn_hidden_size=128,
                 vocab_size=256, max_seq_len=32)
SEQ = 32
# eps bounds how much Adam amplifies tiny gradient differences (|dp| <= lr * |dg| / eps).
OPTIM = OptimConfig(lr=1e-3, warmup_steps=1, total_steps=3, grad_clip=1.0, eps=1e-6)
TOL = {"cuda": {"loss": 1e-4, "grad": 1e-4, "param": 1e-4}, "cpu": {"loss": 1e-5, "grad": 1e-5, "param": 1e-5}}


def mixed_plan() -> Plan:
    gpu = DeviceKind(name="gpu", vendor="nvidia", mem_bytes=80 * 10**9, peak_flops=989e12,
                     intra_node_bw_bytes_per_s=450e9, intra_node_latency_s=5e-6, backend="nccl")
    host = DeviceKind(name="host", vendor="generic", mem_bytes=64 * 10**9, peak_flops=1e12,
                      intra_node_bw_bytes_per_s=20e9, intra_node_latency_s=1e-6, backend="gloo")
    cluster = Cluster(name="mixed-cuda-cpu", kinds={"gpu": gpu, "host": host},
                      groups=(NodeGroup("gpu", 1, 1), NodeGroup("host", 1, 1)),
                      inter_node=Link(25e9, 10e-6), cross_kind=Link(25e9, 10e-6))
    stages = (Stage("gpu", (0,), (0, 3), embedding=True), Stage("host", (1,), (3, 6), head=True))
    return Plan(model=SPEC, cluster=cluster, global_batch=8, seq_len=SEQ, pipelines=(Pipeline(2, 4, stages),),
                schedule="1f1b", precision="fp32").validate()


def reference(plan: Plan, data: list[torch.Tensor]) -> dict[str, Any]:
    """The whole model on one CPU device: loss and gradients of step 0, parameters after all steps."""
    return train_single_device(plan.model, data, optim=OPTIM)


def worker(rank: int, plan: Plan, data: list[torch.Tensor], ref: dict[str, Any], cpu_only: bool) -> dict[str, Any]:
    device = "cuda:0" if rank == 0 and not cpu_only else "cpu"
    if device.startswith("cuda"):
        torch.cuda.set_device(0)
        torch.backends.cuda.matmul.allow_tf32 = False  # true fp32, comparable with the CPU reference
        torch.backends.cudnn.allow_tf32 = False
    device_types = {"gpu": "cpu" if cpu_only else "cuda", "host": "cpu"}
    comm = make_communicator(plan=plan, rank=rank, timeout=TIMEOUT, bridge="force" if cpu_only else "auto",
                             device_types=device_types)
    trainer = Trainer(plan, rank=rank, comm=comm, cfg=TrainerConfig(optim=OPTIM, device=device))
    named = dict(trainer.model.named_parameters())
    loss, _ = trainer.forward_backward(data[0])
    trainer.sync_grads()
    grad_diff = max((p.grad.cpu() - ref["grads"][n]).abs().max().item() for n, p in named.items())
    trainer.clip_and_update()
    for step in range(1, len(data)):
        trainer.train_step(data[step], step=step)
    param_diff = max((p.detach().cpu() - ref["params"][n]).abs().max().item() for n, p in named.items())
    return {"device": device, "loss": loss, "grad_diff": grad_diff, "param_diff": param_diff,
            "comm": getattr(comm, "describe", dict)()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--cpu-only", action="store_true", help="both ranks on the CPU, bridge forced (for testing)")
    args = ap.parse_args()
    # Checked without initialising CUDA in this process: ranks are spawned and initialise it themselves.
    if not args.cpu_only and not torch.cuda.is_available():
        print("skipped: no CUDA")
        return 0
    plan = mixed_plan()
    g = torch.Generator().manual_seed(1234)
    data = [torch.randint(0, SPEC.vocab_size, (plan.global_batch, SEQ + 1), generator=g) for _ in range(args.steps)]
    ref = reference(plan, data)
    results = run_local_ranks(2, worker, plan, data, ref, args.cpu_only, timeout_s=300.0,
                              start_method="fork" if args.cpu_only else "spawn")
    tol = TOL["cpu" if args.cpu_only else "cuda"]
    print(f"islands: {results[0]['comm'].get('islands')}")
    print(f"reference loss (one CPU device): {ref['loss']:.6f}")
    ok = True
    for rank, r in enumerate(results):
        good = (abs(r["loss"] - ref["loss"]) <= tol["loss"] and r["grad_diff"] <= tol["grad"]
                and r["param_diff"] <= tol["param"])
        ok &= good
        print(f"rank {rank} on {r['device']:<6}: loss {r['loss']:.6f} (diff {abs(r['loss'] - ref['loss']):.2e}), "
              f"max |grad diff| {r['grad_diff']:.2e}, max |param diff| after {args.steps} steps "
              f"{r['param_diff']:.2e}  {'ok' if good else 'MISMATCH'}")
    print("PASS: the mixed pipeline trains like one device" if ok else f"FAIL: beyond tolerance {tol}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
