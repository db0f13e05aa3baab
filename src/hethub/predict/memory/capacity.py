"""How much of a device a plan may use, and the sentence that says which part does not fit.

A kind's memory is ``mem_bytes`` as sold; the memory model already counts what the process holds
outside its tensors (framework context, collective buffers, allocator fragmentation), so the planner
compares the predicted peak with ``mem_bytes x (1 - headroom)``. The headroom covers what the model
does not see: its own error (about 10% on the parts it names, docs/predictor.md), memory the driver
keeps back (ECC, page tables), lazily created communicators and kernels' scratch, and neighbouring
processes. 10% by default: one model error's worth, so a plan predicted at the limit still fits
when the model is 10% low.
"""

from __future__ import annotations

from hethub.predict.memory.model import StageMemory
from hethub.spec.kind import GIB, DeviceKind

DEFAULT_MEM_HEADROOM = 0.1
_LABELS = {"weights": "weights", "master_weights": "master weights", "grads": "gradients",
           "optimizer": "optimizer state", "activations": "activations", "fb_temporaries": "working set",
           "gathered_weights": "gathered parameters (ZeRO-3)",
           "p2p_buffers": "point-to-point buffers",
           "grad_sync_buffer": "gradient-sync buffer", "optimizer_temporaries": "optimizer-step scratch",
           "fragmentation": "allocator fragmentation", "framework_context": "framework context",
           "comm_buffers": "collective buffers"}


def check_headroom(headroom: float) -> float:
    if not isinstance(headroom, (int, float)) or isinstance(headroom, bool) or not 0 <= headroom < 1:
        raise ValueError(f"memory headroom must be a fraction in [0, 1), got {headroom!r}; give e.g. 0.1")
    return float(headroom)


def usable_bytes(kind: DeviceKind, *, headroom: float = DEFAULT_MEM_HEADROOM) -> float:
    """What a plan may use on one device of ``kind``: its memory less the headroom."""
    return kind.mem_bytes * (1 - headroom)


def describe_peak(mem: StageMemory, *, limit: int = 4) -> str:
    """The peak's largest parts, biggest first: 'activations 9.1 GiB + weights 2.0 GiB + ...'."""
    parts = sorted(((v, k) for k, v in mem.parts.items() if v > 0), reverse=True)
    shown = [f"{_LABELS[k]} {v / GIB:.2f} GiB" for v, k in parts[:limit]]
    rest = sum(v for v, _ in parts[limit:])
    if rest > 0:
        shown.append(f"other {rest / GIB:.2f} GiB")
    return " + ".join(shown)


def over_capacity_message(mem: StageMemory, *, where: str, kind: DeviceKind, headroom: float) -> str:
    """'stage 3 on v100-16gb: activations 9.1 GiB + ... = 15.2 GiB exceeds 13.4 GiB (14.9 GiB - 10% headroom)'."""
    cap = usable_bytes(kind, headroom=headroom)
    return (f"{where} on {kind.name}: {describe_peak(mem)} = {mem.total_bytes / GIB:.2f} GiB exceeds "
            f"{cap / GIB:.2f} GiB ({kind.mem_bytes / GIB:.2f} GiB - {headroom:.0%} headroom); the largest part is "
            f"{_LABELS[mem.binding_part()]}")
