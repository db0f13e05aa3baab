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
    # W's products build no graph: a gradient with history would hold W's inputs until it is dropped.
    assert not any(g.requires_grad for g in got.values())
    tol = 1e-2 if autocast else 1e-6
    torch.testing.assert_close(dx_split, dx, rtol=tol, atol=tol)
    assert got.keys() == ref.keys()
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], rtol=tol, atol=tol, msg=name)
    # B computed the norms' weights but none of the projections': those are W's.
    projections = {n for n in ref if n.endswith(".weight") and "norm" not in n}
    assert projections and not projections & after_b
    assert {n for n in ref if "norm" in n} <= after_b


def test_b_then_w_equals_one_backward_on_the_lean_recipe() -> None:
    # bf16 residual stream, fused-kernel norms, native GQA: B + W still give autograd's gradients.
    model = StageModel(SPEC, layers=(0, 2), embedding=False, head=False, rope_len=16, compute_dtype=torch.bfloat16)
    dx, ref, _ = _grads(model, split=False, autocast=True)
    dx_split, got, after_b = _grads(model, split=True, autocast=True)
    torch.testing.assert_close(dx_split, dx, rtol=1e-2, atol=1e-2)
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], rtol=1e-2, atol=1e-2, msg=name)
    assert {n for n in ref if "norm" in n} == after_b


def test_split_gemms_share_one_weight_copy_per_update() -> None:
    """ZB-H1 holds several micro-batches' forwards until their W: their split GEMMs save one bf16 copy
    of each weight, as autocast's weight cache does for F.linear, not one per micro-batch. An update
    makes a new copy; a weight stored in bf16 is its own."""
    from hethub.profiler.tensor_memory import saved_for_backward

    model = StageModel(SPEC, layers=(0, 2), embedding=False, head=False, rope_len=16, compute_dtype=torch.bfloat16)
    params = list(model.parameters())
    outs = []
    with torch.autocast("cpu", dtype=torch.bfloat16), saved_for_backward(exclude=params, weights=params) as rec:
        for _ in range(3):
            with weight_grad.recording():
                outs.append(model(torch.randn(2, 16, SPEC.hidden_size)))
    gemm_weights = sum(p.numel() for n, p in model.named_parameters() if p.dim() == 2)
    assert rec.copy_bytes == 2 * gemm_weights
    w = model.layers["0"].attn.wq.weight
    copy = weight_grad.cast_weight(w, torch.bfloat16)
    assert weight_grad.cast_weight(w, torch.bfloat16) is copy
    with torch.no_grad():
        w.mul_(2.0)
    again = weight_grad.cast_weight(w, torch.bfloat16)
    assert again is not copy and torch.equal(again, w.detach().bfloat16())
    stored = torch.nn.Parameter(torch.randn(3, 3).bfloat16())
    assert weight_grad.cast_weight(stored, torch.bfloat16).data_ptr() == stored.data_ptr()


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
