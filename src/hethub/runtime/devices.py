"""The runtime's device map: where each rank computes, read from its device kind.

A kind names its torch device type (``cuda``, ``npu``, ``musa``, ``xpu``, ``cpu``), its collective
backend and the package that provides them (``spec.kind.DeviceKind``; the data lives in the pure
catalog). Nothing here names a vendor: a device type that stock torch does not know (``npu``,
``musa``) is registered by the kind's extension when it is imported (``torch_npu``, ``torch_musa``),
after which ``torch.<type>`` answers ``is_available()`` and ``device_count()`` like ``torch.cuda``.
So a new vendor whose extension works that way needs a catalog entry, not code.

When the device cannot be had, start-up stops with :class:`RuntimeSetupError` naming the rank, the
kind and what is missing (the package, a visible device, enough devices on the node), with the fix.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from hethub.comm.backends import available_backends, install_hint
from hethub.errors import RuntimeSetupError
from hethub.plan import Plan
from hethub.runtime.precision import kind_precision
from hethub.spec.kind import DeviceKind

Importer = Callable[[str], ModuleType]
EMULATION_HINT = "or, to emulate the kind on this host's CPU, give it backend = \"gloo\" (device_type \"cpu\")"


@dataclass(frozen=True)
class Placement:
    """One rank's device: the torch device and the kind it serves."""

    rank: int
    kind: str
    device: torch.device

    @property
    def device_type(self) -> str:
        return self.device.type


def _missing(rank: int, kind: DeviceKind, what: str, fix: str) -> RuntimeSetupError:
    return RuntimeSetupError(f"rank {rank} (kind {kind.name!r}) needs {what}. Fix: {fix}; {EMULATION_HINT}.")


def load_extension(kind: DeviceKind, *, rank: int, importer: Importer = importlib.import_module) -> None:
    """Import the kind's device extension (if it has one), which registers its device and backend."""
    module = kind.torch_extension
    if not module:
        return
    try:
        importer(module)
    except ImportError as err:
        raise _missing(rank, kind, f"device type {kind.device_type!r} from the package {module!r}, which is not "
                       f"installed here ({err})", f"install {module} on this node (it must match the torch "
                       f"version, {torch.__version__})") from None


def device_module(device_type: str) -> ModuleType | None:
    """``torch.cuda``, ``torch.npu`` (once torch_npu is imported), ...; None when torch has none."""
    return getattr(torch, device_type, None)


def place_rank(kind: DeviceKind, *, rank: int, local_index: int, importer: Importer = importlib.import_module,
               available: Callable[[], tuple[str, ...]] | None = None) -> Placement:
    """The device rank ``rank`` of ``kind`` computes on: ``<device_type>:<local_index>``, or the CPU.

    ``local_index`` is the device's index within its node (the cluster's node layout). Raises
    RuntimeSetupError naming the rank, the kind and the missing package, device or backend
    (``available`` lists the backends; default: what this torch has, after the extension's import).
    """
    if kind.device_type == "cpu":
        return Placement(rank=rank, kind=kind.name, device=torch.device("cpu"))
    load_extension(kind, rank=rank, importer=importer)
    mod = device_module(kind.device_type)
    package = kind.torch_package or "a torch build for it"
    if mod is None or not hasattr(mod, "is_available"):
        raise _missing(rank, kind, f"torch device type {kind.device_type!r}, which this torch "
                       f"({torch.__version__}) does not provide", f"install {package}")
    if not mod.is_available():
        raise _missing(rank, kind, f"a {kind.device_type!r} device, but this torch ({torch.__version__}) sees "
                       "none on this node", f"run the rank on a node with the device and {package} installed "
                       "(check the driver and the *_VISIBLE_DEVICES variables)")
    count = int(mod.device_count())
    if local_index >= count:
        raise _missing(rank, kind, f"{kind.device_type}:{local_index} (its index in the node layout), but this "
                       f"node shows {count} {kind.device_type} device(s)", "make the cluster file's "
                       "devices_per_node match the node, or expose all its devices to the job")
    have = available() if available is not None else available_backends()
    if kind.backend not in have:
        raise _missing(rank, kind, f"the collective backend {kind.backend!r} for its {kind.device_type} group, but "
                       f"this torch has {', '.join(have) or 'none'}", install_hint(kind.backend))
    return Placement(rank=rank, kind=kind.name, device=torch.device(kind.device_type, local_index))


