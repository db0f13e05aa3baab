"""Gradient clipping's one home (runtime/grad_clip.py): on a torch without get_total_norm /
clip_grads_with_norm_ (2.5) its fallbacks give torch's numbers bit for bit."""

from __future__ import annotations

import pytest
import torch

from hethub.runtime import grad_clip
from hethub.runtime.grad_clip import clip_with_norm_, fallback_clip_with_norm_, fallback_total_norm, total_norm

needs_torch_pair = pytest.mark.skipif(grad_clip._TORCH_TOTAL_NORM is None, reason="this torch has no get_total_norm")


def _params(seed: int, *, scale: float) -> list[torch.nn.Parameter]:
    """Parameters of mixed shapes and dtypes (two foreach groups), one without a gradient."""
    g = torch.Generator().manual_seed(seed)
    shapes = [(17, 33), (5,), (3, 4, 7), (1,), (64, 2), (9, 9)]
    dtypes = [torch.float32, torch.float32, torch.bfloat16, torch.float32, torch.bfloat16, torch.float32]
    params = []
    for i, (shape, dtype) in enumerate(zip(shapes, dtypes, strict=True)):
        p = torch.nn.Parameter(torch.zeros(shape, dtype=dtype))
        if i != 3:
            p.grad = (torch.randn(shape, generator=g) * scale * (1 + i)).to(dtype)
        params.append(p)
    return params


def _clone(params: list[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
    out = []
    for p in params:
        q = torch.nn.Parameter(p.detach().clone())
        q.grad = None if p.grad is None else p.grad.clone()
        out.append(q)
    return out


@needs_torch_pair
@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("scale", [1e-3, 1.0, 40.0])
def test_the_fallbacks_equal_torch_bit_for_bit(seed: int, scale: float) -> None:
    params = _params(seed, scale=scale)
    grads = [p.grad for p in params if p.grad is not None]
    want = torch.nn.utils.get_total_norm(grads)
    got = fallback_total_norm(grads)
    assert got.dtype == want.dtype and got.device == want.device and torch.equal(got, want)
    fp32_only = [g for g in grads if g.dtype == torch.float32]
    assert torch.equal(fallback_total_norm(fp32_only), torch.nn.utils.get_total_norm(fp32_only))

    total = want.float()
    mine, theirs = _clone(params), _clone(params)
    fallback_clip_with_norm_(mine, 1.0, total)
    torch.nn.utils.clip_grads_with_norm_(theirs, 1.0, total)
    for a, b in zip(mine, theirs, strict=True):
        assert (a.grad is None) == (b.grad is None)
        if a.grad is not None:
            assert a.grad.dtype == b.grad.dtype and torch.equal(a.grad, b.grad)


@needs_torch_pair
def test_the_runtime_functions_take_the_fallbacks_where_torch_lacks_the_pair(monkeypatch) -> None:
    params = _params(7, scale=5.0)
    grads = [p.grad for p in params if p.grad is not None]
    with_torch = total_norm(grads)
    a = _clone(params)
    clip_with_norm_(a, 0.5, with_torch)
    monkeypatch.setattr(grad_clip, "_TORCH_TOTAL_NORM", None)
    monkeypatch.setattr(grad_clip, "_TORCH_CLIP_WITH_NORM", None)
    assert torch.equal(total_norm(grads), with_torch)
    b = _clone(params)
    clip_with_norm_(b, 0.5, with_torch)
    assert all(torch.equal(x.grad, y.grad) for x, y in zip(a, b, strict=True) if x.grad is not None)


def test_clipping_scales_down_to_max_norm_and_never_up() -> None:
    params = _params(3, scale=10.0)
    total = fallback_total_norm([p.grad for p in params if p.grad is not None])
    assert total > 1.0
    fallback_clip_with_norm_(params, 1.0, total)
    after = fallback_total_norm([p.grad.float() for p in params if p.grad is not None])
    assert after == pytest.approx(1.0, rel=1e-2)  # bf16 gradients round the product
    small = _params(3, scale=1e-4)
    before = [p.grad.clone() for p in small if p.grad is not None]
    fallback_clip_with_norm_(small, 1.0, fallback_total_norm([p.grad for p in small if p.grad is not None]))
    assert all(torch.equal(x, p.grad) for x, p in zip(before, [p for p in small if p.grad is not None], strict=True))
    assert torch.equal(fallback_total_norm([]), torch.tensor(0.0))
    assert grad_clip.clip_coefficient(torch.tensor(4.0, dtype=torch.float64), max_norm=2.0).dtype == torch.float32
