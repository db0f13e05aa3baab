"""The decoder, built per stage: Llama-style (RMSNorm, rotary, GQA, SwiGLU) or GPT-style (LayerNorm,
learned positions, GeLU/ReLU MLP, biases), as described by a ModelSpec.

A stage module holds only its layers (plus embedding / final norm + head where the plan puts them)
but names every parameter as the full model does (``layers.7.attn.wq.weight``), so gradients,
checkpoints and parity checks map by name. Weights are drawn per parameter from a generator seeded
by hash(seed, name) at full size and then sliced to this rank's TP shard: the same model results
however it is split.
"""

from __future__ import annotations

import hashlib
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.checkpoint import checkpoint

from hethub.errors import RuntimeSetupError
from hethub.layout import seq_positions
from hethub.plan import Recompute
from hethub.runtime.context_parallel import CPContext, ring_attention
from hethub.runtime.norms import make_norm
from hethub.runtime.tensor_parallel import (
    TPContext,
    enter_tp,
    gather_seq,
    leave_tp,
    scatter_seq,
    shard,
    sum_grad_over_tp,
    vocab_parallel,
    vocab_parallel_cross_entropy,
    vocab_parallel_embedding,
)
from hethub.runtime.weight_grad import Linear, linear
from hethub.spec.model import ModelSpec

_COLUMN = ("wq", "wk", "wv", "w1", "w3")  # split along output features (dim 0 of weight and bias)
_ROW = ("wo", "w2")  # split along input features (dim 1 of weight); bias replicated
_VOCAB = ("embed.weight", "head.weight")  # split by vocabulary (dim 0) where the stage's TP degree divides it


def shard_dim_of(name: str, *, vocab_parallel: bool) -> int | None:
    """Dimension along which TP splits parameter ``name``; None when replicated. ``vocab_parallel``:
    the stage splits embedding and head by vocabulary (see ``tensor_parallel.vocab_parallel``)."""
    if name in _VOCAB:
        return 0 if vocab_parallel else None
    parts = name.split(".")
    if len(parts) >= 2 and parts[-2] in _COLUMN:
        return 0
    if len(parts) >= 2 and parts[-2] in _ROW and parts[-1] == "weight":
        return 1
    return None


ROPE_SCALINGS = ("linear", "llama3")


def rope_tables(*, head_dim: int, seq_len: int, base: float = 10000.0, scaling: dict[str, Any] | None = None,
                dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of every position's rotary angles, [seq_len, head_dim], computed in fp64 and stored in
    ``dtype``. ``scaling``: Hugging Face's rope_scaling (``rope_type`` linear or llama3, formulas as in
    Transformers' modeling_rope_utils)."""
    inv = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    if scaling:
        inv = _scaled_inv_freq(inv, dict(scaling))
    ang = torch.outer(torch.arange(seq_len, dtype=torch.float64), inv)
    ang = torch.cat([ang, ang], dim=-1)
    return ang.cos().to(dtype), ang.sin().to(dtype)


def _scaled_inv_freq(inv: torch.Tensor, sc: dict[str, Any]) -> torch.Tensor:
    kind = sc.get("rope_type")
    if kind not in ROPE_SCALINGS:
        raise RuntimeSetupError(f"the model's field 'rope_scaling.rope_type' is {kind!r}, which the runtime does not "
                                f"implement. Fix: use a model with rope type default, {' or '.join(ROPE_SCALINGS)}.")
    factor = float(sc["factor"])
    if kind == "linear":
        return inv / factor
    # Llama 3.1: long wavelengths divided by the factor, short ones kept, a smooth blend between.
    low, high, old = float(sc["low_freq_factor"]), float(sc["high_freq_factor"]), sc["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    out = torch.where(wavelen > old / low, inv / factor, inv)
    smooth = (old / wavelen - low) / (high - low)
    blended = (1 - smooth) * out / factor + smooth * out
    medium = ~(wavelen < old / high) & ~(wavelen > old / low)
    return torch.where(medium, blended, out)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-b, a], dim=-1) * sin


# The plan's attention implementation per kind (hethub.plan.Plan.attention_of) -> SDPA backends. "flash":
# only memory-efficient kernels (FlashAttention, memory-efficient, cuDNN; on CPU torch's flash kernel),
# which keep no s x s scores; no silent fallback to the math kernel, whose scores the memory model
# would not have counted. "math": the reference kernel, which materialises scores and softmax.
SDPA_BACKENDS = {
    "flash": [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION],
    "math": [SDPBackend.MATH],
}


