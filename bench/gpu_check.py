"""The GPU checks of the mixed-vendor runtime, as one script: run it on a machine with CUDA.

    python bench/gpu_check.py [--steps 3] [--dry-run] [--schedules 1f1b,gpipe,zb-h1,interleaved] [--out DIR]

Each check trains a small model through the real entry point (``torchrun -m hethub.train``) and
compares the trained parameters (read from the run's checkpoint) with one device:

1. cuda-only: a plan whose only kind is an NVIDIA GPU kind (nccl), one rank per GPU (up to 2); with 2
   GPUs it is a 2-stage 1F1B pipeline over NCCL, whose point-to-point runs in posting order on each
   lane (runtime/p2p.py; a wrong order deadlocks, which the timeout turns into FAIL).
2. cuda+cpu fp32: stage 0 on cuda:0 (nccl kind), stage 1 on the CPU (gloo kind), through the bridge.
3. cuda+cpu bf16: the same plan in bf16-mixed (the GPU kind autocasts to bf16, the CPU kind stays fp32).
4. cuda+cpu fp16: the GPU kind in fp16-mixed with dynamic loss scaling (as on Volta/Turing).
5. every schedule (1F1B, GPipe, ZB-H1, interleaved with 2 chunks) on a 2-stage bf16 pipeline whose
   messages are 8 MiB (1 x 2048 tokens x 2048 hidden in bf16: far above NCCL's internal buffering,
   so a posting order that only works when sends are buffered hangs, which the timeout turns into
   FAIL): over NCCL on 2 GPUs; with one GPU, its stage 1 on the host through the bridge. Each prints
   its step time and first loss; every schedule must start from the same loss (same model and data).
   Every message runs on its own lane (a communicator per direction of a rank pair and kind: the
   ordering rule of runtime/p2p.py), sends in flight while the next ops compute.
6. the cross-vendor path alone: a rank on cuda:0 (nccl kind) and a CPU-kind rank (gloo), bridged,
   ping-pong messages of 1, 4, 16 and 64 MiB (``comm/staging.py``: pinned buffers, copies on a side
   stream, chunks) and of the same sizes unchunked, side by side; every message must arrive
   byte-exact, and each size prints its one-way bandwidth (fastest round trip / 2). This is the
   staged path's first GPU measurement; ``hethub bench comm`` writes the same path's figures into a
   links profile.

fp32 checks must match one CPU device to 1e-4 (kernel rounding; TF32 is off by default for matmuls);
16-bit checks must stay within the stated 16-bit tolerance of the fp32 reference. The placement log
of every run must show the GPU kind on cuda. Without CUDA it prints "skipped: no CUDA" and exits 0;
``--dry-run`` runs checks 2, 5 and 6 with the GPU kind emulated on the CPU (gloo), check 5 with
the small model's 16 KiB messages and check 6 with 1 and 4 MiB, which is how the script itself is
exercised without a GPU (the runtime keeps CPU ranks in fp32, so checks 3-4 would repeat check 2
there). Then, on a GPU, bench/gpu_step_check.py
profiles the GPU's layers, runs 3-4 plans through the runtime and prints predicted vs measured
step time per plan and peak memory per rank, bench/gpu_memory_check.py compares memory per part,
and bench/activation_bytes.py and bench/dp_overlap.py, where present, print saved activation
bytes and exposed gradient-sync time (``--dry-run`` lists them). Each runs as its own process: a
crash or failure there is reported as a failed check, not lost.
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
from hethub.plan import Pipeline, Plan, Stage, interleave, split_evenly
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
# Check 5: one message is 1 x 2048 x 2048 bf16 = 8 MiB; a small vocabulary keeps a host stage cheap.
P2P_SPEC = ModelSpec(name="gpucheck-p2p", num_layers=4, hidden_size=2048, num_heads=16, num_kv_heads=8,
                     ffn_hidden_size=4096, vocab_size=256, max_seq_len=2048)
P2P_SEQ, P2P_MICRO_BATCHES = 2048, 4
SCHEDULE_CHECKS = (("1f1b", 1), ("gpipe", 1), ("zb-h1", 1), ("interleaved", 2))
COMPANIONS = ("activation_bytes.py", "dp_overlap.py")  # other checks' scripts, run where present
BRIDGE_SIZES_MIB = (1, 4, 16, 64)  # check 6; --dry-run: the first two


def _bridge_worker(rank: int, sizes: list[int], cuda: bool) -> dict[str, Any]:
    """Check 6 on one rank: rank 0 is the GPU kind (cuda:0, or the CPU when emulated), rank 1 the CPU
    kind; each size goes 0 -> 1 -> 0 through the bridge, chunked and unchunked."""
    import time

    from hethub.comm.bridge import BridgedCommunicator
    from hethub.comm.staging import MIN_CHUNK_BYTES, WHOLE

    device = torch.device("cuda", 0) if cuda and rank == 0 else torch.device("cpu")
    kinds = {"kind_of_rank": ["gpu", "host"], "backend_of_kind": {"gpu": "nccl" if cuda else "gloo", "host": "gloo"},
             "vendor_of_kind": {"gpu": "nvidia", "host": "cpu"}, "force_bridge": not cuda}
    comms = {"chunked": BridgedCommunicator(**kinds, p2p_chunk_bytes=MIN_CHUNK_BYTES),
             "1 chunk": BridgedCommunicator(**kinds, p2p_chunk_bytes=WHOLE)}
    out: dict[str, Any] = {"exact": True, "one_way_s": {}}
    for n in sizes:
        want = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(n))
        x, buf = want.to(device), torch.empty(n, dtype=torch.uint8, device=device)
        for mode, comm in comms.items():
            best = float("inf")
            for i in range(4):  # the first round trip warms up pools and connections
                if cuda:
                    torch.cuda.synchronize()
                start = time.perf_counter()
                if rank == 0:
                    comm.isend(x, dst=1, tag=0).wait()
                    comm.recv(buf, src=1, tag=0)
                else:
                    comm.recv(buf, src=0, tag=0)
                    comm.isend(buf, dst=0, tag=0).wait()
                if cuda:
                    torch.cuda.synchronize()
                if i:
                    best = min(best, (time.perf_counter() - start) / 2)
                out["exact"] &= bool(torch.equal(buf.cpu(), want))
            out["one_way_s"][(mode, n)] = best
    return out


def check_bridge(*, cpu_only: bool) -> bool:
    """Check 6: the staged cross-vendor path between a GPU rank and a CPU-kind rank."""
    from hethub.comm.local_ranks import run_local_ranks

    sizes = [m << 20 for m in (BRIDGE_SIZES_MIB[:2] if cpu_only else BRIDGE_SIZES_MIB)]
    res = run_local_ranks(2, _bridge_worker, sizes, not cpu_only, start_method="fork" if cpu_only else "spawn",
                          timeout_s=600)
    ok = all(r["exact"] for r in res)
    where = "GPU kind emulated on CPU" if cpu_only else "cuda:0 <-> CPU kind"
    for n in sizes:
        bw = {m: n / res[0]["one_way_s"][(m, n)] / 1e9 for m in ("chunked", "1 chunk")}
        print(f"bridge {n >> 20:>3} MiB ({where})".ljust(40) + f" {'ok  ' if ok else 'FAIL'} one-way "
              f"{bw['chunked']:.2f} GB/s chunked, {bw['1 chunk']:.2f} GB/s in one chunk "
              f"({bw['chunked'] / bw['1 chunk']:.2f}x), byte-exact: {ok}")
    return ok


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


def schedule_plans(*, gpus: int, cpu_only: bool) -> list[tuple[str, Plan]]:
    """Check 5's plans: every schedule on 2 stages, bf16 on the GPU kind (fp32 where emulated), the
    big model's 8 MiB messages on a GPU and the small model's where the GPU kind is emulated."""
    spec, seq = (SPEC, SEQ) if cpu_only else (P2P_SPEC, P2P_SEQ)
    two_gpus = gpus >= 2
    cl = _cluster(gpus=2 if two_gpus or cpu_only else 1, cpu_only=cpu_only, precision="bf16-mixed",
                  with_host=not (two_gpus or cpu_only))
    second = "gpu" if two_gpus or cpu_only else "host"  # device 1 either way
    half = spec.num_layers // 2
    stages = (Stage("gpu", (0,), (0, half), embedding=True),
              Stage(second, (1,), (half, spec.num_layers), head=True))
    out = []
    for schedule, chunks in SCHEDULE_CHECKS:
        pipe = Pipeline(1, P2P_MICRO_BATCHES, stages)
        if chunks > 1:
            pipe = interleave(pipe, [split_evenly(half, chunks), split_evenly(spec.num_layers - half, chunks)])
        where = "NCCL, 2 GPUs" if two_gpus else "emulated on the CPU" if cpu_only else "GPU + host, bridged"
        mib = seq * spec.hidden_size * (4 if cpu_only else 2) / 2**20
        out.append((f"{schedule}{f' x{chunks}' if chunks > 1 else ''} ({where}, {mib:g} MiB messages)",
                    Plan(model=spec, cluster=cl, global_batch=P2P_MICRO_BATCHES, seq_len=seq, pipelines=(pipe,),
                         precision="bf16-mixed", schedule=schedule).validate()))
    return out


def check_schedules(*, gpus: int, steps: int, work: Path, cpu_only: bool,
                    schedules: tuple[str, ...] | None = None) -> list[bool]:
    """Check 5: every schedule (or those named) runs to the end and starts from the same loss."""
    results, first = [], None
    for i, (name, plan) in enumerate(schedule_plans(gpus=gpus, cpu_only=cpu_only)):
        if schedules is not None and plan.schedule not in schedules:
            continue
        got = run_plan(plan, steps=steps, work=work / f"sched{i}")
        if "error" in got:
            print(f"{name:<56} FAIL: training exited with an error (a hang ends at the timeout):\n{got['error']}")
            results.append(False)
            continue
        loss = got["records"][0]["loss"]
        first = loss if first is None else first
        tol = TOL_FP32 if kind_precision(plan, "gpu") == "fp32" else TOL_16["bf16-mixed"]
        ok = abs(loss - first) <= tol
        times = sorted(r["step_time_s"] for r in got["records"][1:]) or [got["records"][0]["step_time_s"]]
        print(f"{name:<56} {'ok  ' if ok else 'FAIL'} first loss {loss:.5f} (first schedule's {first:.5f}, tol "
              f"{tol:g}), median step {times[len(times) // 2] * 1e3:.1f} ms over {len(times)} step(s)")
        results.append(ok)
    return results


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
    ap.add_argument("--dry-run", action="store_true",
                    help="emulate the GPU kind on the CPU with small messages (tests the script without a GPU)")
    ap.add_argument("--schedules", help="check 5 for these schedules only (comma-separated; default: all)")
    ap.add_argument("--out", help="keep runs here (default: a temporary directory)")
    args = ap.parse_args()
    only = tuple(args.schedules.split(",")) if args.schedules else None
    # Checked without initialising CUDA here: the ranks are separate processes.
    if not args.dry_run and not torch.cuda.is_available():
        print("skipped: no CUDA")
        return 0
    gpus = 0 if args.dry_run else torch.cuda.device_count()
    print(f"torch {torch.__version__}, {'CPU only (GPU kind emulated)' if args.dry_run else f'{gpus} CUDA device(s)'}")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.out or tmp)
        todo = plans(gpus=gpus, cpu_only=args.dry_run)
        if args.dry_run:  # on the CPU checks 3-4 run fp32 too: the same run as check 2
            todo = [(n, p) for n, p in todo if n == "cuda+cpu fp32"]
        results = [check(name, plan, steps=args.steps, work=root / f"run{i}", cpu_only=args.dry_run)
                   for i, (name, plan) in enumerate(todo)]
        results += check_schedules(gpus=gpus, steps=args.steps, work=root, cpu_only=args.dry_run, schedules=only)
        results.append(check_bridge(cpu_only=args.dry_run))
    here = Path(__file__).parent
    scripts = ["gpu_step_check.py", "gpu_memory_check.py", *(c for c in COMPANIONS if (here / c).exists())]
    for c in COMPANIONS:
        if not (here / c).exists():
            print(f"{c}: not present in this checkout")
    for name in scripts:
        if args.dry_run:  # each GPU script has its own CPU test; here only what would run
            print(f"would run {name} on the GPU")
            continue
        print(f"running {name}", flush=True)
        code = subprocess.run([sys.executable, str(here / name)], check=False).returncode
        if code != 0:
            print(f"{name} FAIL: exit code {code}")
        results.append(code == 0)
    print("PASS" if all(results) else f"FAIL: {results.count(False)} check(s)")
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
