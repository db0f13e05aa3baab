"""Per-kind precision at run time: autocast per rank, the dtype activations cross stage boundaries in,
and dynamic loss scaling for fp16.

Each stage computes in its kind's precision (the plan's per-kind precision: ``bf16-mixed`` where the
kind supports bf16, ``fp16-mixed`` where it has only fp16 tensor cores (Volta, Turing), ``fp32`` on
CPUs). Parameters, gradients and optimizer state stay fp32 (autocast casts copies of the weights for
each op), so the master weights are the parameters themselves.

Stage boundaries: an activation leaves a stage in that stage's compute dtype (bf16/fp16, or fp32) and
its gradient comes back in the same dtype; the receiving stage casts it into its own residual
stream, which is in its compute dtype (``StageModel(compute_dtype=...)``: a 16-bit stage keeps its
hidden states in 16 bits, so a message already in its dtype enters as it came). Both ends know the
dtype from the plan, so buffers match.

Loss scaling: fp16 gradients underflow without it. When any kind of the plan trains in fp16, every
rank uses one :class:`DynamicLossScaler` (a global scale: gradients of every stage descend from the
same scaled loss). The head stage back-propagates ``loss * scale``; after the gradient sync every
rank divides gradients by the scale; the global gradient norm (computed anyway for clipping, and
identical on every rank) being inf/nan means some gradient overflowed somewhere, so every rank skips
the step together and halves the scale; after ``growth_interval`` good steps the scale doubles.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch

from hethub.plan import Plan

COMPUTE_DTYPES: dict[str, torch.dtype | None] = {"bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16,
                                                 "fp32": None}


def compute_dtype(precision: str) -> torch.dtype | None:
    """The autocast dtype of a precision (None: full fp32)."""
    try:
        return COMPUTE_DTYPES[precision]
    except KeyError:
        raise ValueError(f"unknown precision {precision!r}; the runtime runs {', '.join(COMPUTE_DTYPES)}") from None


def autocast(device: torch.device, precision: str) -> AbstractContextManager[object]:
    """Autocast to the precision's dtype on ``device`` (CPU included, when a plan asks for it)."""
    dtype = compute_dtype(precision)
    return nullcontext() if dtype is None else torch.autocast(device.type, dtype=dtype)


def kind_precision(plan: Plan, kind: str, *, override: str | Mapping[str, str] | None = None,
                   cpu_autocast: bool = False) -> str:
    """The precision ``kind``'s ranks train in: ``override`` (one for all kinds, or per kind), else the
    plan's for the kind; fp32 where the kind computes on the CPU (the runtime does not autocast there
    unless ``cpu_autocast``, which tests of mixed precision on a CPU host use). Every rank derives the
    same.

    The plan's precision for a kind is ``Plan.precision_of(kind)``: its per-kind entry, else the
    plan-wide precision.
    """
    if plan.cluster.kinds[kind].device_type == "cpu" and not cpu_autocast:
        return "fp32"
    if isinstance(override, str):
        return override
    if override and kind in override:
        return override[kind]
    return plan.precision_of(kind)


def boundary_dtype(upstream_precision: str) -> torch.dtype:
    """The dtype an activation (and its gradient) crosses a stage boundary in: the sending stage's
    compute dtype, fp32 for an fp32 stage."""
    return compute_dtype(upstream_precision) or torch.float32


@dataclass
class DynamicLossScaler:
    """One loss scale for the whole job (same arithmetic on every rank, so ranks stay in step).

    Defaults are those of ``torch.amp.GradScaler`` (2**16, x2 after 2000 good steps, x0.5 on overflow).
    """

    scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    min_scale: float = 1.0
    good_steps: int = 0
    skipped_steps: int = 0

    def update(self, *, overflow: bool) -> None:
        """After a step: back off on overflow (the step was skipped), grow after enough good steps."""
        if overflow:
            self.scale = max(self.min_scale, self.scale * self.backoff_factor)
            self.good_steps = 0
            self.skipped_steps += 1
            return
        self.good_steps += 1
        if self.good_steps >= self.growth_interval:
            self.scale *= self.growth_factor
            self.good_steps = 0

    @staticmethod
    def overflowed(global_norm: float) -> bool:
        """Whether a step's gradients hold inf/nan (their global norm is then not finite)."""
        return not math.isfinite(global_norm)
