"""Operator-level compute model of a decoder layer, the embedding and the head.

Every matrix multiply is listed with its (M, N, K) after tensor-parallel sharding (Megatron's
column-parallel QKV and MLP-up, row-parallel attention-out and MLP-down, vocabulary-parallel head),
the attention core per the kind's implementation (``math``: two batched GEMMs with the s x s scores
written, masked, soft-maxed (and dropped out) in memory; ``fused``: the same GEMMs with scale, mask
and softmax as one pass over the scores; ``flash``: one fused kernel, causal half of the work, no
scores in memory), and every memory-bound kernel (norms, activation, residual adds,
rotary, softmax, dropout) by the bytes it moves.

Which memory-bound kernels a layer launches depends on the runtime's code, not on the model: the
:class:`Recipe` says it (a fused norm is one kernel, PyTorch's Python RMSNorm is six; a scale folded
into the score GEMM costs nothing, a separate one a pass over the scores). Each memory-bound kernel
carries its own backward kernels, as autograd runs them: an element-wise op with a saved input reads
the gradient and the input and writes one gradient (3 passes), a mask or dropout re-applies its mask
(2 passes + the mask), a bias's gradient is one reduction, a ``.contiguous()`` copy passes the
gradient through (no kernel), a tensor used twice accumulates two gradients (one add). Backward of
each C = A @ B of (M, N, K): an input-grad GEMM (M, K, N) and a weight-grad GEMM (K, N, M) (2x the
forward FLOPs, their own shapes); flash attention's backward does 2.5x its forward work (it
recomputes the scores).

Kernel times come from :mod:`hethub.predict.gemm`; the kernels of one phase run in stream order
behind the host's dispatch. Operator lists are cached per shape, so the planner pays for each
(shape, kind) once.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

from hethub.predict.gemm import KernelParams, flash_time_s, gemm_time_s, memory_time_s, stream_time_s
from hethub.spec.model import ModelSpec

# An operator: ("gemm", m, n, k, batch) | ("mem", bytes, backward_bytes) | ("flash", flops) | ("allreduce", bytes).
# backward_bytes: the bytes of each backward kernel of a memory-bound forward kernel, () for none.
Op = tuple



@dataclass(frozen=True)
class Recipe:
    """Which memory-bound kernels a runtime launches for a decoder layer (defaults: hethub's runtime).

    Sailor's Megatron-DeepSpeed fp32 profiles need other values; bench/compute_model.py names them
    from that code.
    """

    norm: str = "fused"  # "fused": one kernel (two in backward); "python-rms": pow, mean, eps, rsqrt, 2 multiplies
    qkv_bias: bool = False  # the QKV projection's bias added by its own kernel (gradient: one reduction)
    qkv_layout: str = "copy"  # "copy": q, k, v copied to batch-major; "strided": the score GEMMs read the
    # projection in place (grads concatenated in backward); "copy-after-rotary": three copies after rotary
    rotary: str = "fused"  # "fused": one kernel over q and k; "python": mul, neg, cat, mul, add per tensor
    score_scale: bool = False  # a separate pass scaling the scores (not folded into the score GEMM)
    mask_bytes: int = 0  # bytes per score the mask adds (1: a bool mask read by masked_fill)
    mask_on_view: bool = False  # the mask applied in place on a view of the scores (autograd: CopySlices)
    mlp: str = "fused"  # "fused": one activation kernel (gated: act(gate) * up in one); "mul-then-act": two
    gated_split: bool = False  # gate and up projections as two GEMMs, not one of twice the width


@dataclass(frozen=True)
class Shape:
    """What fixes a layer's operator list: the model's widths and the work one micro-batch brings."""

    arch: str
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    gated: bool
    tokens: int  # micro-batch x sequence length
    seq_len: int
    tp: int
    elem_bytes: int
    attention: str  # "math", "fused" or "flash"
    dropout: bool  # hidden dropout (after attention-out and MLP-down)
    attn_dropout: bool  # dropout on the attention probabilities (math attention only)
    recipe: Recipe = Recipe()

    @staticmethod
    def of(model: ModelSpec, *, mbs: int, seq_len: int, tp: int, elem_bytes: int, attention: str,
           recipe: Recipe | None = None, dropout: bool | None = None, attn_dropout: bool | None = None) -> Shape:
        # GPT/OPT recipes train with dropout (0.1, Megatron's default); Llama recipes without.
        gpt = model.arch == "gpt"
        return Shape(model.arch, model.hidden_size, model.num_heads, model.num_kv_heads, model.ffn_hidden_size,
                     model.vocab_size, model.gated, mbs * seq_len, seq_len, tp, elem_bytes, attention,
                     gpt if dropout is None else dropout, gpt if attn_dropout is None else attn_dropout,
                     recipe or Recipe())


def _mem(fwd: float, *bwd: float) -> Op:
    return ("mem", fwd, tuple(bwd))


def _backward(fwd: list[Op]) -> list[Op]:
    out: list[Op] = []
    for op in reversed(fwd):
        if op[0] == "gemm":
            _, m, n, k, b = op
            out += [("gemm", m, k, n, b), ("gemm", k, n, m, b)]
        elif op[0] == "mem":
            out += [_mem(b) for b in op[2]]
        elif op[0] == "flash":
            out.append(("flash", 2.5 * op[1]))
        else:  # a forward all-reduce of the output becomes one of the input's gradient, at its mirror
            out.append(op)
    return out


def _norm_ops(s: Shape) -> list[Op]:
    th, e = s.tokens * s.hidden, s.elem_bytes
    if s.recipe.norm == "python-rms":
        # x.pow(2), .mean(-1), + eps, rsqrt, x * r, weight * x. Backward (autograd of each): grad * w,
        # grad * x and its reduction (weight grad), grad * r, grad * x and its row reduction, rsqrt's,
        # mean's expand, pow's three kernels, the two gradients of x added.
        row = e * s.tokens
        return [_mem(2 * e * th, *(f * e * th for f in (2, 3, 1, 2, 3, 1, 1, 2, 2, 3, 3)), row),
                _mem(e * th), _mem(2 * row), _mem(2 * row), _mem(2 * e * th), _mem(2 * e * th)]
    # One kernel; backward: the input gradient (read grad and x, write) and the weight/bias gradients.
    return [_mem(2 * e * th, 3 * e * th, 2 * e * th)]


@functools.cache
def layer_ops(s: Shape) -> tuple[tuple[Op, ...], tuple[Op, ...]]:
    """Forward and backward operators of one decoder layer on one TP rank, in issue order."""
    t, h, e, tp, r = s.tokens, s.hidden, s.elem_bytes, s.tp, s.recipe
    d = h // s.heads
    q, kv, f = h // tp, s.kv_heads * d // tp, s.ffn // tp
    th = t * h
    # Residual add; backward: the two gradients of the residual input (norm and skip) are added.
    residual: list[Op] = [_mem(3 * e * th, 3 * e * th)]
    if s.dropout:
        residual.insert(0, _mem((2 * e + 1) * th, (2 * e + 1) * th))
    ops: list[Op] = [*_norm_ops(s), ("gemm", t, q + 2 * kv, h, 1)]
    if r.qkv_bias:
        ops.append(_mem(2 * e * t * (q + 2 * kv), e * t * (q + 2 * kv)))
    ops += [*attention_core_ops(s), ("gemm", t, h, q, 1), ("allreduce", e * th), *residual, *_norm_ops(s)]
    if s.gated and r.gated_split:
        ops += [("gemm", t, f, h, 1), ("gemm", t, f, h, 1)]
    else:
        ops.append(("gemm", t, (2 if s.gated else 1) * f, h, 1))
    if s.gated and r.mlp == "mul-then-act":
        ops += [_mem(3 * e * t * f, 3 * e * t * f, 3 * e * t * f), _mem(2 * e * t * f, 3 * e * t * f)]
    elif s.gated:
        ops.append(_mem(3 * e * t * f, 4 * e * t * f))
    else:
        ops.append(_mem(2 * e * t * f, 3 * e * t * f))
    ops += [("gemm", t, h, f, 1), ("allreduce", e * th), *residual]
    if tp == 1:
        ops = [op for op in ops if op[0] != "allreduce"]
    return tuple(ops), tuple(_backward(ops))


@functools.cache
def attention_core_ops(s: Shape) -> tuple[Op, ...]:
    """Forward operators between the QKV projection and the output projection (rotary, then the
    attention core): what selective recomputation re-runs in backward."""
    t, e, tp, r = s.tokens, s.elem_bytes, s.tp, s.recipe
    d = s.hidden // s.heads
    q, kv = s.hidden // tp, s.kv_heads * d // tp
    batch = (t // s.seq_len) * (s.heads // tp)
    scores = batch * s.seq_len * s.seq_len
    ops: list[Op] = []
    if r.qkv_layout == "strided":  # views in; backward concatenates the q, k, v gradients
        ops.append(_mem(0, 2 * e * t * (q + 2 * kv)))
    if s.arch == "llama":
        if r.rotary == "python":
            for n in (t * q, t * kv):  # q * cos, neg(half), cat, * sin, add; backward likewise
                ops += [_mem(2 * e * n, 2 * e * n), _mem(e * n, e * n), _mem(2 * e * n, 2 * e * n),
                        _mem(2 * e * n, 2 * e * n), _mem(3 * e * n, 3 * e * n)]
        else:
            ops.append(_mem(2 * e * t * (q + kv), 2 * e * t * (q + kv)))
    if r.qkv_layout == "copy-after-rotary":  # .contiguous() copies: the gradient passes through
        ops += [_mem(2 * e * t * q), _mem(2 * e * t * kv), _mem(2 * e * t * kv, 2 * e * t * (q + 2 * kv))]
    if s.attention == "flash":
        causal = 0.5
        ops.append(("flash", causal * 4.0 * batch * s.seq_len * s.seq_len * d))
        return tuple(ops)
    if r.qkv_layout == "copy":
        ops.append(_mem(2 * e * t * (q + 2 * kv), 2 * e * t * (q + 2 * kv)))  # heads to batch-major layout
    ops.append(("gemm", s.seq_len, s.seq_len, d, batch))  # scores = Q K^T
    if s.attention == "fused":
        # Megatron's FusedScaleMaskSoftmax: scale, causal mask and softmax in one kernel that reads the
        # scores and writes the probabilities; its backward reads their gradient and the output and
        # writes one gradient (megatron/core/fusions/fused_softmax.py).
        ops.append(_mem(2 * e * scores, 3 * e * scores))
        if s.attn_dropout:
            ops.append(_mem((2 * e + 1) * scores, (2 * e + 1) * scores))
        ops += [("gemm", s.seq_len, d, s.seq_len, batch), _mem(2 * e * t * q)]
        return tuple(ops)
    if r.score_scale:
        ops.append(_mem(2 * e * scores, 2 * e * scores))
    mask = (2 * e + r.mask_bytes) * scores
    # Causal mask; backward re-applies the mask. Masked in place on a view of the score GEMM's output
    # (Megatron's masked_fill_ without a scaling pass before it), autograd's CopySlices runs the mask's
    # backward on a copy: the gradient copied into the base, the slice cloned, masked, copied back.
    mask_bwd = (2 * e * scores, 2 * e * scores, mask, 2 * e * scores) if r.mask_on_view else (mask,)
    ops += [_mem(mask, *mask_bwd),
            _mem(2 * e * scores, 3 * e * scores)]  # softmax; backward reads the gradient and the output
    if s.attn_dropout:
        ops.append(_mem((2 * e + 1) * scores, (2 * e + 1) * scores))
    ops += [("gemm", s.seq_len, d, s.seq_len, batch),  # context = P V
            _mem(2 * e * t * q)]  # back to token-major (.contiguous(): the gradient passes through)
    return tuple(ops)


def column_wgrad_gemms(s: Shape) -> tuple[Op, Op]:
    """The weight-gradient GEMMs of a layer's two column-parallel projections (QKV, MLP up/gate), in
    backward order (MLP first): what a runtime that overlaps the input gradient's all-reduce with them
    (hethub.runtimes: tp_wgrad_overlap) hides it under."""
    t, h, tp = s.tokens, s.hidden, s.tp
    q, kv, f = h // tp, s.kv_heads * (h // s.heads) // tp, s.ffn // tp
    up = (2 if s.gated else 1) * f
    return ("gemm", h, up, t, 1), ("gemm", h, q + 2 * kv, t, 1)


@functools.cache
def embedding_ops(s: Shape) -> tuple[tuple[Op, ...], tuple[Op, ...]]:
    """Vocabulary-parallel lookup (+ learned positions and dropout for GPT/OPT), its all-reduce."""
    t, h, e = s.tokens, s.hidden, s.elem_bytes
    fwd: list[Op] = [_mem(2 * e * t * h)]
    if s.tp > 1:
        fwd.append(("allreduce", e * t * h))
    if s.arch == "gpt":
        fwd += [_mem(3 * e * t * h), _mem((2 * e + 1) * t * h)]
    # Backward: gradient into the table (scatter-add of the token rows).
    bwd: list[Op] = [_mem(3 * e * t * h)]
    return tuple(fwd), tuple(bwd)


@functools.cache
def head_ops(s: Shape) -> tuple[tuple[Op, ...], tuple[Op, ...]]:
    """Final norm, vocabulary-parallel logits and the fp32 cross-entropy over them."""
    t, h, e = s.tokens, s.hidden, s.elem_bytes
    v = s.vocab // s.tp
    fwd: list[Op] = [_mem(2 * e * t * h), ("gemm", t, v, h, 1), _mem(2 * 4 * t * v), _mem(2 * 4 * t * v)]
    bwd: list[Op] = [_mem(2 * 4 * t * v), ("gemm", t, h, v, 1), ("gemm", h, v, t, 1), _mem(4 * e * t * h)]
    if s.tp > 1:
        bwd.insert(3, ("allreduce", e * t * h))
    return tuple(fwd), tuple(bwd)


def op_flops(ops: tuple[Op, ...]) -> float:
    return sum(2.0 * op[1] * op[2] * op[3] * op[4] if op[0] == "gemm" else op[1] if op[0] == "flash" else 0.0
               for op in ops)


def phase_time_s(ops: tuple[Op, ...], p: KernelParams, *, elem_bytes: int,
                 allreduce_s: Callable[[float], float] | None = None) -> float:
    """Wall time of one phase's operators in stream order. All-reduces cost `allreduce_s(bytes)`
    where given (a profile measured on a real TP group includes them), else nothing: the predictor
    adds TP collectives itself. A forward op that launches no kernel (a view) costs nothing."""
    durations: list[float] = []
    for op in ops:
        if op[0] == "gemm":
            durations.append(gemm_time_s(p, m=op[1], n=op[2], k=op[3], batch=op[4], elem_bytes=elem_bytes))
        elif op[0] == "mem":
            if op[1] > 0:
                durations.append(memory_time_s(p, op[1]))
        elif op[0] == "flash":
            durations.append(flash_time_s(p, op[1]))
        elif allreduce_s is not None:  # the GPU also waits for the group's slowest rank
            durations.append(allreduce_s(op[1]) + p.collective_wait_s)
    return stream_time_s(durations, launch_s=p.launch_s)
