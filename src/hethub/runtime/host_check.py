"""Before launching a plan's ranks on this host: does the host have the plan's devices?

``hethub train`` starts every rank of the plan here. A plan for GPU kinds started on a CPU machine
would otherwise run every rank on the CPU (each rank falls back to gloo/CPU) until the kernel's OOM
killer ends it; so the launcher refuses, with the numbers, before any rank starts:

- accelerator kinds (``device_type`` other than cpu): the host needs one visible device of that type
  per rank of such kinds (each rank also checks its own device when it starts, runtime/devices.py;
  this check is the launcher's, before any process exists);
- CPU kinds: the CPU ranks' predicted peak memory plus each process's own footprint must fit the
  memory the host has available now.

torch is imported only to count devices, and only when the plan has accelerator kinds.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from hethub.errors import MemoryFitError, RuntimeSetupError
from hethub.plan import Plan

GIB = 1024**3
# Resident memory of one idle training rank before its model (Python, torch, gloo), measured on this
# 2-core VM with torch 2.13 CPU: ~0.30 GiB RSS per rank (`ps -o rss` of `hethub train` ranks).
RANK_OVERHEAD_BYTES = int(0.3 * GIB)


class PeakMemory(Protocol):
    """What the check reads of a prediction (``hethub.predict.result.Prediction`` is one; the runtime
    never imports the predictor: the launcher predicts and passes the result in)."""

    @property
    def peak_mem_bytes_by_device(self) -> Mapping[int, float]: ...


@dataclass(frozen=True)
class Host:
    accelerators: dict[str, int]  # device type (cuda, npu, ...) -> devices torch can see here
    mem_available_bytes: int | None  # None: unknown (not Linux)


def this_host(device_types: set[str]) -> Host:
    return Host(accelerators={t: _visible(t) for t in device_types}, mem_available_bytes=_mem_available())


def _visible(device_type: str) -> int:
    try:
        import torch
    except ImportError:
        return 0
    mod = getattr(torch, device_type, None)
    try:
        return int(mod.device_count()) if mod is not None and mod.is_available() else 0
    except (AttributeError, RuntimeError):
        return 0


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
    return plan.cluster.kinds[kind].device_type == "cpu"


def check_host(plan: Plan, prediction: PeakMemory, *, host: Host | None = None, plan_path: str = "plan") -> None:
    """Raise RuntimeSetupError (missing accelerators, exit 6) or MemoryFitError (CPU ranks exceed the
    host's available memory, exit 4) with the numbers; return if the host can run every rank."""
    ranks_by_kind = Counter(plan.cluster.devices[d].kind for p in plan.pipelines for s in p.stages for d in s.devices)
    accel = {k: n for k, n in ranks_by_kind.items() if not is_cpu_kind(plan, k)}
    by_type: dict[str, dict[str, int]] = {}
    for k, n in accel.items():
        by_type.setdefault(plan.cluster.kinds[k].device_type, {})[k] = n
    host = host or this_host(set(by_type))
    for dtype, kinds_n in sorted(by_type.items()):
        need, have = sum(kinds_n.values()), host.accelerators.get(dtype, 0)
        if need > have:
            kinds = ", ".join(f"{n} x {k}" for k, n in sorted(kinds_n.items()))
            raise RuntimeSetupError(
                f"{plan_path} places {need} ranks on {dtype} devices ({kinds}) but this host has {have} visible "
                f"(torch.{dtype}.device_count()); 'hethub train' starts every rank here. Nothing was started. Fix: "
                "run the plan on machines with those devices ('hethub launch', or torchrun per node: README "
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
