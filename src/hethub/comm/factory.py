"""Build the runtime's Communicator for a plan: plain, or bridged across device kinds.

``bridge`` (or the environment variable HETHUB_BRIDGE, which wins so a test suite can be re-run
with the bridge on without editing it):

- ``auto``: kinds whose native libraries interoperate share a native group; others are bridged.
  On a CPU-only run every kind resolves to gloo, so nothing is bridged.
- ``force``: every kind is its own island and cross-kind traffic always takes the bridge, even
  between two CPU kinds. This is how tests emulate two vendors on one CPU host.
- ``off``: the plain :class:`Communicator` over the world's backend. Refused when the plan's kinds
  need different native backends, since one backend cannot serve them all.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from datetime import timedelta

import torch.distributed as dist

from hethub.comm.backends import DEVICE_OF_BACKEND, backend_for_kind
from hethub.comm.bridge import BridgedCommunicator
from hethub.comm.communicator import Communicator
from hethub.comm.hierarchical import DEFAULT_CHUNK_BYTES
from hethub.errors import RuntimeSetupError
from hethub.plan import Plan

BRIDGE_ENV = "HETHUB_BRIDGE"
BRIDGE_MODES = ("auto", "force", "off")


def bridge_mode(requested: str = "auto") -> str:
    """The effective mode: HETHUB_BRIDGE if set, else ``requested``; validated."""
    mode = os.environ.get(BRIDGE_ENV, "").strip().lower() or requested
    if mode not in BRIDGE_MODES:
        raise RuntimeSetupError(f"bridge mode {mode!r} (from {BRIDGE_ENV} or the caller) is not one of "
                                f"{', '.join(BRIDGE_MODES)}. Fix: set {BRIDGE_ENV}=auto, force or off.")
    return mode


def kinds_of_ranks(plan: Plan) -> list[str]:
    """The device kind of every torch rank (rank i is the plan's i-th device in ascending id order)."""
    return [plan.cluster.devices[d].kind for d in plan.devices]


def make_communicator(*, plan: Plan, rank: int, timeout: timedelta | None = None, bridge: str = "auto",
                      device_types: Mapping[str, str] | None = None,
                      chunk_bytes: int = DEFAULT_CHUNK_BYTES, transport: str = "gloo") -> Communicator:
    """The Communicator for this rank of ``plan``; call after ``init_process_group`` on every rank.

    ``device_types`` maps each kind to the torch device type its ranks compute on ("cuda", "npu",
    "cpu"); it decides each kind's backend. Default: the device the world's backend serves (cpu for
    a gloo world, cuda for an nccl world), which is how the runtime places ranks today.
    ``transport``: what moves bytes between islands (``comm/transport.py``; HETHUB_BRIDGE_TRANSPORT wins).
    """
    mode = bridge_mode(bridge)
    if not dist.is_initialized():
        raise RuntimeSetupError("torch.distributed is not initialised. Fix: call init_process_group before "
                                "make_communicator.")
    if dist.get_world_size() != plan.world_size or dist.get_rank() != rank:
        raise RuntimeSetupError(f"this process is rank {dist.get_rank()} of {dist.get_world_size()}, but was "
                                f"asked to be rank {rank} of the plan's {plan.world_size}. Fix: launch one "
                                "process per plan device.")
    kind_of_rank = kinds_of_ranks(plan)
    used = list(dict.fromkeys(kind_of_rank))
    world_device = DEVICE_OF_BACKEND.get(str(dist.get_backend()), "cpu")
    devices = dict(device_types) if device_types is not None else dict.fromkeys(used, world_device)
    absent = [k for k in used if k not in devices]
    if absent:
        raise RuntimeSetupError(f"device_types gives no device for kinds {absent}. Fix: map every kind of the "
                                "plan to 'cuda', 'npu', 'cpu', ...")
    kinds = plan.cluster.kinds
    backend_of_kind = {k: backend_for_kind(kinds[k], device_type=devices[k]) for k in used}
    vendor_of_kind = {k: kinds[k].vendor for k in used}
    if mode == "off":
        if len(set(backend_of_kind.values())) > 1:
            raise RuntimeSetupError(f"{BRIDGE_ENV}=off, but the plan's kinds need different backends "
                                    f"({backend_of_kind}). Fix: use bridge 'auto'.")
        return Communicator(timeout=timeout)
    return BridgedCommunicator(kind_of_rank=kind_of_rank, backend_of_kind=backend_of_kind, timeout=timeout,
                               force_bridge=mode == "force", chunk_bytes=chunk_bytes, vendor_of_kind=vendor_of_kind,
                               transport=transport)
