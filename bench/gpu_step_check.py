"""Predicted vs measured step time and per-rank peak memory of a few plans on CUDA GPUs (issue 14, item 5).

    python bench/gpu_step_check.py [--kind KIND] [--model opt-350m] [--seq-len 2048] [--steps 8] [--warmup 3]
                                   [--json OUT]
    python bench/gpu_step_check.py --dry-run    # the same code path on the CPU with the tiny model

On a machine with CUDA GPUs of one kind (default: the catalog kind matching the device's name):

1. profiles the layers on ``cuda:0`` (``hethub profile``'s code, fp32, micro-batch sizes 1, 2 and 4,
   TP 1, decoder stacks of 1/2/4/8 layers) in a child process;
2. runs 3-4 plans through the runtime's Trainer, one process per GPU (one GPU: the whole model in
   fp32 at micro-batch 1 x4 and 2 x2, and, where the kind lists bf16-mixed, bf16-mixed at 2 x2 and
   4 x2; with 2 or more GPUs also a 2-stage 1F1B pipeline and 2 data-parallel replicas, fp32),
   ``--steps`` steps each, timing each step on every rank between ``torch.cuda.synchronize`` calls
   (step = slowest rank; the median after ``--warmup`` steps) and reading
   ``torch.cuda.max_memory_allocated`` / ``max_memory_reserved`` per rank over the steps after the
   first (AdamW's state exists by then);
3. prints per plan the measured step time beside two predictions: from the profile just taken
   (fp32 plans; what ``hethub predict --profiles`` gives), and analytic from the catalog alone (the
   operator-level model and its calibration); then per rank the measured peak memory beside the
   memory model's ``allocated_bytes`` and ``reserved_bytes``.

Without CUDA it prints "skipped: no CUDA" and exits 0 (``check()`` returns []). ``--dry-run`` runs
every step of it on the CPU (catalog kind ``cpu``, gloo, the ``tiny`` model at seq 64, two ranks
for the multi-rank plans) so the script is known to work where no GPU is lent; memory then reads
n/a (no allocator statistics on the CPU) and the times say nothing about any GPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

GIB = 1024**3


def _cluster(kind_name: str, *, devices: int, dry_run: bool):
    from hethub.spec.cluster import Cluster, Link, NodeGroup
    from hethub.spec.kind import catalog

    kind = catalog()[kind_name]
    if dry_run:  # gloo ranks on the CPU, whatever the kind says
        kind = replace(kind, backend="gloo", device_type="cpu")
    return Cluster(name=f"{kind_name}-x{devices}", kinds={kind_name: kind}, groups=(NodeGroup(kind_name, 1, devices),),
                   inter_node=Link(25e9, 1e-5), cross_kind=Link(25e9, 1e-5))


def plans(kind_name: str, *, model_name: str, seq_len: int, devices: int, dry_run: bool = False) -> list:
    """The plans to run, named: 3-4 on one device, 2 more with two or more."""
    from hethub.plan import Pipeline, Plan, Stage
    from hethub.spec.model import get_model

    model = get_model(model_name)
    n = min(devices, 2)
    cluster = _cluster(kind_name, devices=n, dry_run=dry_run)
    precisions = cluster.kinds[kind_name].precisions
    layers = model.num_layers
    whole = (Stage(kind_name, (0,), (0, layers), embedding=True, head=True),)
    out = []
    # (name, precision, pipelines as (mbs, micro-batches, stages))
    specs: list[tuple[str, str, tuple]] = [("1 device fp32 mbs 1 x4", "fp32", ((1, 4, whole),)),
                                           ("1 device fp32 mbs 2 x2", "fp32", ((2, 2, whole),))]
    if "bf16-mixed" in precisions:
        specs += [("1 device bf16-mixed mbs 2 x2", "bf16-mixed", ((2, 2, whole),)),
                  ("1 device bf16-mixed mbs 4 x2", "bf16-mixed", ((4, 2, whole),))]
    if n >= 2:
        half = layers // 2
        two = (Stage(kind_name, (0,), (0, half), embedding=True), Stage(kind_name, (1,), (half, layers), head=True))
        specs += [("2 stages 1F1B fp32 mbs 1 x8", "fp32", ((1, 8, two),)),
                  ("2 replicas fp32 mbs 2 x2", "fp32",
                   ((2, 2, whole), (2, 2, (Stage(kind_name, (1,), (0, layers), embedding=True, head=True),))))]
    for name, precision, pipes in specs:
        pipelines = tuple(Pipeline(mbs, m, stages) for mbs, m, stages in pipes)
        plan = Plan(model=model, cluster=cluster, global_batch=sum(p.num_samples for p in pipelines), seq_len=seq_len,
                    pipelines=pipelines, precision=precision)
        out.append((name, plan.with_meta(check=name).validate()))
    return out


def _profile_child(rank: int, model_name: str, kind: str, seq_len: int, mbs: tuple[int, ...], device_type: str,
                   repeats: int):
    """The layer profile, taken in a child so that this process never holds a CUDA context."""
    from hethub.profiler.layers import Repetitions
    from hethub.profiler.runner import ProfileRequest, run_profile
    from hethub.spec.model import get_model

    device = f"cuda:{rank}" if device_type == "cuda" else "cpu"
    return run_profile(ProfileRequest(model=get_model(model_name), kind=kind, seq_len=seq_len, mbs=mbs, tp=(1,),
                                      device=device, reps=Repetitions(warmup=2, repeats=repeats),
                                      show_progress=False))


def _train_child(rank: int, plan_dict: dict, steps: int, device_type: str) -> dict[str, Any]:
    """One rank of the plan through the runtime's Trainer: its wall time per step, synchronised, and
    its peak memory from the second step on (CUDA only)."""
    import time

    import torch

    from hethub.comm.factory import make_communicator
    from hethub.plan import Plan
    from hethub.runtime.trainer import Trainer, TrainerConfig

    plan = Plan.from_dict(plan_dict)
    cuda = device_type == "cuda"
    if cuda:
        torch.cuda.set_device(rank)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    comm = make_communicator(plan=plan, rank=rank, device_types=dict.fromkeys(plan.cluster.kinds, device_type))
    trainer = Trainer(plan, rank=rank, comm=comm, cfg=TrainerConfig(device=f"cuda:{rank}" if cuda else "cpu"))
    g = torch.Generator().manual_seed(0)
    times = []
    for step in range(steps):
        batch = torch.randint(0, plan.model.vocab_size, (plan.global_batch, plan.seq_len + 1), generator=g)
        if step == 1 and cuda:  # from the second step on AdamW's state exists: the steady-state peak
            sync()
            torch.cuda.reset_peak_memory_stats()
        sync()
        t0 = time.perf_counter()
        trainer.train_step(batch, step=step)
        sync()
        times.append(time.perf_counter() - t0)
    mem = ({"allocated": torch.cuda.max_memory_allocated(), "reserved": torch.cuda.max_memory_reserved()}
           if cuda else None)
    return {"times_s": times, "memory": mem}


def _predicted_memory(prediction) -> dict[int, dict[str, float]]:
    """Per rank (the plan's devices in ascending order), the memory model's allocated and reserved bytes."""
    by_device = {}
    for st in prediction.stages:
        for d in st.devices:
            by_device[d] = {"allocated": st.memory.allocated_bytes, "reserved": st.memory.reserved_bytes}
    return {rank: by_device[d] for rank, d in enumerate(sorted(by_device))}


def check(*, kind: str | None = None, model: str = "opt-350m", seq_len: int = 2048, steps: int = 8, warmup: int = 3,
          dry_run: bool = False, profile_repeats: int = 5) -> list[dict]:
    """Rows of predicted vs measured step time and per-rank memory per plan; [] without CUDA (unless dry_run).

    A plan that fails (out of memory, a collective error) gives a row with its error instead of
    stopping the check."""
    import torch

    from hethub.comm.local_ranks import run_local_ranks
    from hethub.predict.predictor import predict
    from hethub.predict.profiles import ProfileSet

    if not dry_run and not torch.cuda.is_available():
        return []
    if steps - warmup < 1:
        raise ValueError(f"steps ({steps}) must exceed warmup ({warmup}): no step would be measured")
    if dry_run:
        kind, model, seq_len, devices, device_type, start = "cpu", "tiny", min(seq_len, 64), 2, "cpu", "fork"
    else:
        from gpu_memory_check import _kind_for

        kind = kind or _kind_for(torch.cuda.get_device_name(0))
        devices, device_type, start = torch.cuda.device_count(), "cuda", "spawn"
    todo = plans(kind, model_name=model, seq_len=seq_len, devices=devices, dry_run=dry_run)
    mbs = tuple(sorted({p.micro_batch_size for _, plan in todo for p in plan.pipelines}))
    profile = run_local_ranks(1, _profile_child, model, kind, seq_len, mbs, device_type, profile_repeats,
                              start_method=start, timeout_s=1800)[0]
    profiles = ProfileSet(by_kind={kind: profile})
    rows = []
    for name, plan in todo:
        row: dict[str, Any] = {"plan": name, "kind": kind, "ranks": plan.world_size}
        analytic = predict(plan)
        row["analytic_s"] = analytic.step_time_s
        row["analytic_source"] = "; ".join(sorted({s.compute_source for s in analytic.stages}))
        # The profile is fp32 (hethub profile measures no autocast): it predicts fp32 plans only.
        row["profiled_s"] = predict(plan, profiles=profiles).step_time_s if plan.precision == "fp32" else None
        row["memory_pred"] = _predicted_memory(analytic)
        try:
            got = run_local_ranks(plan.world_size, _train_child, plan.to_dict(), steps, device_type,
                                  start_method=start, timeout_s=1800)
        except RuntimeError as err:  # an OOM or a failed collective is a finding, not a crash of the check
            row["error"] = str(err).strip().splitlines()[-1]
            rows.append(row)
            continue
        per_step = [max(r["times_s"][s] for r in got) for s in range(steps)]
        row["measured_s"] = statistics.median(per_step[warmup:])
        row["memory_meas"] = {rank: r["memory"] for rank, r in enumerate(got)}
        rows.append(row)
    return rows


def _fmt_time(pred: float | None, meas: float) -> str:
    return "n/a" if pred is None else f"{pred * 1e3:9.1f} ms ({pred / meas - 1:+6.1%})"


def print_rows(rows: list[dict], *, dry_run: bool) -> None:
    print(f"{'plan':<30} {'measured':>11} {'predicted from profile':>24} {'predicted analytic':>24}")
    for r in rows:
        if "error" in r:
            print(f"{r['plan']:<30} FAILED: {r['error']}")
            continue
        m = r["measured_s"]
        print(f"{r['plan']:<30} {m * 1e3:8.1f} ms {_fmt_time(r['profiled_s'], m):>24} "
              f"{_fmt_time(r['analytic_s'], m):>24}")
    print(f"analytic compute source: {rows[0]['analytic_source'] if rows else 'n/a'}")
    print(f"\n{'plan':<30} {'rank':>4} {'allocated meas / pred GiB':>28} {'reserved meas / pred GiB':>28}")
    for r in rows:
        for rank, pred in r["memory_pred"].items():
            meas = (r.get("memory_meas") or {}).get(rank)
            cells = []
            for k in ("allocated", "reserved"):
                got = f"{meas[k] / GIB:.2f}" if meas else "n/a"
                ratio = f" ({pred[k] / meas[k]:.2f}x)" if meas else ""
                cells.append(f"{got} / {pred[k] / GIB:.2f}{ratio}")
            print(f"{r['plan']:<30} {rank:>4} {cells[0]:>28} {cells[1]:>28}")
    if dry_run:
        print("\ndry run: every step ran on the CPU with the tiny model; these times say nothing about a GPU")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kind", help="catalog kind of the GPUs (default: matched from the device's name)")
    ap.add_argument("--model", default="opt-350m")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--profile-repeats", type=int, default=5)
    ap.add_argument("--dry-run", action="store_true", help="the same code on the CPU with the tiny model")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()
    rows = check(kind=args.kind, model=args.model, seq_len=args.seq_len, steps=args.steps, warmup=args.warmup,
                 dry_run=args.dry_run, profile_repeats=args.profile_repeats)
    if not rows:
        print("skipped: no CUDA")
        return 0
    print_rows(rows, dry_run=args.dry_run)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1, default=str) + "\n", encoding="utf-8")
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    sys.exit(main())
