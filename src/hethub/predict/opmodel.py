"""Operator-level compute model of a decoder layer, the embedding and the head.

Every matrix multiply is listed with its (M, N, K) after tensor-parallel sharding (Megatron's
column-parallel QKV and MLP-up, row-parallel attention-out and MLP-down, vocabulary-parallel head),
the attention core per the kind's implementation (``math``: two batched GEMMs with the s x s scores
written, masked, soft-maxed and dropped out in memory; ``flash``: one fused kernel, causal half of
the work, no scores in memory), and every memory-bound kernel (norms, activation, residual adds,
rotary, softmax, dropout) by the bytes it moves. Backward: for each C = A @ B of (M, N, K) an
input-grad GEMM (M, K, N) and a weight-grad GEMM (K, N, M) (2x the forward FLOPs, their own
shapes), memory-bound kernels move twice their forward bytes (gradient in, saved input, gradient
out); flash attention's backward does 2.5x its forward work (it recomputes the scores).

Kernel times come from :mod:`hethub.predict.gemm`; the kernels of one phase run in stream order
behind the host's dispatch. Operator lists are cached per shape, so the planner pays for each
(shape, kind) once.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

from hethub.predict.gemm import KernelParams, gemm_time_s, memory_time_s, stream_time_s
from hethub.spec.model import ModelSpec

# An operator: ("gemm", m, n, k, batch) | ("mem", bytes) | ("flash", flops) | ("allreduce", bytes).
Op = tuple


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
    attention: str  # "math" or "flash"
    dropout: bool  # hidden dropout (after attention-out and MLP-down)
    attn_dropout: bool  # dropout on the attention probabilities (math attention only)

    @staticmethod
    def of(model: ModelSpec, *, mbs: int, seq_len: int, tp: int, elem_bytes: int, attention: str) -> Shape:
        # GPT/OPT recipes train with dropout (0.1, Megatron's default); Llama recipes without.
        return Shape(model.arch, model.hidden_size, model.num_heads, model.num_kv_heads, model.ffn_hidden_size,
                     model.vocab_size, model.gated, mbs * seq_len, seq_len, tp, elem_bytes, attention,
                     model.arch == "gpt", model.arch == "gpt")


def _backward(fwd: list[Op]) -> list[Op]:
    out: list[Op] = []
    for op in reversed(fwd):
        if op[0] == "gemm":
            _, m, n, k, b = op
            out += [("gemm", m, k, n, b), ("gemm", k, n, m, b)]
        elif op[0] == "mem":
            out.append(("mem", 2 * op[1]))
        elif op[0] == "flash":
            out.append(("flash", 2.5 * op[1]))
        else:  # a forward all-reduce of the output becomes one of the input's gradient, at its mirror
            out.append(op)
    return out


@functools.cache
def layer_ops(s: Shape) -> tuple[tuple[Op, ...], tuple[Op, ...]]:
    """Forward and backward operators of one decoder layer on one TP rank, in issue order."""
    t, h, e, tp = s.tokens, s.hidden, s.elem_bytes, s.tp
    d = h // s.heads
    q, kv, f = h // tp, s.kv_heads * d // tp, s.ffn // tp
    drop = 1 if s.dropout else 0  # a dropout mask costs one byte per element
    residual = ("mem", (3 * e + drop) * t * h)  # (bias +) (dropout +) residual add: read 2, write 1
    ops: list[Op] = [("mem", 2 * e * t * h), ("gemm", t, q + 2 * kv, h, 1), *attention_core_ops(s)]
    ops += [("gemm", t, h, q, 1), ("allreduce", e * t * h), residual, ("mem", 2 * e * t * h),
            ("gemm", t, (2 if s.gated else 1) * f, h, 1), ("mem", (3 if s.gated else 2) * e * t * f),
            ("gemm", t, h, f, 1), ("allreduce", e * t * h), residual]
    if tp == 1:
        ops = [op for op in ops if op[0] != "allreduce"]
    return tuple(ops), tuple(_backward(ops))


@functools.cache
def attention_core_ops(s: Shape) -> tuple[Op, ...]:
    """Forward operators between the QKV projection and the output projection (rotary, then the
    attention core): what selective recomputation re-runs in backward."""
    t, e, tp = s.tokens, s.elem_bytes, s.tp
    d = s.hidden // s.heads
    q, kv = s.hidden // tp, s.kv_heads * d // tp
    batch = (t // s.seq_len) * (s.heads // tp)
    scores = batch * s.seq_len * s.seq_len
    ops: list[Op] = []
    if s.arch == "llama":
        ops.append(("mem", 2 * e * t * (q + kv)))  # rotary on queries and keys
    if s.attention == "flash":
        causal = 0.5
        ops.append(("flash", causal * 4.0 * batch * s.seq_len * s.seq_len * d))
        return tuple(ops)
    ops += [("mem", 2 * e * t * (q + 2 * kv)),  # heads to batch-major layout
            ("gemm", s.seq_len, s.seq_len, d, batch),  # scores = Q K^T
            ("mem", 2 * e * scores),  # scale and causal mask
            ("mem", 2 * e * scores)]  # softmax
    if s.attn_dropout:
        ops.append(("mem", (2 * e + 1) * scores))
    ops += [("gemm", s.seq_len, d, s.seq_len, batch),  # context = P V
            ("mem", 2 * e * t * q)]  # back to token-major
    return tuple(ops)


@functools.cache
def embedding_ops(s: Shape) -> tuple[tuple[Op, ...], tuple[Op, ...]]:
    """Vocabulary-parallel lookup (+ learned positions and dropout for GPT/OPT), its all-reduce."""
    t, h, e = s.tokens, s.hidden, s.elem_bytes
    fwd: list[Op] = [("mem", 2 * e * t * h)]
    if s.tp > 1:
        fwd.append(("allreduce", e * t * h))
    if s.arch == "gpt":
        fwd += [("mem", 3 * e * t * h), ("mem", (2 * e + 1) * t * h)]
    # Backward: gradient into the table (scatter-add of the token rows).
    bwd: list[Op] = [("mem", 3 * e * t * h)]
    return tuple(fwd), tuple(bwd)


@functools.cache
def head_ops(s: Shape) -> tuple[tuple[Op, ...], tuple[Op, ...]]:
    """Final norm, vocabulary-parallel logits and the fp32 cross-entropy over them."""
    t, h, e = s.tokens, s.hidden, s.elem_bytes
    v = s.vocab // s.tp
    fwd: list[Op] = [("mem", 2 * e * t * h), ("gemm", t, v, h, 1), ("mem", 2 * 4 * t * v), ("mem", 2 * 4 * t * v)]
    bwd: list[Op] = [("mem", 2 * 4 * t * v), ("gemm", t, h, v, 1), ("gemm", h, v, t, 1), ("mem", 4 * e * t * h)]
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
    adds TP collectives itself."""
    durations = []
    for op in ops:
        if op[0] == "gemm":
            durations.append(gemm_time_s(p, m=op[1], n=op[2], k=op[3], batch=op[4], elem_bytes=elem_bytes))
        elif op[0] == "mem":
            durations.append(memory_time_s(p, op[1]))
        elif op[0] == "flash":
            durations.append(op[1] / (p.matmul_flops * p.gemm_eff))
        elif allreduce_s is not None:
            durations.append(allreduce_s(op[1]))
    return stream_time_s(durations, launch_s=p.launch_s)