def activate(placement: Placement) -> None:
    """Make the rank's device current (the collective libraries bind to the current device)."""
    if placement.device.type == "cpu":
        return
    mod = device_module(placement.device.type)
    if mod is not None and hasattr(mod, "set_device"):
        mod.set_device(placement.device.index)


def plan_placement(plan: Plan, rank: int, *, importer: Importer = importlib.import_module) -> Placement:
    """Rank ``rank`` of ``plan`` (the plan's devices in ascending id order) on its kind's device,
    at its index within its node."""
    dev = plan.cluster.devices[plan.devices[rank]]
    return place_rank(plan.cluster.kinds[dev.kind], rank=rank, local_index=dev.local_index, importer=importer)


def device_types_of_kinds(plan: Plan) -> dict[str, str]:
    """Every kind the plan uses -> its torch device type (what the communicator builds groups for)."""
    used = {plan.cluster.devices[d].kind for d in plan.devices}
    return {k: plan.cluster.kinds[k].device_type for k in sorted(used)}


def world_backend(plan: Plan) -> str:
    """The default group's backend: the kinds' one backend when they all share it and one vendor's
    library serves them all (A100 + V100: nccl), else gloo, the bridge's host transport (NVIDIA + AMD
    both say "nccl", but NCCL and RCCL cannot form one communicator); each kind's native groups are
    created beside it."""
    kinds = [plan.cluster.kinds[plan.cluster.devices[d].kind] for d in plan.devices]
    backends = {k.backend for k in kinds}
    vendors = {k.vendor for k in kinds}
    if len(backends) == 1 and (len(vendors) == 1 or backends <= {"gloo", "mpi"}):
        return backends.pop()
    return "gloo"


def placement_summary(plan: Plan, groups: dict[str, Any] | None) -> str:
    """One line per kind: its ranks, device type and native group; then how kinds reach each other.

    ``groups`` is the bridged communicator's ``describe()`` (None for the plain one: one world group)."""
    lines = []
    by_kind: dict[str, list[int]] = {}
    for rank, dev in enumerate(plan.devices):
        by_kind.setdefault(plan.cluster.devices[dev].kind, []).append(rank)
    island_of_kind = {}
    for name, isl in (groups or {}).get("islands", {}).items():
        for k in isl["kinds"]:
            island_of_kind[k] = (name, isl["backend"], isl["ranks"])
    for kind, ranks in by_kind.items():
        k = plan.cluster.kinds[kind]
        if kind in island_of_kind:
            name, backend, members = island_of_kind[kind]
            group = f"{backend} group {name} over ranks {_ranges(members)}"
        else:
            group = f"the {world_backend(plan)} world group"
        lines.append(f"  kind {kind}: ranks {_ranges(ranks)} on {k.device_type} (index from the node layout), {group}, "
                     f"{kind_precision(plan, kind)}")
    if groups is None:
        lines.append("  cross-kind: one world group (plain communicator, no bridge)")
    elif groups.get("bridged"):
        how = "forced" if groups.get("force_bridge") else "kinds whose libraries cannot talk"
        lines.append(f"  cross-kind: p2p and data-parallel sync through the bridge (host-staged gloo; {how})")
    else:
        lines.append("  cross-kind: one native group serves every kind (no bridge needed)")
    return "\n".join(lines)


def _ranges(ranks: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2,5'."""
    out, start = [], None
    for i, r in enumerate(ranks):
        if start is None:
            start = r
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            out.append(f"{start}" if start == r else f"{start}-{r}")
            start = None
    return ",".join(out)