class Attention(nn.Module):
    """Multi-head attention; ``recompute_core``: checkpoint the attention core (rotary, scores,
    softmax, attention over V), so backward re-runs it instead of keeping what the kernel saves
    (selective recomputation, Korthikanti et al. 2022, plus the cheap elementwise rotary).

    ``native_gqa``: SDPA takes K and V at their own head count (``enable_gqa``; FlashAttention-2 and
    torch's CPU flash kernel read each K/V head for its group of query heads), so the kernel keeps
    them at that width. Otherwise K and V are repeated to every query head first (fp32 plans: their
    key and value gradients stay bit for bit what they were; the grouped kernel sums a group's
    gradients in another order)."""

    def __init__(self, spec: ModelSpec, tp: TPContext, attention: str = "flash", *,
                 recompute_core: bool = False, native_gqa: bool = False, cp: CPContext | None = None) -> None:
        super().__init__()
        self.tp, self.recompute_core, self.native_gqa = tp, recompute_core, native_gqa
        self.cp, self.kernel = cp or CPContext(), attention
        self.heads, self.kv_heads = spec.num_heads // tp.size, spec.num_kv_heads // tp.size
        self.head_dim = spec.head_dim
        h, bias = spec.hidden_size, spec.has_bias
        qkv_bias = bias or spec.qkv_bias
        self.wq = Linear(h, self.heads * self.head_dim, bias=qkv_bias)
        self.wk = Linear(h, self.kv_heads * self.head_dim, bias=qkv_bias)
        self.wv = Linear(h, self.kv_heads * self.head_dim, bias=qkv_bias)
        self.wo = Linear(self.heads * self.head_dim, h, bias=False)
        # Row-parallel bias is added once, after the reduction, so it stays replicated.
        self.wo_bias = nn.Parameter(torch.zeros(h)) if bias else None
        if attention not in SDPA_BACKENDS:
            raise ValueError(f"attention implementation {attention!r} is not one of {', '.join(SDPA_BACKENDS)}: "
                             "hethub's runtime has no fused scale-mask-softmax kernel (a plan with it is for "
                             "prediction under training.runtime megatron or deepspeed). Fix: set "
                             "training.kinds.<kind>.attention to flash or math")
        self.backends = SDPA_BACKENDS[attention]

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        x = enter_tp(x, self.tp)  # under sequence parallelism: the whole (CP-local) sequence
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        tables = (rope[0][:s], rope[1][:s]) if rope is not None else None
        if self.recompute_core and torch.is_grad_enabled():
            # Non-reentrant: it keeps only the projections' q, k and v for the re-run (compute width
            # under autocast; rotary is re-run with them).
            o = checkpoint(self._core, q, k, v, tables, use_reentrant=False)
        else:
            o = self._core(q, k, v, tables)
        o = leave_tp(self.wo(o.transpose(1, 2).reshape(b, s, -1)), self.tp)
        return o if self.wo_bias is None else o + sum_grad_over_tp(self.wo_bias, self.tp)

    def _core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              rope: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        """The attention core: rotary on Q and K, then softmax(Q K^T / sqrt(d), causal) V with each
        K/V head serving its group of query heads (GQA)."""
        if rope is not None:
            q, k = _rotate(q, *rope), _rotate(k, *rope)
        if self.cp.size > 1:  # K and V travel the CP ring at their own head count
            return ring_attention(q, k, v, self.cp, kernel=self.kernel)
        grouped = self.kv_heads != self.heads
        if grouped and not self.native_gqa:
            rep = self.heads // self.kv_heads
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        with sdpa_kernel(self.backends):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=grouped and self.native_gqa)


class MLP(nn.Module):
    def __init__(self, spec: ModelSpec, tp: TPContext) -> None:
        super().__init__()
        self.tp, self.act, bias = tp, spec.activation, spec.has_bias
        h, f = spec.hidden_size, spec.ffn_hidden_size // tp.size
        self.w1 = Linear(h, f, bias=bias)
        self.w3 = Linear(h, f, bias=bias) if spec.gated else None
        self.w2 = Linear(f, h, bias=False)
        self.w2_bias = nn.Parameter(torch.zeros(h)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = enter_tp(x, self.tp)
        if self.w3 is not None:
            y = F.silu(self.w1(x)) * self.w3(x)
        else:
            y = F.gelu(self.w1(x)) if self.act == "gelu" else F.relu(self.w1(x))
        y = leave_tp(self.w2(y), self.tp)
        return y if self.w2_bias is None else y + sum_grad_over_tp(self.w2_bias, self.tp)


class Block(nn.Module):
    def __init__(self, spec: ModelSpec, tp: TPContext, attention: str = "flash", *,
                 recompute_core: bool = False, native_gqa: bool = False, cp: CPContext | None = None) -> None:
        super().__init__()
        self.attn_norm = make_norm(spec, tp)
        self.attn = Attention(spec, tp, attention, recompute_core=recompute_core, native_gqa=native_gqa, cp=cp)
        self.mlp_norm, self.mlp = make_norm(spec, tp), MLP(spec, tp)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), rope)
        return x + self.mlp(self.mlp_norm(x))


