"""Per-kind precision at run time: autocast per rank, the dtype activations cross stage boundaries in,
and dynamic loss scaling for fp16.

Each stage computes in its kind's precision (the plan's per-kind precision: ``bf16-mixed`` where the
kind supports bf16, ``fp16-mixed`` where it has only fp16 tensor cores (Volta, Turing), ``fp32`` on
CPUs).

Parameters and master weights (Megatron-LM's recipe, every mixed-precision plan, sharded optimizer or
not): a mixed-precision rank stores its parameters in the compute dtype (:func:`param_dtype`), so
autocast finds its weights already cast and keeps no second copy; gradients accumulate in fp32 "main
grads" (one contiguous buffer, ``runtime/grad_buffer.py``); AdamW steps fp32 master weights
(:class:`MasterWeights`, or ZeRO-1's owned slices of them, ``runtime/zero.py``) and each step's
updated masters are rounded back into the parameters. In fp32 the parameters are their own masters.

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
from torch import nn

from hethub.plan import Plan

COMPUTE_DTYPES: dict[str, torch.dtype | None] = {"bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16,
                                                 "fp32": None}


def compute_dtype(precision: str) -> torch.dtype | None:
    """The autocast dtype of a precision (None: full fp32)."""
    try:
        return COMPUTE_DTYPES[precision]
    except KeyError:
        raise ValueError(f"unknown precision {precision!r}; the runtime runs {', '.join(COMPUTE_DTYPES)}") from None


def param_dtype(precision: str) -> torch.dtype:
    """The dtype a rank stores its parameters in: the compute dtype in mixed precision, else fp32."""
    return compute_dtype(precision) or torch.float32


def store_params(model: nn.Module, dtype: torch.dtype) -> None:
    """Store ``model``'s parameters (not its buffers: RoPE tables keep theirs) in ``dtype``."""
    for p in model.parameters():
        if p.dtype != dtype:
            p.grad = None  # a gradient of the old dtype would not fit the parameter any more
            p.data = p.data.to(dtype)


class MasterWeights:
    """fp32 master weights of an unsharded rank, what its AdamW steps (module doc). Built from the
    fp32 parameters, it keeps a copy of each and stores the parameters in ``dtype`` when that is 16
    bits; in fp32 a parameter is its own master. A copied master's ``.grad`` is its parameter's fp32
    main grad (:meth:`bind_grads`); :meth:`copy_to_params` rounds the updated masters into the
    parameters after each step."""

    def __init__(self, named: list[tuple[str, nn.Parameter]], *, dtype: torch.dtype) -> None:
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.copied = dtype != torch.float32
        self.masters = [p.detach().clone().requires_grad_(True) if self.copied else p for p in self.params]
        if self.copied:
            store_params(nn.ParameterList(self.params), dtype)
        self._by_id = {id(p): m for p, m in zip(self.params, self.masters, strict=True)}

    def of(self, p: torch.Tensor) -> torch.Tensor:
        """The tensor AdamW steps for parameter ``p``."""
        return self._by_id[id(p)]

    def pieces(self) -> list[tuple[str, torch.Tensor, bool]]:
        """(name, master, decayed) for ``optim.build_optimizer_for``: matrices decayed, as in
        ``optim.build_optimizer``."""
        return [(n, m, m.ndim >= 2) for n, m in zip(self.names, self.masters, strict=True)]

    def bind_grads(self) -> None:
        """Point each copied master's ``.grad`` at its parameter's fp32 main grad."""
        if self.copied:
            for p, m in zip(self.params, self.masters, strict=True):
                m.grad = p.main_grad  # type: ignore[attr-defined]

    @torch.no_grad()
    def copy_to_params(self) -> None:
        if self.copied:
            for p, m in zip(self.params, self.masters, strict=True):
                p.copy_(m)

    @torch.no_grad()
    def refresh(self) -> None:
        """Set the masters from the parameters again, after weights were loaded into the model."""
        if self.copied:
            for p, m in zip(self.params, self.masters, strict=True):
                m.copy_(p)


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
