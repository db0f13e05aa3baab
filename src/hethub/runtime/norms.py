"""The decoder's norms: RMSNorm (Llama) and LayerNorm (GPT), each keeping for backward what a fused
kernel keeps when its input is 16-bit.

A 16-bit input is the mixed-precision residual stream (``runtime/model.py``): there the norm keeps
its input and the fp32 per-token statistics only, as the fused kernels of Apex, Transformer Engine and
``torch.nn.functional.rms_norm`` on CUDA do, and returns its output in the input's dtype. RMSNorm's
forward is torch's fused kernel (``aten._fused_rms_norm``, which returns the fp32 inverse RMS beside
the output) where the weight has the input's dtype (parameters stored in the compute dtype) and torch
has the kernel (releases from mid-2025 on), else the same arithmetic in fp32 ops, keeping the same
tensors (so the memory model holds either way); its backward recomputes the normalised input from the two in fp32. On
CPU, torch's ``F.rms_norm`` runs a composite of six ops whose autograd keeps three full-size fp32
tensors (and on CUDA too when the weight is fp32 and the input 16-bit), hence the explicit function.
LayerNorm runs ``F.layer_norm`` with autocast off, so every device keeps the 16-bit input, mean and
rstd (CUDA's autocast would widen a 16-bit input to fp32 first).

An fp32 input (fp32 plans) takes the code it always took, bit for bit: RMSNorm as
``x * rsqrt(mean(x^2) + eps) * w`` through autograd, ``nn.LayerNorm``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hethub.runtime.tensor_parallel import TPContext, sum_grad_over_tp
from hethub.spec.model import ModelSpec

_NO_TP = TPContext()


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5, *, tp: TPContext = _NO_TP) -> None:
        super().__init__()
        self.eps, self.tp = eps, tp  # tp: under sequence parallelism, its weight sees one slice
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = sum_grad_over_tp(self.weight, self.tp)
        if x.dtype == torch.float32:
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * w
        return _FusedRMSNorm.apply(x, w, self.eps)


class LayerNorm(nn.LayerNorm):
    def __init__(self, dim: int, eps: float = 1e-5, *, tp: TPContext = _NO_TP) -> None:
        super().__init__(dim, eps=eps)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, b = sum_grad_over_tp(self.weight, self.tp), sum_grad_over_tp(self.bias, self.tp)
        if x.dtype == torch.float32:
            return F.layer_norm(x, self.normalized_shape, w, b, self.eps)
        with torch.autocast(x.device.type, enabled=False):
            return F.layer_norm(x, self.normalized_shape, w, b, self.eps)


def make_norm(spec: ModelSpec, tp: TPContext = _NO_TP) -> nn.Module:
    """The model's norm: LayerNorm for GPT-style models, RMSNorm for Llama-style ones. ``tp``: the
    stage's TP context (under sequence parallelism the norm runs on this rank's slice)."""
    return LayerNorm(spec.hidden_size, eps=spec.norm_eps, tp=tp) if spec.arch == "gpt" else \
        RMSNorm(spec.hidden_size, eps=spec.norm_eps, tp=tp)


# torch releases from mid-2025 on (pytorch/pytorch pull request 153666); before them the fp32 ops below.
_FUSED_KERNEL = getattr(torch.ops.aten, "_fused_rms_norm", None)


def _rms_norm_fp32(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of a 16-bit ``x`` in fp32 ops: y in x's dtype and the fp32 inverse RMS (shape ``[..., 1]``),
    what ``aten._fused_rms_norm`` returns."""
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * rstd * weight.float()).to(x.dtype), rstd


class _FusedRMSNorm(torch.autograd.Function):
    """y = x / rms(x) * w in fp32, returned in x's dtype; keeps x and the fp32 inverse RMS."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        with torch.autocast(x.device.type, enabled=False):
            if weight.dtype == x.dtype and _FUSED_KERNEL is not None:  # what F.rms_norm runs on CUDA
                y, rstd = _FUSED_KERNEL(x, [x.shape[-1]], weight, eps)
            else:  # fp32 weights beside a 16-bit stream (which that kernel does not take on every device), or
                # a torch without the kernel: the same fp32 arithmetic, the same tensors kept
                y, rstd = _rms_norm_fp32(x, weight, eps)
        ctx.save_for_backward(x, rstd, weight)
        return y

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:
        x, rstd, weight = ctx.saved_tensors
        with torch.autocast(dy.device.type, enabled=False):
            xhat = x.float() * rstd
            g = dy.float() * weight.float()
            dx = None
            if ctx.needs_input_grad[0]:
                dx = (rstd * (g - xhat * (g * xhat).mean(-1, keepdim=True))).to(x.dtype)
            dw = None
            if ctx.needs_input_grad[1]:
                dw = (dy.float() * xhat).reshape(-1, x.shape[-1]).sum(0).to(weight.dtype)
        return dx, dw, None
