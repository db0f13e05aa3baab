"""Decoder-only transformer shapes: presets, Hugging Face import, parameter/FLOP/memory arithmetic.

Two families share one description: Llama-style (RMSNorm, rotary positions, grouped-query attention,
SwiGLU MLP, no biases; Qwen2-style q/k/v biases with ``qkv_bias``) and GPT/OPT-style (LayerNorm,
learned positions, GeLU/ReLU MLP, biases). All arithmetic is per token or per layer so the predictor
can cut a model anywhere. The numeric details that change no shape (RoPE base and scaling, the norm's
epsilon) are carried for the runtime, which must reproduce a loaded model's forward exactly.
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

from hethub.errors import SpecError, field_error, load_json

ARCHS = ("llama", "gpt")
ACTIVATIONS = ("swiglu", "gelu", "relu")
PRECISIONS = ("bf16-mixed", "fp16-mixed", "fp32")
_DETAILS = ("qkv_bias", "rope_theta", "rope_scaling", "norm_eps")


@dataclass(frozen=True)
class ModelSpec:
    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    ffn_hidden_size: int
    vocab_size: int
    max_seq_len: int
    arch: str = "llama"
    activation: str = "swiglu"
    tied_embeddings: bool = False
    qkv_bias: bool = False  # biases on q/k/v only (Qwen2); the gpt family has every bias anyway
    rope_theta: float = 10000.0
    # RoPE frequency scaling as sorted (key, value) pairs of Hugging Face's rope_scaling, () for none.
    # A tuple, not a dict, so the spec stays hashable; to_dict/from_dict convert.
    rope_scaling: tuple[tuple[str, Any], ...] = ()
    norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        where = f"model {self.name!r}"
        if isinstance(self.rope_scaling, dict):
            object.__setattr__(self, "rope_scaling", tuple(sorted(self.rope_scaling.items())))
        for f in ("rope_theta", "norm_eps"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int | float) or not v > 0:
                raise field_error(where, f, f"must be a positive number, got {v!r}", "give a positive number")
        for f in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "ffn_hidden_size", "vocab_size",
                  "max_seq_len"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise field_error(where, f, f"must be a positive integer, got {v!r}", "give a positive integer")
        if self.arch not in ARCHS:
            raise field_error(where, "arch", f"must be one of {ARCHS}, got {self.arch!r}", "use llama or gpt")
        if self.activation not in ACTIVATIONS:
            raise field_error(where, "activation", f"must be one of {ACTIVATIONS}, got {self.activation!r}",
                              "use swiglu, gelu or relu")
        if self.hidden_size % self.num_heads:
            raise field_error(where, "num_heads", f"({self.num_heads}) must divide hidden_size "
                              f"({self.hidden_size})", "choose a head count that divides the hidden size")
        if self.num_heads % self.num_kv_heads:
            raise field_error(where, "num_kv_heads", f"({self.num_kv_heads}) must divide num_heads "
                              f"({self.num_heads})", "choose a KV head count that divides the head count")

    # ---- shapes ---------------------------------------------------------------------------------
    # Derived sizes are cached on the (frozen) instance: the planner asks them ~10^5 times per search.
    @functools.cached_property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @functools.cached_property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def gated(self) -> bool:
        return self.activation == "swiglu"

    @property
    def has_bias(self) -> bool:
        return self.arch == "gpt"

    # ---- parameters -----------------------------------------------------------------------------
    @functools.cached_property
    def layer_matmul_params(self) -> int:
        h, kv, f = self.hidden_size, self.kv_dim, self.ffn_hidden_size
        attn = h * h + 2 * h * kv + h * h
        mlp = (3 if self.gated else 2) * h * f
        return attn + mlp

    @functools.cached_property
    def layer_params(self) -> int:
        h, kv, f = self.hidden_size, self.kv_dim, self.ffn_hidden_size
        norms = 2 * h if self.arch == "llama" else 4 * h  # LayerNorm has a bias
        bias = (h + 2 * kv + h + f + h) if self.has_bias else (h + 2 * kv) if self.qkv_bias else 0
        return self.layer_matmul_params + norms + bias

    @functools.cached_property
    def embedding_parts(self) -> tuple[int, int]:
        """The embedding's (token table, learned position embeddings; the gpt family only):
        vocabulary-parallel TP splits the first by rows and replicates the second."""
        return self.vocab_size * self.hidden_size, (self.max_seq_len * self.hidden_size if self.arch == "gpt" else 0)

    @functools.cached_property
    def embedding_params(self) -> int:
        return sum(self.embedding_parts)

    def embedding_elems(self, vocab_tp: int) -> float:
        """Embedding elements on one rank of a stage whose vocabulary is split ``vocab_tp`` ways
        (``vocab_tp(tp)`` where the runtime's rule decides; the sync model's floors take the TP degree)."""
        table, pos = self.embedding_parts
        return table / vocab_tp + pos

    def vocab_tp(self, tp: int) -> int:
        """How many ways a TP-``tp`` stage splits the embedding and head by vocabulary: ``tp`` where it
        divides the vocabulary, else 1 (the runtime replicates them: ``runtime/tensor_parallel.vocab_parallel``)."""
        return tp if self.vocab_size % tp == 0 else 1

    @property
    def final_norm_params(self) -> int:
        return self.hidden_size * (1 if self.arch == "llama" else 2)

    @property
    def head_params(self) -> int:
        """Output projection (final norm excluded). A tied head still occupies memory where it runs."""
        return self.vocab_size * self.hidden_size

    @functools.cached_property
    def num_params(self) -> int:
        head = 0 if self.tied_embeddings else self.head_params
        return self.embedding_params + self.num_layers * self.layer_params + self.final_norm_params + head

    # ---- FLOPs (forward; backward = 2x forward; recomputation adds one forward) ---------------------
    def layer_fwd_flops(self, *, tokens: int, seq_len: int) -> float:
        """Matmul FLOPs of one decoder layer for `tokens` tokens in sequences of `seq_len`.

        Attention counts the full s x s score and value products (Megatron's convention), not the
        causal half, because dense kernels do that work.
        """
        return 2.0 * tokens * self.layer_matmul_params + self.attention_core_fwd_flops(tokens=tokens, seq_len=seq_len)

    def attention_core_fwd_flops(self, *, tokens: int, seq_len: int) -> float:
        """The score and value products of one layer (``Q K^T`` and ``P V``, full s x s): the part
        selective recomputation re-runs."""
        return 4.0 * tokens * seq_len * self.hidden_size

    def head_fwd_flops(self, *, tokens: int) -> float:
        return 2.0 * tokens * self.vocab_size * self.hidden_size

    def fwd_flops_per_token(self, *, seq_len: int) -> float:
        return self.num_layers * self.layer_fwd_flops(tokens=1, seq_len=seq_len) + self.head_fwd_flops(tokens=1)

    def train_flops_per_token(self, *, seq_len: int) -> float:
        """Forward + backward model FLOPs per token (no recomputation): the MFU numerator."""
        return 3.0 * self.fwd_flops_per_token(seq_len=seq_len)

    # ---- memory -----------------------------------------------------------------------------------
    @staticmethod
    def state_bytes_per_param(precision: str) -> dict[str, int]:
        """Bytes per parameter the timing model streams (optimizer update, gradient sync) with Adam:
        mixed precision: 16-bit weights (what a ZeRO-1 all-gather moves), fp32 gradients, fp32 master
        weights and two fp32 Adam moments; fp32: everything fp32. Gradients are 4 bytes in mixed
        precision too because that is what gets synced: hethub's runtime accumulates them in fp32
        (the fp32 main-grad buffer, ``runtime/grad_buffer.py``), as Megatron-LM does
        under bf16 (``accumulate_allreduce_grads_in_fp32``). What a device holds, part by part, is
        the memory model's (``hethub.predict.memory.STATE_BYTES_PER_PARAM``).
        """
        if precision in ("bf16-mixed", "fp16-mixed"):
            return {"weights": 2, "grads": 4, "optimizer": 12}
        if precision == "fp32":
            return {"weights": 4, "grads": 4, "optimizer": 8}
        raise ValueError(f"unknown precision {precision!r}; use one of {PRECISIONS}")

    # ---- io ----------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Every field, except the numeric details (qkv_bias ... norm_eps) left at their defaults, so
        plans, profiles and checkpoints written before those fields existed read back equal."""
        d = asdict(self)
        d["rope_scaling"] = dict(self.rope_scaling)
        for f in fields(ModelSpec):
            if f.name in _DETAILS and d[f.name] == (f.default if f.name != "rope_scaling" else {}):
                del d[f.name]
        return d

    @staticmethod
    def from_dict(data: dict[str, Any], *, where: str = "model") -> ModelSpec:
        if not isinstance(data, dict):
            raise SpecError(f"{where}: expected an object with the model's fields. Fix: give a JSON object.")
        known = {f.name for f in fields(ModelSpec)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise field_error(where, unknown[0], "is not a known model field", f"use only {', '.join(sorted(known))}")
        try:
            return ModelSpec(**data)
        except TypeError as err:
            raise SpecError(f"{where}: incomplete model description ({err}). Fix: give all of "
                            f"{', '.join(sorted(known))}.") from None


def _llama(name: str, layers: int, h: int, heads: int, kv: int, ffn: int, vocab: int, seq: int,
           tied: bool = False) -> ModelSpec:
    return ModelSpec(name=name, num_layers=layers, hidden_size=h, num_heads=heads, num_kv_heads=kv,
                     ffn_hidden_size=ffn, vocab_size=vocab, max_seq_len=seq, tied_embeddings=tied)


def _gpt(name: str, layers: int, h: int, heads: int, ffn: int, vocab: int, seq: int, act: str) -> ModelSpec:
    return ModelSpec(name=name, num_layers=layers, hidden_size=h, num_heads=heads, num_kv_heads=heads,
                     ffn_hidden_size=ffn, vocab_size=vocab, max_seq_len=seq, arch="gpt", activation=act,
                     tied_embeddings=True)


PRESETS: dict[str, ModelSpec] = {m.name: m for m in (
    _llama("llama-2-7b", 32, 4096, 32, 32, 11008, 32000, 4096),
    _llama("llama-2-13b", 40, 5120, 40, 40, 13824, 32000, 4096),
    _llama("llama-2-70b", 80, 8192, 64, 8, 28672, 32000, 4096),
    _llama("llama-3-8b", 32, 4096, 32, 8, 14336, 128256, 8192),
    _llama("llama-3-70b", 80, 8192, 64, 8, 28672, 128256, 8192),
    # Llama 3.1 8B: Llama 3 8B's layers at 131,072 positions (its config.json: rope_theta 500000,
    # rope_scaling llama3, factor 8 from 8,192), the long-context preset (context parallelism).
    replace(_llama("llama-3.1-8b", 32, 4096, 32, 8, 14336, 128256, 131072), rope_theta=500000.0,
            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                          "original_max_position_embeddings": 8192}),
    # HETHUB trains a Llama-style ~140B model without publishing its shape. Ours: Llama-2-70B's
    # recipe widened to hidden 12288 (96 heads of 128, 8 KV heads), FFN 32768, 90 layers:
    # 139.0e9 parameters.
    _llama("llama-140b", 90, 12288, 96, 8, 32768, 32000, 4096),
    # OPT-350M's embeddings are 512-wide with in/out projections; we model them at the hidden
    # size (the projections are 1M parameters, well inside the profiles' noise).
    _gpt("opt-350m", 24, 1024, 16, 4096, 50272, 2048, "relu"),
    _gpt("gpt-neo-2.7b", 32, 2560, 20, 10240, 50257, 2048, "gelu"),
    _gpt("opt-30b", 48, 7168, 56, 28672, 50272, 2048, "relu"),
    # Small models for tests and the local CPU demo (byte-level vocabulary).
    _llama("tiny", 6, 64, 4, 2, 128, 256, 64),
    _llama("small", 8, 128, 4, 2, 344, 256, 128),
)}


def _hf_int(cfg: dict[str, Any], key: str, *, name: str, default: int | None = None) -> int:
    """A positive integer field of a Hugging Face config, named by its config.json key on error."""
    # Hugging Face writes null for "use the default" (e.g. GPT-Neo's intermediate_size).
    value = cfg.get(key) if cfg.get(key) is not None else default
    if value is None:
        raise field_error(f"{name}: config.json", key, "is missing", f"add \"{key}\": <positive integer>")
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise field_error(f"{name}: config.json", key, f"must be a positive integer, got {value!r}",
                          "use the model's original config.json")
    return value


def _from_hf(cfg: dict[str, Any], *, name: str) -> ModelSpec:
    mt = cfg.get("model_type", "llama")

    def i(key: str, default: int | None = None) -> int:
        return _hf_int(cfg, key, name=name, default=default)

    if mt in ("llama", "mistral", "qwen2", "qwen3", "gemma"):
        heads = i("num_attention_heads")
        tied = cfg.get("tie_word_embeddings", False)
        if not isinstance(tied, bool):
            raise field_error(f"{name}: config.json", "tie_word_embeddings", f"must be true or false, got {tied!r}",
                              "use the model's original config.json")
        base = _llama(name, i("num_hidden_layers"), i("hidden_size"), heads, i("num_key_value_heads", heads),
                      i("intermediate_size"), i("vocab_size"), i("max_position_embeddings", 4096), tied)
        theta, scaling = hf_rope(cfg, name=name)
        eps = cfg.get("rms_norm_eps", 1e-6)
        if isinstance(eps, bool) or not isinstance(eps, int | float) or eps <= 0:
            raise field_error(f"{name}: config.json", "rms_norm_eps", f"must be a positive number, got {eps!r}",
                              "use the model's original config.json")
        return replace(base, qkv_bias=mt == "qwen2", rope_theta=float(theta), rope_scaling=scaling,
                       norm_eps=float(eps))
    if mt == "opt":
        act = "relu" if cfg.get("activation_function", "relu") == "relu" else "gelu"
        return _gpt(name, i("num_hidden_layers"), i("hidden_size"), i("num_attention_heads"), i("ffn_dim"),
                    i("vocab_size"), i("max_position_embeddings"), act)
    if mt == "gpt_neo":
        h = i("hidden_size")
        return _gpt(name, i("num_layers"), h, i("num_heads"),
                    i("intermediate_size", 4 * h), i("vocab_size"), i("max_position_embeddings"), "gelu")
    if mt == "gpt2":
        h = i("n_embd")
        return _gpt(name, i("n_layer"), h, i("n_head"), i("n_inner", 4 * h),
                    i("vocab_size"), i("n_positions"), "gelu")
    raise SpecError(f"{name}: config.json field 'model_type' is {mt!r}, which hethub does not know. Fix: use a "
                    "llama/mistral/qwen2/opt/gpt_neo/gpt2 config, or a preset.")


def hf_rope(cfg: dict[str, Any], *, name: str) -> tuple[float, tuple[tuple[str, Any], ...]]:
    """(rope_theta, scaling pairs) from a config.json in either layout: ``rope_parameters`` (Transformers
    5) or ``rope_theta`` + ``rope_scaling`` (earlier). The 'default' type means no scaling."""
    where = f"{name}: config.json"
    params = cfg.get("rope_parameters")
    if params is not None and not isinstance(params, dict):
        raise field_error(where, "rope_parameters", f"must be an object, got {params!r}",
                          "use the model's original config.json")
    scaling = dict(params or cfg.get("rope_scaling") or {})
    theta = scaling.pop("rope_theta", None) or cfg.get("rope_theta", 10000.0)
    if isinstance(theta, bool) or not isinstance(theta, int | float) or theta <= 0:
        raise field_error(where, "rope_theta", f"must be a positive number, got {theta!r}",
                          "use the model's original config.json")
    kind = scaling.pop("rope_type", None) or scaling.pop("type", None) or "default"
    scaling.pop("type", None)
    if kind == "default":
        return float(theta), ()
    return float(theta), tuple(sorted({**scaling, "rope_type": kind}.items()))


def get_model(name_or_path: str) -> ModelSpec:
    """A preset by name, or a Hugging Face ``config.json`` by path."""
    if name_or_path in PRESETS:
        return PRESETS[name_or_path]
    p = Path(name_or_path)
    if p.suffix == ".json" or p.is_file():
        cfg = load_json(p, missing=f"model config '{p}' does not exist. Fix: pass a preset name "
                                   f"({', '.join(PRESETS)}) or the path of a Hugging Face config.json.",
                        invalid_fix="pass a Hugging Face config.json")
        if not isinstance(cfg, dict):
            raise SpecError(f"{p}: expected a JSON object. Fix: pass a Hugging Face config.json.")
        return _from_hf(cfg, name=p.parent.name or p.stem)
    raise SpecError(f"unknown model {name_or_path!r}. Fix: use a preset ({', '.join(PRESETS)}) or the path "
                    "of a Hugging Face config.json.")
