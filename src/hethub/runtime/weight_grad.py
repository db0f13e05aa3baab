"""The split backward of zero-bubble schedules by explicit weight-gradient functions.

ZB-H1 (Qi et al., ICLR 2024) splits a micro-batch's backward into B, the input gradient the
previous stage waits for, and W, the weight gradients nobody waits for. For each weight GEMM
Y = X A^T, B runs dX = dY A and W runs dA = dY^T X (and a bias's dY summed over tokens). Here every
weight GEMM of a stage (the decoder blocks' projections and the head) goes through :func:`linear`;
while a split executor records (:func:`recording`, its forwards), it builds :class:`_LinearFn` on
the *detached* weight, so B's autograd never reaches the weight: its backward computes dX and, inside
:func:`deferring`, queues dA and the bias gradient; :meth:`Deferred.run` (W) computes them and hands
them to ``.grad`` (in place, fused with the GEMM) or, for parameters with hooks, through autograd's
own accumulation, so every tensor and post-accumulate hook sees them exactly as in a whole backward
(the gradient buffer's hooks rely on it; an fp32 weight in it gets the GEMM fused into its main
grad, ``Deferred.run``). Everything else (norms,
attention, the elementwise ops, the embedding) stays in B, as in the paper.

Why not torch's own split (``torch.distributed.pipelining._backward``, retained graph plus one
``autograd.grad`` per parameter group in W): measured on this repository's small preset (3 layers,
micro-batch 2 x 128 tokens, one CPU thread) its B cost ~0.9 of a whole backward (its hooks and
graph walks) and its W another ~0.6 (one autograd engine run per parameter group), B + W ~1.5
backwards; here B is ~0.8 and W ~0.26, B + W ~1.07 (docs/runtime.md).

Outside :func:`recording` (every other schedule, a pipeline's first stage, evaluation)
:func:`linear` is ``F.linear``, so those graphs and numbers are exactly as before. Under autocast
the function casts as autocast does (inputs to the autocast dtype, gradients back to each input's
dtype), and its weight copies are made as autocast's weight cache makes them: once per parameter
and update (:func:`cast_weight`), shared by every micro-batch that saves it, none where the
parameter is stored in the compute dtype already.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary


class _State:
    record = False  # build the deferrable function (a split executor's forward, and its B's recompute)
    queue: list[_Queued] | None = None  # where B queues the weight gradients


# One executor runs per process and autograd may call backward on a device thread: a process-wide
# flag, set only inside the executor's op.
_state = _State()


@contextmanager
def recording() -> Iterator[None]:
    """Build the split-able weight GEMMs in this forward (their backward must run inside
    :func:`deferring`, or it computes the weight gradients at once)."""
    old, _state.record = _state.record, True
    try:
        yield
    finally:
        _state.record = old


class Deferred:
    """The weight gradients one B queued, for its W."""

    def __init__(self) -> None:
        self.work: list[_Queued] = []

    def run(self) -> None:
        """Compute every queued weight gradient and accumulate it. A parameter without hooks gets it
        straight into ``.grad``, the GEMM accumulating in place where a gradient of its dtype is there
        (``addmm_``, Megatron's gradient-accumulation fusion: no product to allocate, which at hidden
        256 made W ~1.5x slower). A weight in the gradient buffer (``runtime/grad_buffer.py``) whose
        fp32 main grad has the GEMM's dtype gets the same fusion into its main grad, then tells the
        buffer once (``grad_ready``) as its hook would. Any other parameter with tensor or
        post-accumulate hooks (a 16-bit one's main grad) gets it through autograd's own accumulation
        (one ``torch.autograd.backward`` on all of them), so the hooks see it as in a whole backward."""
        work, self.work = self.work, []
        hooked: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        fused: dict[int, torch.Tensor] = {}
        for q in work:
            d2 = q.dyc.reshape(-1, q.dyc.shape[-1])
            x2 = q.xc.reshape(-1, q.xc.shape[-1])
            with torch.autocast(d2.device.type, enabled=False) if q.autocast else contextlib.nullcontext():
                for p, is_weight in ((q.weight, True), (q.bias, False)):
                    if p is None or not p.requires_grad:
                        continue
                    main = getattr(p, "main_grad", None)
                    if is_weight and main is not None and hasattr(p, "grad_ready") and main.dtype == d2.dtype:
                        with torch.no_grad():  # a view of the buffer: no graph through it
                            main.addmm_(d2.t(), x2)
                        fused[id(p)] = p
                        continue
                    if not _has_hooks(p) and is_weight and p.grad is not None and p.grad.dtype == d2.dtype:
                        p.grad.addmm_(d2.t(), x2)
                        continue
                    g = ((d2.t() @ x2) if is_weight else d2.sum(0)).to(p.dtype)  # dA in A's own layout
                    if not _has_hooks(p):
                        if p.grad is None:
                            p.grad = g
                        else:
                            p.grad += g
                        continue
                    old = hooked.get(id(p))  # a tied head's two uses: one sum
                    hooked[id(p)] = (p, g if old is None else old[1] + g)
        for p in fused.values():
            p.grad_ready(p)  # type: ignore[attr-defined]
        if hooked:
            params, values = zip(*hooked.values(), strict=True)
            torch.autograd.backward(list(params), grad_tensors=list(values))


class _Queued:
    """One weight GEMM's W: its parameters and the operands B kept (in the GEMM's dtype)."""

    __slots__ = ("autocast", "bias", "dyc", "weight", "xc")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, xc: torch.Tensor, dyc: torch.Tensor,
                 autocast: bool) -> None:
        self.weight, self.bias, self.xc, self.dyc, self.autocast = weight, bias, xc, dyc, autocast


def _has_hooks(p: torch.Tensor) -> bool:
    """Whether autograd would call hooks when it accumulates into `p` (its tensor hooks live in
    ``_backward_hooks``, its post-accumulate hooks in ``_post_accumulate_grad_hooks``; the unit test
    of W's hooks fails if torch renames them)."""
    return bool(getattr(p, "_backward_hooks", None)) or bool(getattr(p, "_post_accumulate_grad_hooks", None))


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


# Each parameter's compute-dtype copy: (its version and storage when cast, the copy). The F of every
# micro-batch saves the same copy until the parameter changes (an optimizer step or a load bumps its
# version), as autocast's weight cache does for F.linear; a fresh cast per micro-batch would keep one
# copy per micro-batch in flight (ZB-H1 holds its W's inputs for several).
_casts = WeakIdKeyDictionary()  # parameter -> ((version, data pointer), copy)


def cast_weight(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``weight`` (detached) in ``dtype``: itself where it has that dtype, else its one cached copy."""
    if weight.dtype == dtype:
        return weight.detach()
    stamp = (weight._version, weight.data_ptr())
    kept = _casts.get(weight)
    if kept is not None and kept[0] == stamp and kept[1].dtype == dtype:
        return kept[1]
    copy = weight.detach().to(dtype)
    _casts[weight] = (stamp, copy)
    return copy


def drop_casts() -> None:
    """Forget every cached copy (each is freed once no saved tensor holds it; the next use casts again)."""
    _casts.clear()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear``, with a weight gradient that :func:`deferring` can split off while recording."""
    if not (_state.record and torch.is_grad_enabled() and weight.requires_grad):
        return F.linear(x, weight, bias)
    dev = x.device.type
    dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else None
    # The parameters travel outside the graph (a tuple is no autograd input): B never touches them.
    return _LinearFn.apply(x, weight.detach(), None if bias is None else bias.detach(), dtype, (weight, bias))


class Linear(nn.Linear):
    """``nn.Linear`` through :func:`linear` (same parameters and names)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class _LinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,  # type: ignore[override]
                dtype: torch.dtype | None, params: tuple[torch.Tensor, torch.Tensor | None]) -> torch.Tensor:
        if dtype is None:
            xc, wc, out = x, weight, F.linear(x, weight, bias)
        else:  # as autocast would: the GEMM in its dtype, the weight's copy shared as its cache shares it
            xc, wc = x.to(dtype), cast_weight(params[0], dtype)
            with torch.autocast(x.device.type, enabled=False):
                out = F.linear(xc, wc, None if bias is None else bias.to(dtype))
        ctx.save_for_backward(xc, wc)
        ctx.x_dtype, ctx.autocast, ctx.params = x.dtype, dtype is not None, params
        return out

    @staticmethod
    def backward(ctx, dy: torch.Tensor):  # type: ignore[override]
        xc, wc = ctx.saved_tensors
        weight, bias = ctx.params
        # Under autocast the GEMMs run in the forward's dtype, never re-cast by an ambient autocast.
        with torch.autocast(dy.device.type, enabled=False) if ctx.autocast else contextlib.nullcontext():
            dyc = dy.to(wc.dtype)
            dx = (dyc @ wc).to(ctx.x_dtype) if ctx.needs_input_grad[0] else None
        later = Deferred()
        # Detached: the saved input is the layer's own tensor wherever no cast was needed (fp32, or a
        # 16-bit stream), and W's products of it would otherwise build a graph holding dY until the
        # gradients are dropped.
        later.work.append(_Queued(weight, bias, xc.detach(), dyc, ctx.autocast))
        if _state.queue is not None:
            _state.queue.extend(later.work)
        else:  # recorded, but not split: the weight gradients now
            later.run()
        return dx, None, None, None, None

