"""The decoder's norms (runtime/norms.py): on a 16-bit residual stream they keep what a fused kernel
keeps (the input and fp32 statistics) and match the fp32 formula within 16-bit rounding; on fp32
input they are the written-out formula they always were."""

from __future__ import annotations

import pytest
import torch

from hethub.runtime import norms
from hethub.runtime.norms import LayerNorm, RMSNorm


def _saved(fn, *args) -> tuple[torch.Tensor, list[torch.Tensor]]:
    saved: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*args)
    return out, saved


@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_on_bf16_keeps_its_input_and_rstd_and_matches_fp32(weight_dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    norm = RMSNorm(64).to(weight_dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(64) + 0.5)
    x = torch.randn(2, 8, 64).bfloat16().requires_grad_(True)
    out, saved = _saved(norm, x)
    assert out.dtype == torch.bfloat16
    others = [t for t in saved if t.untyped_storage().data_ptr() != norm.weight.untyped_storage().data_ptr()]
    assert len(others) == 2 and others[0] is x
    assert others[1].shape == (2, 8, 1) and others[1].dtype == torch.float32  # rstd
    dy = torch.randn(2, 8, 64).bfloat16()
    out.backward(dy)
    # The fp32 formula on the same values, through autograd.
    xf, wf = x.detach().float().requires_grad_(True), norm.weight.detach().float().requires_grad_(True)
    ref = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + norm.eps) * wf
    ref.backward(dy.float())
    torch.testing.assert_close(out.float(), ref, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(x.grad.float(), xf.grad, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(norm.weight.grad.float(), wf.grad, rtol=2e-2, atol=5e-2)
    assert x.grad.dtype == torch.bfloat16 and norm.weight.grad.dtype == weight_dtype


def test_fp32_input_takes_the_written_out_formula() -> None:
    norm = RMSNorm(16)
    x = torch.randn(3, 16, requires_grad=True)
    out = norm(x)
    assert out.grad_fn.name() == "MulBackward0"
    assert torch.equal(out, x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps) * norm.weight)


def test_layer_norm_on_bf16_keeps_the_bf16_input_under_autocast() -> None:
    norm = LayerNorm(32)
    x = torch.randn(4, 32).bfloat16().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, saved = _saved(norm, x)
    assert out.dtype == torch.bfloat16
    big = [t for t in saved if t.numel() == x.numel()]
    assert [t.dtype for t in big] == [torch.bfloat16]  # the input itself, no fp32 copy
    ref = torch.nn.functional.layer_norm(x.detach().float(), (32,), norm.weight.detach(), norm.bias.detach())
    torch.testing.assert_close(out.float(), ref, rtol=1e-2, atol=1e-2)



def _rms_run(norm: RMSNorm, x: torch.Tensor, dy: torch.Tensor) -> tuple[list[torch.Tensor], list[tuple], torch.Tensor]:
    """Output and gradients, what backward keeps (shape, dtype, bytes), the rstd."""
    x = x.detach().clone().requires_grad_(True)
    norm.zero_grad(set_to_none=True)
    out, saved = _saved(norm, x)
    out.backward(dy)
    kept = [(tuple(t.shape), t.dtype, t.untyped_storage().nbytes()) for t in saved]
    return [out, x.grad, norm.weight.grad], kept, saved[1]


@pytest.mark.skipif(norms._FUSED_KERNEL is None, reason="this torch has no fused kernel to compare with")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rms_norm_without_the_fused_kernel_matches_it_and_keeps_the_same_tensors(monkeypatch, dtype) -> None:
    """A torch before the kernel (2.5 to mid-2025) runs the fp32 ops: the same outputs and gradients
    within a 16-bit rounding, and the same saved tensors byte for byte (the memory model's figures)."""
    torch.manual_seed(1)
    norm = RMSNorm(96).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(96) + 0.5)
    x, dy = torch.randn(3, 5, 96).to(dtype), torch.randn(3, 5, 96).to(dtype)
    calls: list[int] = []
    kernel = norms._FUSED_KERNEL

    def counted(*args):
        calls.append(1)
        return kernel(*args)

    monkeypatch.setattr(norms, "_FUSED_KERNEL", counted)
    fused, fused_kept, fused_rstd = _rms_run(norm, x, dy)
    monkeypatch.setattr(norms, "_FUSED_KERNEL", None)
    plain, plain_kept, plain_rstd = _rms_run(norm, x, dy)
    assert calls == [1]  # the kernel ran in the first pass only
    assert fused_kept == plain_kept  # x, the fp32 rstd [..., 1], the weight
    assert plain_rstd.dtype == torch.float32 and plain_rstd.shape == (3, 5, 1)
    torch.testing.assert_close(plain_rstd, fused_rstd, rtol=1e-6, atol=0)
    for a, b in zip(plain, fused, strict=True):
        assert a.dtype == b.dtype == dtype
        torch.testing.assert_close(a, b)  # the dtype's default tolerance: a 16-bit rounding
