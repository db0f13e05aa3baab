"""The split backward's explicit weight-gradient functions (runtime/weight_grad.py): B leaves the
weight GEMMs' gradients for W, and B + W give autograd's gradients."""

from __future__ import annotations

import contextlib

import pytest
import torch

from hethub.runtime import weight_grad
from hethub.runtime.model import StageModel
from hethub.spec.model import get_model

SPEC = get_model("tiny")


def _grads(model: StageModel, *, split: bool, recompute: bool = False, autocast: bool = False):
    """(input gradient, parameter gradients, weight gradients B left for W) of one micro-batch."""
    model.zero_grad(set_to_none=True)
    model.recompute = type(model.recompute).of("full" if recompute else "none")
    torch.manual_seed(1)
    x = torch.randn(2, 16, SPEC.hidden_size, requires_grad=True)
    dy = torch.randn(2, 16, SPEC.hidden_size)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        with weight_grad.recording() if split else contextlib.nullcontext():
            out = model(x)
        if split:
            with weight_grad.deferring() as later:
                out.backward(dy.to(out.dtype))
            after_b = {n for n, p in model.named_parameters() if p.grad is not None}
            later.run()
        else:
            out.backward(dy.to(out.dtype))
            after_b = set()
    return x.grad, {n: p.grad.clone() for n, p in model.named_parameters()}, after_b


@pytest.mark.parametrize(("recompute", "autocast"), [(False, False), (True, False), (False, True)])
def test_b_then_w_equals_one_backward(recompute: bool, autocast: bool) -> None:
    model = StageModel(SPEC, layers=(0, 2), embedding=False, head=False, rope_len=16)
    dx, ref, _ = _grads(model, split=False, recompute=recompute, autocast=autocast)
    dx_split, got, after_b = _grads(model, split=True, recompute=recompute, autocast=autocast)
    tol = 1e-2 if autocast else 1e-6
    torch.testing.assert_close(dx_split, dx, rtol=tol, atol=tol)
    assert got.keys() == ref.keys()
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], rtol=tol, atol=tol, msg=name)
    # B computed the norms' weights but none of the projections': those are W's.
    projections = {n for n in ref if n.endswith(".weight") and "norm" not in n}
    assert projections and not projections & after_b
    assert {n for n in ref if "norm" in n} <= after_b


def test_outside_recording_it_is_f_linear() -> None:
    lin = weight_grad.Linear(4, 3)
    x = torch.randn(5, 4, requires_grad=True)
    assert lin(x).grad_fn.name() == "AddmmBackward0"
    with weight_grad.recording():
        assert lin(x).grad_fn.name() != "AddmmBackward0"


def test_w_accumulates_through_autograd_with_its_hooks() -> None:
    """W hands its gradients to autograd's accumulation: a parameter's tensor and post-accumulate hooks
    (ZeRO-1's fp32 main_grad) see them in W, and B, which never reaches the weight, calls neither."""
    lin = weight_grad.Linear(4, 3)
    seen: list[str] = []
    lin.weight.register_hook(lambda g: seen.append(f"hook {tuple(g.shape)}"))
    lin.weight.register_post_accumulate_grad_hook(lambda p: seen.append("accumulated"))
    x = torch.randn(2, 5, 4, requires_grad=True)
    with weight_grad.recording():
        out = lin(x)
    with weight_grad.deferring() as later:
        out.sum().backward()
    assert seen == [] and lin.weight.grad is None and x.grad is not None
    later.run()
    assert seen == ["hook (3, 4)", "accumulated"]
    torch.testing.assert_close(lin.weight.grad, torch.ones(2 * 5, 3).t() @ x.detach().reshape(-1, 4))
    torch.testing.assert_close(lin.bias.grad, torch.full((3,), 10.0))
