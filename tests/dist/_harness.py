"""Helpers for the distributed tests: concise plans, forked gloo ranks, a single-process reference."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch

from hethub.comm.local_ranks import run_local_ranks
from hethub.plan import Pipeline, Plan, Stage
from hethub.runtime.optim import OptimConfig
from hethub.runtime.reference import train_single_device
from hethub.spec.cluster import Cluster, Link, NodeGroup
from hethub.spec.kind import DeviceKind
from hethub.spec.model import ModelSpec

TIMEOUT = timedelta(seconds=30)
F, S = "cpu-fast", "cpu-slow"
JOIN_TIMEOUT_S = 60.0
SPEC = ModelSpec(name="t6", num_layers=6, hidden_size=32, num_heads=4, num_kv_heads=2, ffn_hidden_size=64,
                 vocab_size=256, max_seq_len=32)
SEQ = 16
# eps=1e-6 bounds how much Adam can amplify fp32 rounding in near-zero gradients (|dp| <= lr*|dg|/eps).
OPTIM = OptimConfig(lr=1e-3, warmup_steps=1, total_steps=3, grad_clip=0.5, eps=1e-6)


def _kind(name: str, slowdown: float = 1.0) -> DeviceKind:
    return DeviceKind(name=name, vendor="cpu", mem_bytes=2**33, peak_flops=1e11, intra_node_bw_bytes_per_s=1e10,
                      intra_node_latency_s=1e-6, backend="gloo", emulated_slowdown=slowdown)


CLUSTER = Cluster(name="test", kinds={"cpu-fast": _kind("cpu-fast"), "cpu-slow": _kind("cpu-slow", 2.0)},
                  groups=(NodeGroup("cpu-fast", 1, 4), NodeGroup("cpu-slow", 1, 4)),
                  inter_node=Link(1e9, 5e-5), cross_kind=Link(1e9, 5e-5))


def make_plan(pipelines: list[tuple[int, int, list[tuple[str, int, int]]]], *, spec: ModelSpec = SPEC,
              schedule: str = "1f1b", seq_len: int = SEQ) -> Plan:
    """``pipelines``: (micro_batch_size, num_micro_batches, [(kind, tp, num_layers), ...]) each.
    Devices are handed out per kind in order; layers are contiguous from 0."""
    free = {k: [d.id for d in CLUSTER.devices_of_kind(k)] for k in CLUSTER.kind_names}
    out = []
    for mbs, m, stages in pipelines:
        start, built = 0, []
        for i, (kind, tp, n) in enumerate(stages):
            devs = tuple(free[kind][:tp])
            free[kind] = free[kind][tp:]
            built.append(Stage(kind=kind, devices=devs, layers=(start, start + n), embedding=i == 0,
                               head=i == len(stages) - 1))
            start += n
        out.append(Pipeline(micro_batch_size=mbs, num_micro_batches=m, stages=tuple(built)))
    plan = Plan(model=spec, cluster=CLUSTER, global_batch=sum(p.num_samples for p in out), seq_len=seq_len,
                pipelines=tuple(out), schedule=schedule, precision="fp32")
    return plan.validate()


def batches(plan: Plan, *, steps: int, seed: int = 1234) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, plan.model.vocab_size, (plan.global_batch, plan.seq_len + 1), generator=g)
            for _ in range(steps)]


_REFERENCES: dict[tuple[Any, ...], dict[str, Any]] = {}


def reference(spec: ModelSpec, data: list[torch.Tensor], *, optim: OptimConfig = OPTIM,
              seed: int = 0) -> dict[str, Any]:
    """Plain single-process training on the whole global batch: loss/grads of step 0, params after all.

    Kept per test process for the same model, data, optimizer and seed (the training is deterministic):
    every parity case runs twice (bridge auto and forced) against the same reference. Read-only."""
    key = (repr(spec), repr(optim), seed,
           tuple((tuple(t.shape), hashlib.sha256(t.numpy().tobytes()).hexdigest()) for t in data))
    if key not in _REFERENCES:
        _REFERENCES[key] = train_single_device(spec, data, optim=optim, seed=seed)
    return _REFERENCES[key]


def warm_imports() -> None:
    """The first optimizer step imports a lot (~5 s): a test module pays it once, before forking its
    ranks, instead of in every forked rank."""
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 2)).sum().backward()
    opt.step()


def run_ranks(world: int, fn: Callable[..., Any], *args: Any) -> list[Any]:
    """Run ``fn(rank, *args)`` on ``world`` forked gloo ranks; return results by rank, raising on failure."""
    return run_local_ranks(world, fn, *args, timeout_s=JOIN_TIMEOUT_S, collective_timeout_s=TIMEOUT.total_seconds(),
                           error=AssertionError)
