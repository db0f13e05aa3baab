"""Overhead of the hethub runtime over a plain PyTorch loop, measured side by side in one process.

    python bench/runtime_overhead.py [--model tiny] [--seq-len 64] [--mbs 4] [--micro-batches 2] [--steps 10]
                                     [--skip-demo]

Both train the same model on the same micro-batches (gradient accumulation), with AdamW and
global-norm clipping, one thread; each reports the median step time after warm-up steps. The
runtime side is a 1-rank plan run through the full Trainer (schedule, gradient sync, metrics
gather) over a gloo group of one.

Then the demo's two plans (uniform and the planner's, on the embedded local-cpu cluster, with this
machine's measured layer profile) are run through torchrun, and their measured step times are
printed beside the predicted ones.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from hethub.comm.communicator import Communicator
from hethub.plan import Pipeline, Plan, Stage
from hethub.runtime.launch import launch_forked, launch_local
from hethub.runtime.model import StageModel
from hethub.runtime.optim import OptimConfig, build_optimizer
from hethub.runtime.trainer import Trainer, TrainerConfig
from hethub.spec.cluster import Cluster, Link, NodeGroup
from hethub.spec.kind import DeviceKind
from hethub.spec.model import get_model


def one_rank_plan(model: str, *, seq_len: int, mbs: int, micro_batches: int) -> Plan:
    spec = get_model(model)
    kind = DeviceKind(name="cpu", vendor="cpu", mem_bytes=2**34, peak_flops=1e11, intra_node_bw_bytes_per_s=1e10,
                      intra_node_latency_s=1e-6, backend="gloo")
    cluster = Cluster(name="local", kinds={"cpu": kind}, groups=(NodeGroup("cpu", 1, 1),),
                      inter_node=Link(1e9, 1e-5), cross_kind=Link(1e9, 1e-5))
    stage = Stage(kind="cpu", devices=(0,), layers=(0, spec.num_layers), embedding=True, head=True)
    pipe = Pipeline(micro_batch_size=mbs, num_micro_batches=micro_batches, stages=(stage,))
    return Plan(model=spec, cluster=cluster, global_batch=mbs * micro_batches, seq_len=seq_len,
                pipelines=(pipe,), precision="fp32").validate()


def _batch(plan: Plan, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    return torch.randint(0, plan.model.vocab_size, (plan.global_batch, plan.seq_len + 1), generator=g)


def plain_step_times_s(plan: Plan, *, steps: int, optim: OptimConfig) -> list[float]:
    model = StageModel(plan.model, layers=(0, plan.model.num_layers), embedding=True, head=True)
    opt, sched = build_optimizer(model, optim)
    mbs = plan.pipelines[0].micro_batch_size
    times = []
    for step in range(steps):
        batch = _batch(plan, step)
        t0 = time.perf_counter()
        for i in range(0, plan.global_batch, mbs):
            (model(batch[i:i + mbs, :-1], batch[i:i + mbs, 1:]) / plan.global_batch).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), optim.grad_clip)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    return times


def runtime_step_times_s(plan: Plan, *, steps: int, optim: OptimConfig) -> list[float]:
    with tempfile.TemporaryDirectory() as d:
        dist.init_process_group("gloo", init_method=f"file://{d}/store", rank=0, world_size=1,
                                timeout=timedelta(seconds=60))
        try:
            trainer = Trainer(plan, rank=0, comm=Communicator(), cfg=TrainerConfig(optim=optim))
            times = []
            for step in range(steps):
                batch = _batch(plan, step)
                t0 = time.perf_counter()
                trainer.train_step(batch, step=step)
                times.append(time.perf_counter() - t0)
            return times
        finally:
            dist.destroy_process_group()


def step_records(plan_path: str | Path, *, nproc: int, steps: int, launcher: str = "torchrun",
                 extra_args: tuple[str, ...] = ()) -> list[dict]:
    """The metrics records of a local run of the plan: under torchrun, or ``fork``ed hethub.train ranks."""
    with tempfile.TemporaryDirectory() as d:
        metrics = Path(d) / "metrics.jsonl"
        if launcher == "fork":
            codes = launch_forked(plan_path, nproc=nproc, steps=steps, metrics=metrics, extra_args=extra_args)
            if any(codes):
                raise RuntimeError(f"forked ranks failed, exit codes {codes}")
        else:
            proc = launch_local(plan_path, nproc=nproc, steps=steps, metrics=metrics, capture=True,
                                extra_args=extra_args)
            if proc.returncode != 0:
                raise RuntimeError(f"torchrun failed ({proc.returncode}):\n{proc.stderr[-8000:]}")
        return [json.loads(line) for line in metrics.read_text().splitlines()]


def measured_step_time_s(plan_path: str | Path, *, nproc: int, steps: int, warmup: int = 2,
                         launcher: str = "torchrun") -> float:
    """Median measured step time (s) of a plan run locally, after ``warmup`` steps."""
    recs = step_records(plan_path, nproc=nproc, steps=steps, launcher=launcher)
    return statistics.median(r["step_time_s"] for r in recs[warmup:])


def demo_plans_rows(*, steps: int, warmup: int, workdir: Path) -> list[tuple[str, float, float]]:
    """(strategy, measured, predicted step time) of the demo's two plans, profiled on this machine."""
    from hethub.demo import DemoConfig, default_cluster_path
    from hethub.profiler.runner import profile_for_kinds
    from hethub.search.config import PlannerConfig
    from hethub.search.planner import make_plan
    from hethub.spec.cluster import load_cluster

    cfg = DemoConfig()
    cluster = load_cluster(default_cluster_path())
    model = get_model(cfg.model)
    profiles = profile_for_kinds(model=model, kinds=cluster.kind_names, seq_len=cfg.seq_len, mbs=(1, 2, 4))
    rows = []
    for strategy in ("uniform", "hethub"):
        res = make_plan(cluster=cluster, model=model, profiles=profiles,
                        config=PlannerConfig(global_batch=cfg.global_batch, seq_len=cfg.seq_len, strategy=strategy,
                                             precision="fp32"))
        path = workdir / f"plan-{strategy}.json"
        res.plan.save(path)
        measured = measured_step_time_s(path, nproc=res.plan.world_size, steps=steps, warmup=warmup)
        rows.append((strategy, measured, res.prediction.step_time_s))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--mbs", type=int, default=4)
    ap.add_argument("--micro-batches", type=int, default=2)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--skip-demo", action="store_true", help="only the 1-rank overhead comparison")
    args = ap.parse_args()
    torch.set_num_threads(1)
    plan = one_rank_plan(args.model, seq_len=args.seq_len, mbs=args.mbs, micro_batches=args.micro_batches)
    optim = OptimConfig(total_steps=args.steps)
    plain = statistics.median(plain_step_times_s(plan, steps=args.steps, optim=optim)[args.warmup:])
    rt = statistics.median(runtime_step_times_s(plan, steps=args.steps, optim=optim)[args.warmup:])
    print(f"model {args.model} ({plan.model.num_params / 1e6:.2f} M params), batch {plan.global_batch}x{plan.seq_len} "
          f"as {args.micro_batches} micro-batches, 1 thread, median of {args.steps - args.warmup} steps")
    print(f"{'plain PyTorch loop':>22}: {plain * 1e3:8.2f} ms/step")
    print(f"{'hethub runtime, 1 rank':>22}: {rt * 1e3:8.2f} ms/step")
    print(f"{'ratio runtime/plain':>22}: {rt / plain:8.3f}")
    if args.skip_demo:
        return
    print("\nthe demo's uniform and hethub plans on demo-cpu.toml (EMULATED kinds), measured through torchrun vs "
          "predicted:")
    with tempfile.TemporaryDirectory() as d:
        rows = demo_plans_rows(steps=args.steps, warmup=args.warmup, workdir=Path(d))
    print(f"{'plan':>10} {'measured ms':>12} {'predicted ms':>13} {'error':>8}")
    for strategy, measured, predicted in rows:
        err = (predicted - measured) / measured
        print(f"{strategy:>10} {measured * 1e3:12.1f} {predicted * 1e3:13.1f} {err:+8.1%}")


if __name__ == "__main__":
    main()
