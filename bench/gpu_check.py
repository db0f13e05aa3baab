"""The GPU checks of the mixed-vendor runtime, as one script: run it on a machine with CUDA.

    python bench/gpu_check.py [--steps 3] [--cpu-only] [--out DIR]

Each check trains a small model through the real entry point (``torchrun -m hethub.train``) and
compares the trained parameters (read from the run's checkpoint) with one device:

1. cuda-only: a plan whose only kind is an NVIDIA GPU kind (nccl), one rank per GPU (up to 2); with 2
   GPUs it is a 2-stage 1F1B pipeline over NCCL, whose point-to-point runs in posting order (the
   ordering rule of runtime/pipeline.py; a wrong order deadlocks, which the timeout turns into FAIL).
2. cuda+cpu fp32: stage 0 on cuda:0 (nccl kind), stage 1 on the CPU (gloo kind), through the bridge.
3. cuda+cpu bf16: the same plan in bf16-mixed (the GPU kind autocasts to bf16, the CPU kind stays fp32).
4. cuda+cpu fp16: the GPU kind in fp16-mixed with dynamic loss scaling (as on Volta/Turing).

fp32 checks must match one CPU device to 1e-4 (kernel rounding; TF32 is off by default for matmuls);
16-bit checks must stay within the stated 16-bit tolerance of the fp32 reference. The placement log
of every run must show the GPU kind on cuda. Without CUDA it prints "skipped: no CUDA" and exits 0;
``--cpu-only`` runs checks 2-4 with the GPU kind emulated on the CPU (gloo), which is how the script
itself is exercised without a GPU (the runtime keeps CPU ranks in fp32, so there all three run fp32).
Then bench/gpu_step_check.py profiles the GPU's layers, runs 3-4 plans through the runtime and
prints predicted vs measured step time per plan and peak memory per rank (``--cpu-only``: its
``--dry-run`` on the CPU), and bench/gpu_memory_check.py (GPU only) compares memory per part. Each
runs as its own process: a crash or failure there is reported as a failed check, not lost.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

import hethub
from hethub.plan import Pipeline, Plan, Stage
from hethub.runtime.checkpoint_io import latest_dir, read_manifest
from hethub.runtime.data import BatchSource, byte_tokenize, load_tokens
from hethub.runtime.optim import OptimConfig
from hethub.runtime.precision import kind_precision
from hethub.runtime.reference import train_single_device
from hethub.spec.cluster import Cluster, Link, NodeGroup
from hethub.spec.kind import catalog
from hethub.spec.model import ModelSpec

SPEC = ModelSpec(name="gpucheck6", num_layers=6, hidden_size=64, num_heads=4, num_kv_heads=2, ffn_hidden_size=128,
                 vocab_size=256, max_seq_len=64)
SEQ, BATCH = 64, 8
TOL_FP32 = 1e-4
TOL_16 = {"bf16-mixed": 2e-2, "fp16-mixed": 1e-2}  # loss and parameters vs the fp32 reference
TRAIN_ARGS = ["--lr", "1e-3", "--warmup-steps", "1", "--grad-clip", "1.0", "--timeout-s", "120"]


def _cluster(*, gpus: int, cpu_only: bool, precision: str, with_host: bool) -> Cluster:
    gpu = replace(catalog()["h100-sxm"], name="gpu")
    if hasattr(gpu, "precisions"):  # kinds that list their precisions (issue 15's plan v2): allow this one
        gpu = replace(gpu, precisions=(precision, "fp32"))
    if cpu_only:  # the GPU kind emulated on the host: same code path, gloo instead of nccl
        gpu = replace(gpu, backend="gloo", device_type="cpu")
    kinds = {"gpu": gpu}
    groups = [NodeGroup("gpu", 1, gpus)]
    if with_host:
        kinds["host"] = replace(catalog()["cpu"], name="host")
        groups.append(NodeGroup("host", 1, 1))
    return Cluster(name="gpu-check", kinds=kinds, groups=tuple(groups), inter_node=Link(25e9, 1e-5),
                   cross_kind=Link(10e9, 5e-5))


def plans(*, gpus: int, cpu_only: bool) -> list[tuple[str, Plan]]:
    out = []
    if not cpu_only:
        n = min(gpus, 2)
        cl = _cluster(gpus=n, cpu_only=False, precision="fp32", with_host=False)
        split = [(0, 3), (3, 6)] if n == 2 else [(0, 6)]
        stages = tuple(Stage("gpu", (i,), layers, embedding=i == 0, head=i == n - 1) for i, layers in enumerate(split))
        out.append(("cuda-only fp32" + (", 2-stage NCCL pipeline" if n == 2 else ", 1 GPU"),
                    Plan(model=SPEC, cluster=cl, global_batch=BATCH, seq_len=SEQ,
                         pipelines=(Pipeline(1, BATCH, stages),), precision="fp32")))
    for precision in ("fp32", "bf16-mixed", "fp16-mixed"):
        cl = _cluster(gpus=1, cpu_only=cpu_only, precision=precision, with_host=True)
        stages = (Stage("gpu", (0,), (0, 3), embedding=True), Stage("host", (1,), (3, 6), head=True))
        out.append((f"cuda+cpu {precision}", Plan(model=SPEC, cluster=cl, global_batch=BATCH, seq_len=SEQ,
                                                  pipelines=(Pipeline(1, BATCH, stages),), precision=precision)))
    return [(name, p.validate()) for name, p in out]


def corpus_batches(plan: Plan, steps: int) -> list[torch.Tensor]:
    """The batches hethub.train reads (default corpus, byte tokens)."""
    src = BatchSource(load_tokens(num_tokens=steps * plan.global_batch * (plan.seq_len + 1), tokenize=byte_tokenize),
                      global_batch=plan.global_batch, seq_len=plan.seq_len)
    return [src.global_batch_at(s) for s in range(steps)]


def run_plan(plan: Plan, *, steps: int, work: Path) -> dict[str, Any]:
    work.mkdir(parents=True, exist_ok=True)
    plan.save(work / "plan.json")
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(Path(hethub.__file__).resolve().parents[1]),
                                           *filter(None, [os.environ.get("PYTHONPATH")])]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={plan.world_size}",
           "-m", "hethub.train", "--plan", str(work / "plan.json"), "--steps", str(steps),
           "--metrics", str(work / "m.jsonl"), "--checkpoint-dir", str(work / "ck"), *TRAIN_ARGS]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, check=False)
    if proc.returncode != 0:
        errors = [x for x in (proc.stdout + proc.stderr).splitlines() if "error:" in x]
        return {"error": "\n".join(errors) or (proc.stdout + proc.stderr)[-2000:]}
    step_dir = latest_dir(work / "ck")
    params: dict[str, torch.Tensor] = {}
    for name in read_manifest(step_dir)["files"]:
        params |= {k.removeprefix("param:"): v.float().cpu() for k, v in torch.load(step_dir / name).items()
                   if k.startswith("param:")}
    recs = [json.loads(x) for x in (work / "m.jsonl").read_text().splitlines()]
    return {"params": params, "records": recs, "log": proc.stdout}


def check(name: str, plan: Plan, *, steps: int, work: Path, cpu_only: bool) -> bool:
    optim = OptimConfig(lr=1e-3, warmup_steps=1, total_steps=steps, weight_decay=0.1, grad_clip=1.0)
    ref = train_single_device(SPEC, corpus_batches(plan, steps), optim=optim)
    got = run_plan(plan, steps=steps, work=work)
    if "error" in got:
        print(f"{name:<40} FAIL: training exited with an error:\n{got['error']}")
        return False
    precision = kind_precision(plan, "gpu")  # what the rank really runs (fp32 when emulated on the CPU)
    tol = TOL_FP32 if precision == "fp32" else TOL_16[precision]
    loss_diff = abs(got["records"][0]["loss"] - ref["loss"])
    param_diff = max((got["params"][n] - ref["params"][n]).abs().max().item() for n in ref["params"])
    placed = "on cpu" if cpu_only else "on cuda"
    on_device = "kind gpu: ranks 0" in got["log"] and placed in got["log"].split("kind gpu:")[1].splitlines()[0]
    skipped = sum(bool(r.get("skipped")) for r in got["records"])
    ok = loss_diff <= tol and param_diff <= tol and on_device
    print(f"{name:<40} {'ok  ' if ok else 'FAIL'} precision {precision:<10} loss diff {loss_diff:.2e}, max param "
          f"diff {param_diff:.2e} (tol {tol:g}), gpu kind {placed}: {on_device}"
          + (f", loss scale {got['records'][-1].get('loss_scale')}, skipped {skipped}" if precision == "fp16-mixed"
             else ""))
    return ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--cpu-only", action="store_true", help="emulate the GPU kind on the CPU (tests the script)")
    ap.add_argument("--out", help="keep runs here (default: a temporary directory)")
    args = ap.parse_args()
    # Checked without initialising CUDA here: the ranks are separate processes.
    if not args.cpu_only and not torch.cuda.is_available():
        print("skipped: no CUDA")
        return 0
    gpus = 0 if args.cpu_only else torch.cuda.device_count()
    print(f"torch {torch.__version__}, {'CPU only (GPU kind emulated)' if args.cpu_only else f'{gpus} CUDA device(s)'}")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.out or tmp)
        results = [check(name, plan, steps=args.steps, work=root / f"run{i}", cpu_only=args.cpu_only)
                   for i, (name, plan) in enumerate(plans(gpus=gpus, cpu_only=args.cpu_only))]
    step = [str(Path(__file__).with_name("gpu_step_check.py"))] + (["--dry-run"] if args.cpu_only else [])
    memory = [] if args.cpu_only else [str(Path(__file__).with_name("gpu_memory_check.py"))]
    for cmd in (step, memory):
        if cmd:
            print(f"running {Path(cmd[0]).name} {' '.join(cmd[1:])}".rstrip(), flush=True)
            code = subprocess.run([sys.executable, *cmd], check=False).returncode
            if code != 0:
                print(f"{Path(cmd[0]).name} FAIL: exit code {code}")
            results.append(code == 0)
    print("PASS" if all(results) else f"FAIL: {results.count(False)} check(s)")
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
