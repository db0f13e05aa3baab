"""Predicted vs measured peak memory per rank on a CUDA GPU (skips cleanly without one).

    python bench/gpu_memory_check.py [--kind h200] [--model opt-350m] [--seq-len 2048] [--steps 3] [--json OUT]

For a few single-GPU plans (one rank holding the whole model: fp32 and bf16-mixed, flash and math
attention, micro-batch 1 and 2) on the GPU kind given (default: the catalog kind matching the
device's name), it trains ``--steps`` steps with the runtime's Trainer on ``cuda:0`` and records
``torch.cuda.max_memory_allocated`` and ``max_memory_reserved`` over the steps after the first (the
optimizer's state exists then), and the device memory the process uses (``mem_get_info``: total -
free, which includes the CUDA context). It prints them beside the memory model's
``allocated_bytes``, ``reserved_bytes`` and peak less collective buffers (a one-rank run opens no
NCCL communicator), with the ratio of each. ``check()`` is the function bench/gpu_check.py may call.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

GIB = 1024**3
NAME_TO_KIND = (("GH200", "gh200"), ("H200", "h200"), ("H100", "h100-sxm"), ("A100", "a100-80gb"),
                ("V100", "v100-16gb"), ("3090", "rtx-3090"), ("TITAN RTX", "titan-rtx"), ("2080", "rtx-2080"))


def _kind_for(device_name: str) -> str:
    for needle, kind in NAME_TO_KIND:
        if needle.lower() in device_name.lower():
            return kind
    raise SystemExit(f"no catalog kind matches GPU {device_name!r}; pass --kind")


def _plans(kind: str, *, model_name: str, seq_len: int) -> list:
    from hethub.plan import Pipeline, Plan, Stage
    from hethub.spec.cluster import Cluster, Link, NodeGroup
    from hethub.spec.kind import catalog
    from hethub.spec.model import get_model

    model = get_model(model_name)
    cluster = Cluster(name="one-gpu", kinds={kind: catalog()[kind]}, groups=(NodeGroup(kind, 1, 1),),
                      inter_node=Link(12.5e9, 1e-5), cross_kind=Link(12.5e9, 1e-5))
    out = []
    for precision, attention, mbs in (("fp32", "flash", 1), ("fp32", "math", 1), ("bf16-mixed", "flash", 2),
                                      ("fp32", "flash", 2)):
        stage = Stage(kind, (0,), (0, model.num_layers), embedding=True, head=True)
        plan = Plan(model=model, cluster=cluster, global_batch=2 * mbs, seq_len=seq_len, precision=precision,
                    pipelines=(Pipeline(mbs, 2, (stage,)),), kind_settings={kind: {"attention": attention}})
        out.append(plan.with_meta(check=f"{precision} {attention} mbs {mbs}").validate())
    return out


def _measure(rank: int, plan_dict: dict, steps: int) -> dict:
    import torch

    from hethub.comm.factory import make_communicator
    from hethub.plan import Plan
    from hethub.runtime.trainer import Trainer, TrainerConfig

    plan = Plan.from_dict(plan_dict)
    kind = plan.pipelines[0].stages[0].kind
    torch.cuda.set_device(rank)
    comm = make_communicator(plan=plan, rank=rank, device_types={kind: "cuda"})
    cfg = TrainerConfig(device=f"cuda:{rank}")  # the Trainer trains each kind in the plan's precision for it
    trainer = Trainer(plan, rank=rank, comm=comm, cfg=cfg)
    g = torch.Generator().manual_seed(0)
    for step in range(steps):
        if step == 1:  # from the second step on, AdamW's state exists: the steady-state peak
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        batch = torch.randint(0, plan.model.vocab_size, (plan.global_batch, plan.seq_len + 1), generator=g)
        trainer.train_step(batch, step=step)
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return {"allocated": torch.cuda.max_memory_allocated(), "reserved": torch.cuda.max_memory_reserved(),
            "device_used": total - free}


def check(*, kind: str | None = None, model: str = "opt-350m", seq_len: int = 2048, steps: int = 3) -> list[dict]:
    """Rows of predicted vs measured memory per plan; [] without a CUDA GPU."""
    try:
        import torch
    except ImportError:
        return []
    if not torch.cuda.is_available():
        return []
    from hethub.comm.local_ranks import run_local_ranks
    from hethub.predict.predictor import predict

    kind = kind or _kind_for(torch.cuda.get_device_name(0))
    rows = []
    for plan in _plans(kind, model_name=model, seq_len=seq_len):
        mem = predict(plan).stages[0].memory
        try:
            got = run_local_ranks(1, _measure, plan.to_dict(), steps, start_method="spawn", timeout_s=900)[0]
        except RuntimeError as err:  # an OOM is a finding, not a crash of the check
            rows.append({"plan": plan.meta["check"], "error": str(err).splitlines()[-1]})
            continue
        pred = {"allocated": mem.allocated_bytes, "reserved": mem.reserved_bytes,
                "device_used": mem.total_bytes - mem.comm_buffers_bytes}
        rows.append({"plan": plan.meta["check"], "kind": kind, "pred": pred, "meas": got,
                     "ratio": {k: pred[k] / got[k] for k in pred}, "parts": dict(mem.parts)})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kind")
    ap.add_argument("--model", default="opt-350m")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--json")
    args = ap.parse_args()
    rows = check(kind=args.kind, model=args.model, seq_len=args.seq_len, steps=args.steps)
    if not rows:
        print("gpu_memory_check: no CUDA GPU here; skipped")
        return
    print(f"{'plan':<24} {'allocated pred/meas GiB':>26} {'reserved pred/meas GiB':>26} {'device pred/meas GiB':>26}")
    for r in rows:
        if "error" in r:
            print(f"{r['plan']:<24} {r['error']}")
            continue
        cells = [f"{r['pred'][k] / GIB:6.2f}/{r['meas'][k] / GIB:<6.2f} ({r['ratio'][k]:.2f}x)"
                 for k in ("allocated", "reserved", "device_used")]
        print(f"{r['plan']:<24} " + " ".join(f"{c:>26}" for c in cells))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    main()
