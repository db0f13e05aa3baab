"""Which torch.distributed backend each device kind uses, chosen from what this torch build really has.

A kind's catalog entry declares its native backend (``nccl`` for NVIDIA and AMD ROCm, ``hccl`` for
Ascend, ...). Whether this process can use it depends on the torch build and on the plug-ins that
were imported: ``torch_npu`` registers ``hccl`` with ``Backend.register_backend`` when imported. We
ask torch (``is_nccl_available()`` and friends, plus ``Backend.backend_list`` for registered
out-of-tree names) instead of assuming, and fail with the fix when a plan needs what is missing.

A kind whose ranks run on the host (``device_type == "cpu"``: CPU kinds, and accelerator kinds
emulated on CPU) always uses gloo, whatever the catalog says.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch.distributed as dist

from hethub.errors import RuntimeSetupError
from hethub.spec.kind import DEVICE_TYPE_OF_BACKEND, DeviceKind

# The torch device type each backend moves tensors of (host memory: gloo and mpi). Its home is the
# pure spec, beside the kinds that name the backends.
DEVICE_OF_BACKEND = DEVICE_TYPE_OF_BACKEND

# Names torch itself lists in Backend.backend_list; anything else there was registered by a plug-in.
_BUILT_IN = {"undefined", "gloo", "nccl", "xccl", "ucc", "mpi", "fake"}

_INSTALL_HINT = {
    "nccl": "install a CUDA build of torch (or a ROCm build for AMD GPUs, whose RCCL torch calls 'nccl')",
    "hccl": "install torch_npu (Ascend) and import it before hethub creates its groups: it registers 'hccl'",
    "xccl": "install a torch build with XPU support (Intel GPUs)",
    "mccl": "install torch_musa (Moore Threads) and import it before hethub creates its groups: it registers 'mccl'",
    "mpi": "build torch from source against an MPI library",
    "gloo": "install a standard torch build (every official wheel has gloo)",
}


def install_hint(backend: str) -> str:
    """How to get ``backend`` into this process."""
    return _INSTALL_HINT.get(backend, f"install the torch plug-in that registers the {backend!r} backend")


def available_backends() -> tuple[str, ...]:
    """Backends this process can create groups with, in a stable order."""
    if not dist.is_available():
        return ()
    checks = {
        "gloo": dist.is_gloo_available,
        "nccl": dist.is_nccl_available,
        "mpi": dist.is_mpi_available,
        "ucc": getattr(dist, "is_ucc_available", lambda: False),
        "xccl": getattr(dist, "is_xccl_available", lambda: False),
    }
    found = [name for name, check in checks.items() if check()]
    # Out-of-tree backends (hccl from torch_npu, ...) appear in the list only once registered.
    found += [b for b in dist.Backend.backend_list if b not in _BUILT_IN and b not in found]
    return tuple(found)


def native_device_type(kind: DeviceKind) -> str:
    """The torch device type a kind's ranks use when they run on the real hardware."""
    return kind.device_type


def backend_for_kind(kind: DeviceKind, *, device_type: str, available: Iterable[str] | None = None) -> str:
    """The backend for collectives inside ``kind`` when its tensors live on ``device_type``.

    ``available`` defaults to :func:`available_backends` (tests pass their own). Raises
    RuntimeSetupError naming the missing backend and how to get it.
    """
    have = tuple(available_backends() if available is None else available)
    wanted = "gloo" if device_type == "cpu" else kind.backend
    if DEVICE_OF_BACKEND.get(wanted) not in (device_type, None):
        raise RuntimeSetupError(
            f"kind {kind.name!r} declares backend {kind.backend!r}, which moves {DEVICE_OF_BACKEND[wanted]} "
            f"tensors, but its ranks were placed on {device_type!r}. Fix: run the kind on "
            f"{DEVICE_OF_BACKEND[wanted]!r} (or on 'cpu' to emulate it), or correct its 'backend' in the "
            "cluster file.")
    if wanted not in have:
        hint = install_hint(wanted)
        raise RuntimeSetupError(
            f"plan needs backend {wanted!r} for kind {kind.name!r} but this torch build has: "
            f"{', '.join(have) or 'none (torch.distributed is unavailable)'}. Fix: {hint}; or run the kind on "
            "'cpu' with gloo to emulate it.")
    return wanted