class StageModel(nn.Module):
    """Layers [start, end) of the decoder, plus the embedding and/or final norm + head.

    ``forward`` takes token ids (embedding stage) or hidden states, and returns hidden states, or,
    on the head stage, the *sum over samples of each sample's mean token loss* (so replicas with
    different sample counts can be combined exactly by a global division).

    ``compute_dtype``: the stage's mixed-precision dtype (bf16/fp16; run it under autocast to that
    dtype), None for fp32. It is the dtype of the residual stream: the embedding's output and a hidden
    state received from another stage are cast to it on entry (fp32 without one), so a 16-bit stage
    keeps its hidden states, norm inputs and messages in 16 bits; its RoPE tables are stored in it, so
    rotary does not widen q and k; its norms keep what fused kernels keep (``runtime/norms.py``); and
    its attention takes K and V at their own head count (SDPA's native GQA). The memory model
    (``hethub.predict.memory.activations``) counts exactly what this saves.
    """

    def __init__(self, spec: ModelSpec, *, layers: tuple[int, int], embedding: bool, head: bool,
                 tp: TPContext | None = None, recompute: Recompute | str | bool = Recompute.NONE, seed: int = 0,
                 rope_len: int | None = None, attention: str = "flash",
                 chunks: tuple[tuple[int, int], ...] = (), compute_dtype: torch.dtype | None = None,
                 cp: CPContext | None = None) -> None:
        super().__init__()
        self.residual_dtype = compute_dtype or torch.float32
        # Context parallelism: this rank's sequence positions (layout.seq_positions), in its order.
        self.cp = cp or CPContext()
        self.seq_len = rope_len or spec.max_seq_len
        if self.cp.size > 1:
            held = seq_positions(self.seq_len, cp=self.cp.size, cp_rank=self.cp.rank)
            idx = [i for a, b in held for i in range(a, b)]
            self.register_buffer("cp_index", torch.tensor(idx), persistent=False)
        # Virtual stages: the module holds every chunk's layers (named as in the full model) and
        # forward(chunk=c) runs chunk c's; the embedding belongs to chunk 0, the head to the last.
        self.chunk_layers = [[str(i) for i in range(a, b)] for a, b in (chunks or (layers,))]
        self.spec, self.tp, self.recompute = spec, tp or TPContext(), Recompute.of(recompute)
        self.has_embedding, self.has_head = embedding, head
        # A tied head uses the same shard of the same table, so both uses keep one layout.
        self.vocab_parallel = vocab_parallel(spec.vocab_size, self.tp.size)
        vocab = spec.vocab_size // self.tp.size if self.vocab_parallel else spec.vocab_size
        if embedding or (head and spec.tied_embeddings):
            self.embed = nn.Embedding(vocab, spec.hidden_size)
        if embedding and spec.arch == "gpt":
            self.pos = nn.Embedding(spec.max_seq_len, spec.hidden_size)
        # Selective recomputation checkpoints inside each block; full checkpoints whole blocks (forward).
        core = self.recompute is Recompute.SELECTIVE
        self.layers = nn.ModuleDict({i: Block(spec, self.tp, attention, recompute_core=core,
                                              native_gqa=compute_dtype is not None, cp=self.cp)
                                     for c in self.chunk_layers for i in c})
        if head:
            self.norm = make_norm(spec, self.tp)
            if not spec.tied_embeddings:
                self.head = Linear(spec.hidden_size, vocab, bias=False)
        if spec.arch == "llama":
            # Positions up to rope_len (the run's sequence length) only: a 128k-context model's full
            # table would be 128 MiB per rank. Each position's angles do not depend on the length.
            cos, sin = rope_tables(head_dim=spec.head_dim, seq_len=rope_len or spec.max_seq_len, base=spec.rope_theta,
                                   scaling=dict(spec.rope_scaling), dtype=self.residual_dtype)
            if self.cp.size > 1:  # this rank's positions only, as buffers (model state, not activations)
                cos, sin = cos[self.cp_index], sin[self.cp_index]
            self.register_buffer("rope_cos", cos, persistent=False)
            self.register_buffer("rope_sin", sin, persistent=False)
        init_parameters(self, seed=seed, tp=self.tp, num_layers=spec.num_layers)

    def shard_dim(self, name: str) -> int | None:
        """Dimension along which this stage's TP splits parameter ``name``; None when replicated."""
        return shard_dim_of(name, vocab_parallel=self.vocab_parallel)

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None, *, chunk: int = 0) -> torch.Tensor:
        last_chunk = chunk == len(self.chunk_layers) - 1
        sp = self.tp.sequence_parallel
        if self.has_embedding and chunk == 0:
            if self.cp.size > 1:
                x = x[:, self.cp_index]
            if self.vocab_parallel:
                h = vocab_parallel_embedding(x, self.embed.weight, self.tp)  # sequence parallel: this rank's slice
            else:
                h = self.embed(x)
                h = scatter_seq(h, self.tp) if sp else h
            if self.spec.arch == "gpt":
                h = h + self._positions(x)
        else:
            h = x
        h = h.to(self.residual_dtype)  # the same tensor where it already is (fp32 stages, 16-bit messages)
        rope = (self.rope_cos, self.rope_sin) if self.spec.arch == "llama" else None
        for name in self.chunk_layers[chunk]:
            block = self.layers[name]
            if self.recompute is Recompute.FULL and torch.is_grad_enabled():
                h = checkpoint(block, h, rope, use_reentrant=False)
            else:
                h = block(h, rope)
        if not (self.has_head and last_chunk):
            return h
        if targets is None:
            raise ValueError("the head stage needs targets to compute the loss")
        if self.cp.size > 1:
            targets = targets[:, self.cp_index]
        w = self.embed.weight if self.spec.tied_embeddings else self.head.weight
        if not self.vocab_parallel:  # TP 1, or an indivisible vocabulary: full logits on every rank
            hn = gather_seq(self.norm(h), self.tp, split_grad=True) if sp else self.norm(h)
            logits = linear(hn, w).float()
            tok = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none")
            return self._sample_losses(tok.view(targets.shape))
        # Column-parallel over the vocabulary: enter_tp sums the partial input gradients in backward.
        logits = linear(enter_tp(self.norm(h), self.tp), w).float()
        return self._sample_losses(vocab_parallel_cross_entropy(logits, targets, self.tp))

    def _sample_losses(self, tok: torch.Tensor) -> torch.Tensor:
        """The sum over samples of each sample's mean token loss; a CP rank's share of it (its tokens'
        losses over the whole sequence length), which the CP ranks' losses and gradients add up to."""
        if self.cp.size == 1:
            return tok.mean(dim=1).sum()
        return (tok.sum(dim=1) / self.seq_len).sum()

    def _positions(self, ids: torch.Tensor) -> torch.Tensor:
        """GPT's learned position embedding of this rank's tokens (under sequence parallelism its slice;
        the table then sees one slice per TP rank, so its gradient is summed over them)."""
        if self.cp.size == 1 and not self.tp.sequence_parallel:
            return self.pos(torch.arange(ids.shape[1], device=ids.device))
        pos = self.cp_index if self.cp.size > 1 else torch.arange(ids.shape[1], device=ids.device)
        if self.tp.sequence_parallel:
            pos = pos.chunk(self.tp.size)[self.tp.rank]
        return F.embedding(pos, sum_grad_over_tp(self.pos.weight, self.tp))


def param_seed(seed: int, name: str) -> int:
    """Stable across processes and Python runs (``hash()`` of a str is salted per process)."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little") & (2**63 - 1)


@torch.no_grad()
def init_parameters(module: StageModel, *, seed: int, tp: TPContext, num_layers: int) -> None:
    for name, p in module.named_parameters():
        dim = module.shard_dim(name)
        full_shape = list(p.shape)
        if dim is not None:
            full_shape[dim] *= tp.size
        leaf = name.rsplit(".", 1)[-1]
        is_norm = "norm" in name.split(".")[-2] if "." in name else False
        if name.endswith("bias") or leaf.endswith("_bias") or (is_norm and leaf == "bias"):
            full = torch.zeros(full_shape)
        elif is_norm:
            full = torch.ones(full_shape)
        else:
            std = 0.02 / math.sqrt(2 * num_layers) if name.endswith(("wo.weight", "w2.weight")) else 0.02
            g = torch.Generator().manual_seed(param_seed(seed, name))
            full = torch.randn(full_shape, generator=g) * std
        p.copy_(shard(full, dim=dim, tp=tp))
