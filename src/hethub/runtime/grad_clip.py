"""Global-norm gradient clipping: the one home of its arithmetic for the runtime, the single-device
reference and the profiler.

torch 2.6 split ``clip_grad_norm_`` into ``torch.nn.utils.get_total_norm`` (the L2 norm of the
per-tensor norms) and ``clip_grads_with_norm_`` (multiply by ``min(max_norm / (total + 1e-6), 1)``),
which the runtime needs apart: its total is summed over ranks between the two. Where torch has them
they run; on an older torch in the supported range (2.5) the fallbacks below do the same arithmetic
with the same kernels in the same order (torch's own grouping by device and dtype, ``_foreach_norm``
where the device has foreach kernels, the norms stacked in that order), so a run's numbers do not
depend on which torch release a node has. The clip coefficient is computed in fp32 whatever the
total's dtype, so every caller scales by the same number.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.utils._foreach_utils import _group_tensors_by_device_and_dtype, _has_foreach_support

_TORCH_TOTAL_NORM = getattr(torch.nn.utils, "get_total_norm", None)
_TORCH_CLIP_WITH_NORM = getattr(torch.nn.utils, "clip_grads_with_norm_", None)


def clip_coefficient(total: torch.Tensor, *, max_norm: float) -> torch.Tensor:
    """What gradients are multiplied by to clip them to ``max_norm`` given their global L2 norm
    ``total``: torch's ``min(max_norm / (total + 1e-6), 1)``, in fp32, a 0-dim tensor on total's device."""
    return torch.clamp(float(max_norm) / (total.float().reshape(()) + 1e-6), max=1.0)


@torch.no_grad()
def fallback_total_norm(grads: Iterable[torch.Tensor]) -> torch.Tensor:
    """``torch.nn.utils.get_total_norm(grads)`` (L2) for a torch without it, bit for bit (module doc)."""
    tensors = list(grads)
    if not tensors:
        return torch.tensor(0.0)
    first_device = tensors[0].device
    norms: list[torch.Tensor] = []
    for (device, _), ([group], _) in _group_tensors_by_device_and_dtype([tensors]).items():
        if _has_foreach_support(group, device):
            norms.extend(torch._foreach_norm(group, 2.0))
        else:
            norms.extend(torch.linalg.vector_norm(g, 2.0) for g in group)
    return torch.linalg.vector_norm(torch.stack([n.to(first_device) for n in norms]), 2.0)


@torch.no_grad()
def fallback_clip_with_norm_(params: Iterable[torch.Tensor], max_norm: float, total: torch.Tensor) -> None:
    """``torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)`` for a torch without it, bit for
    bit for an fp32 ``total`` (module doc): every ``.grad`` multiplied in place by :func:`clip_coefficient`."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return
    coef = clip_coefficient(total, max_norm=max_norm)
    for (device, _), ([group], _) in _group_tensors_by_device_and_dtype([grads]).items():
        if _has_foreach_support(group, device):
            torch._foreach_mul_(group, coef.to(device))
        else:
            on_device = coef.to(device)
            for g in group:
                g.mul_(on_device)


def total_norm(grads: Iterable[torch.Tensor]) -> torch.Tensor:
    """The L2 norm of ``grads`` viewed as one vector (the norm of their norms), a 0-dim tensor on the
    first gradient's device (a CPU zero when there are none)."""
    return (_TORCH_TOTAL_NORM or fallback_total_norm)(list(grads))


def clip_with_norm_(params: Iterable[torch.Tensor], max_norm: float, total: torch.Tensor) -> None:
    """Scale the ``.grad`` of every one of ``params`` in place so their global norm ``total`` (over
    whatever ranks the caller summed) becomes at most ``max_norm``; the coefficient in fp32."""
    (_TORCH_CLIP_WITH_NORM or fallback_clip_with_norm_)(list(params), max_norm, total.float().reshape(()))
