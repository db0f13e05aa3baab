"""Before launching a plan's ranks on this host: does the host have the plan's devices?

``hethub train`` starts every rank of the plan here. A plan for GPU kinds started on a CPU machine
would otherwise run every rank on the CPU (each rank falls back to gloo/CPU) until the kernel's OOM
killer ends it; so the launcher refuses, with the numbers, before any rank starts:

- accelerator kinds (backend nccl or hccl): the host needs one visible device per rank of such kinds;
- CPU kinds (backend gloo): the CPU ranks' predicted peak memory plus each process's own footprint
  must fit the memory the host has available now.

torch is imported only to count GPUs, and only when the plan has accelerator kinds.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from hethub.errors import MemoryFitError, RuntimeSetupError
from hethub.plan import Plan
from hethub.predict.result import Prediction

GIB = 1024**3
# Resident memory of one idle training rank before its model (Python, torch, gloo), measured on this
# 2-core VM with torch 2.13 CPU: ~0.30 GiB RSS per rank (`ps -o rss` of `hethub train` ranks).
RANK_OVERHEAD_BYTES = int(0.3 * GIB)


@dataclass(frozen=True)
class Host:
    accelerators: int  # devices torch can see (CUDA/ROCm)
    mem_available_bytes: int | None  # None: unknown (not Linux)


def this_host(*, need_accelerators: bool) -> Host:
    n = 0
    if need_accelerators:
        try:
            import torch

            n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        except ImportError:
            n = 0
    return Host(accelerators=n, mem_available_bytes=_mem_available())


def _mem_available() -> int | None:
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def is_cpu_kind(plan: Plan, kind: str) -> bool:
    return plan.cluster.kinds[kind].backend == "gloo"


def check_host(plan: Plan, prediction: Prediction, *, host: Host | None = None, plan_path: str = "plan") -> None:
    """Raise RuntimeSetupError (missing accelerators, exit 6) or MemoryFitError (CPU ranks exceed the
    host's available memory, exit 4) with the numbers; return if the host can run every rank."""
    ranks_by_kind = Counter(plan.cluster.devices[d].kind for p in plan.pipelines for s in p.stages for d in s.devices)
    accel = {k: n for k, n in ranks_by_kind.items() if not is_cpu_kind(plan, k)}
    host = host or this_host(need_accelerators=bool(accel))
    need = sum(accel.values())
    if need > host.accelerators:
        kinds = ", ".join(f"{n} x {k}" for k, n in sorted(accel.items()))
        raise RuntimeSetupError(
            f"{plan_path} places {need} ranks on accelerators ({kinds}) but this host has {host.accelerators} "
            "visible GPU(s) (torch.cuda.device_count()); running them on the CPU would exhaust it. Nothing was "
            "started. Fix: run the plan on machines with those devices (torchrun per node, see README "
            "'Multi-node'), or plan for this host's devices, e.g. --cluster examples/clusters/local-cpu.toml.")
    if host.mem_available_bytes is None:
        return
    cpu_devices = {d for p in plan.pipelines for s in p.stages for d in s.devices
                   if is_cpu_kind(plan, plan.cluster.devices[d].kind)}
    if not cpu_devices:
        return
    by_device = prediction.peak_mem_bytes_by_device
    model_bytes = sum(by_device.get(d, 0.0) for d in cpu_devices)
    total = model_bytes + len(cpu_devices) * RANK_OVERHEAD_BYTES
    if total > host.mem_available_bytes:
        raise MemoryFitError(
            f"{plan_path}: its {len(cpu_devices)} CPU ranks need about {total / GIB:.1f} GiB of host memory "
            f"({model_bytes / GIB:.1f} GiB predicted training state and activations + "
            f"{RANK_OVERHEAD_BYTES / GIB:.1f} GiB per process) but this host has {host.mem_available_bytes / GIB:.1f} "
            "GiB available. Nothing was started. Fix: a smaller model, global batch or sequence length, fewer "
            "ranks, or free memory.")
