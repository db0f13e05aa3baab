"""The split backward of zero-bubble schedules by explicit weight-gradient functions.

ZB-H1 (Qi et al., ICLR 2024) splits a micro-batch's backward into B, the input gradient the
previous stage waits for, and W, the weight gradients nobody waits for. For each weight GEMM
Y = X A^T, B runs dX = dY A and W runs dA = dY^T X (and a bias's dY summed over tokens). Here every
weight GEMM of a stage (the decoder blocks' projections and the head) goes through :func:`linear`;
while a split executor records (:func:`recording`), it builds :class:`_LinearFn`, whose backward
inside :func:`deferring` computes only dX and queues dA and the bias gradient; :meth:`Deferred.run`
later computes them and adds them to ``.grad`` as autograd's accumulation would. Everything else
(norms, attention, the elementwise ops, the embedding) stays in B, as in the paper.

Why not torch's own split (``torch.distributed.pipelining._backward``, retained graph plus one
``autograd.grad`` per parameter group in W): measured on this repository's small preset (3 layers,
micro-batch 2 x 128 tokens, one CPU thread) its B cost ~0.9 of a whole backward (its hooks and
graph walks) and its W another ~0.6 (one autograd engine run per parameter group), B + W ~1.5
backwards; here B is ~0.8 and W ~0.26, B + W ~1.07 (docs/runtime.md).

Outside :func:`recording` (every other schedule, evaluation) :func:`linear` is ``F.linear``, so
their graphs and numbers are exactly as before. Under autocast the function casts as autocast does
(inputs to the autocast dtype, gradients back to each input's dtype).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn


class _State:
    record = False  # build the deferrable function (a split executor's forward, and its B's recompute)
    queue: list[Callable[[], None]] | None = None  # where B queues the weight gradients


# One executor runs per process and autograd may call backward on a device thread: a process-wide
# flag, set only inside the executor's op.
_state = _State()


@contextmanager
def recording() -> Iterator[None]:
    """Build the split-able weight GEMMs in this forward (and in B's recomputed forward)."""
    old, _state.record = _state.record, True
    try:
        yield
    finally:
        _state.record = old


class Deferred:
    """The weight gradients one B queued, for its W."""

    def __init__(self) -> None:
        self.work: list[Callable[[], None]] = []

    def run(self) -> None:
        """Compute every queued weight gradient and add it to its parameter's ``.grad``."""
        work, self.work = self.work, []
        for fn in work:
            fn()


@contextmanager
def deferring() -> Iterator[Deferred]:
    """Run a backward inside: the weight GEMMs of :func:`linear` compute only their input gradient
    and queue their weight gradients on the returned :class:`Deferred`."""
    out = Deferred()
    old_q, old_rec = _state.queue, _state.record
    _state.queue, _state.record = out.work, True
    try:
        yield out
    finally:
        _state.queue, _state.record = old_q, old_rec


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear``, with a weight gradient that :func:`deferring` can split off while recording."""
    if not (_state.record and torch.is_grad_enabled() and weight.requires_grad):
        return F.linear(x, weight, bias)
    dev = x.device.type
    dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else None
    return _LinearFn.apply(x, weight, bias, dtype)


class Linear(nn.Linear):
    """``nn.Linear`` through :func:`linear` (same parameters and names)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


def _accumulate(p: torch.Tensor, g: torch.Tensor) -> None:
    """Add `g` to ``p.grad`` as autograd's AccumulateGrad does (in place when a gradient is there)."""
    if p.grad is None:
        p.grad = g
    else:
        p.grad += g


class _LinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,  # type: ignore[override]
                dtype: torch.dtype | None) -> torch.Tensor:
        if dtype is None:
            xc, wc, out = x, weight, F.linear(x, weight, bias)
        else:  # as autocast would: the GEMM in its dtype
            xc, wc = x.to(dtype), weight.to(dtype)
            with torch.autocast(x.device.type, enabled=False):
                out = F.linear(xc, wc, None if bias is None else bias.to(dtype))
        ctx.save_for_backward(xc, wc)
        ctx.x_dtype, ctx.has_bias, ctx.autocast = x.dtype, bias is not None, dtype is not None
        ctx.params = (weight, bias)
        return out

    @staticmethod
    def backward(ctx, dy: torch.Tensor):  # type: ignore[override]
        xc, wc = ctx.saved_tensors
        weight, bias = ctx.params
        # Under autocast the GEMMs run in the forward's dtype, never re-cast by an ambient autocast.
        no_cast = torch.autocast(dy.device.type, enabled=False) if ctx.autocast else contextlib.nullcontext()
        with no_cast:
            dyc = dy.to(wc.dtype)
            dx = (dyc @ wc).to(ctx.x_dtype) if ctx.needs_input_grad[0] else None
        want_w, want_b = ctx.needs_input_grad[1], ctx.has_bias and ctx.needs_input_grad[2]
        if _state.queue is not None:
            w, b, ac = weight if want_w else None, bias if want_b else None, ctx.autocast
            _state.queue.append(lambda: _weight_grads_into(w, b, xc, dyc, autocast=ac))
            return dx, None, None, None
        with no_cast:
            d2 = dyc.reshape(-1, dyc.shape[-1])
            dw = (d2.t() @ xc.reshape(-1, xc.shape[-1])).to(weight.dtype) if want_w else None
            db = d2.sum(0).to(bias.dtype) if want_b else None
        return dx, dw, db, None


def _weight_grads_into(weight: torch.Tensor | None, bias: torch.Tensor | None, xc: torch.Tensor, dyc: torch.Tensor,
                       *, autocast: bool) -> None:
    """W of one weight GEMM: dA = dY^T X (and the bias's dY summed over tokens) added to ``.grad``. Where
    a gradient of the GEMM's dtype is already there, the GEMM accumulates into it (``addmm_``, as
    Megatron's gradient-accumulation fusion): no separate product to allocate and add."""
    d2 = dyc.reshape(-1, dyc.shape[-1])
    with torch.autocast(d2.device.type, enabled=False) if autocast else contextlib.nullcontext():
        if weight is not None:
            x2 = xc.reshape(-1, xc.shape[-1])
            if weight.grad is not None and weight.grad.dtype == d2.dtype:
                weight.grad.addmm_(d2.t(), x2)
            else:
                _accumulate(weight, (d2.t() @ x2).to(weight.dtype))
        if bias is not None:
            _accumulate(bias, d2.sum(0).to(bias.dtype))
