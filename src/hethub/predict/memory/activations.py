"""Bytes autograd keeps for backward, per token, in hethub's decoder layers (one TP shard).

Follows the per-layer count of Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
Transformer Models" (arXiv:2205.05198, Sec. 4.1): a Megatron GPT layer with 16-bit activations keeps
``s*b*h*(34 + 5*a*s/h)`` bytes, i.e. 11 sbh + 5 a s^2 b for attention (QKV input, Q and K, softmax
output, its dropout mask and output, V, the projection input and its dropout mask), 19 sbh for the MLP
(input, the 4h GeLU input and output, dropout mask) and 4 sbh for the two LayerNorm inputs. Adapted
tensor by tensor to what hethub's runtime (``hethub.runtime.model``) saves, and checked against it
(``bench/memory_accuracy.py``, saved-tensor hooks):

* no dropout anywhere: the 2 masks of sbh/2 and the a s^2 b mask and its output are gone;
* attention through ``scaled_dot_product_attention``: with a memory-efficient ("flash") kernel it keeps
  Q, K, V, its output (h/t each; GQA's K and V are repeated to all heads before the call, so they are
  full size) and the fp32 log-sum-exp (a/t per token): no s x s scores. The "math" kernel keeps the
  scaled Q and K, V, the softmax output (``micro-batch x heads x seq x seq``) and a copy of the output
  for the projection: the scores replace the log-sum-exp;
* Llama's gated MLP keeps the two input projections, SiLU's output and the product (4 f/t); a GeLU/ReLU
  MLP keeps the projection and the activation output (2 f/t);
* RMSNorm as the runtime writes it (``x * rsqrt(mean(x^2)) * w``) keeps x, the normalised x and the
  output (the projections' input); LayerNorm keeps its input and output; both keep per-token stats;
* RoPE multiplies by constant tables, which saves nothing per token;
* under bf16-mixed (autocast) the residual stream and the norms stay fp32 while every projection saves
  a bf16 copy of its input, so tensors come in two widths: residual (always 4 bytes) and compute
  (2 bytes in bf16-mixed, 4 in fp32).

With tensor parallelism (no sequence parallelism) the norms are replicated and everything between the
column- and row-parallel projections is split by t. Full recomputation keeps only each layer's input.
Selective recomputation (the paper's Sec. 5) checkpoints the attention core (in hethub's runtime:
rotary, GQA's repeat, scores, softmax, attention over V): the layer keeps the projections' Q, K and V
(K and V at their own ``kv_heads`` width: the repeat is re-run) and the output, and drops what the
kernel saves (the log-sum-exp, or math's scores and scaled Q), i.e. the paper's 5 a s^2 b.
"""

from __future__ import annotations

from hethub.plan import Recompute
from hethub.spec.model import ModelSpec

RESIDUAL_BYTES = 4  # hethub's runtime keeps fp32 parameters, so the residual stream is fp32 under autocast
STAT_BYTES = 4  # per-token norm statistics and the attention log-sum-exp are fp32
INDEX_BYTES = 8  # token ids and targets are int64


def compute_bytes(precision: str) -> int:
    """Width of the tensors the projections and attention keep: bf16 under autocast, else fp32."""
    return 2 if precision in ("bf16-mixed", "fp16-mixed") else 4


def norm_bytes_per_token(model: ModelSpec, *, precision: str) -> float:
    """One norm: RMSNorm keeps x and x*rsqrt (fp32) and the projections keep its output (compute width);
    LayerNorm keeps x and its output, plus mean and rstd."""
    h, cb = model.hidden_size, compute_bytes(precision)
    if model.arch == "llama":
        return 2 * h * RESIDUAL_BYTES + h * cb + STAT_BYTES
    return h * RESIDUAL_BYTES + h * cb + 2 * STAT_BYTES


def attention_bytes_per_token(model: ModelSpec, *, tp: int, seq_len: int, attention: str, precision: str,
                              selective: bool = False) -> float:
    """Q, K, V and the output (h/t each), plus the log-sum-exp (flash) or the s x s scores (math).
    ``selective``: the core is recomputed, so only the projections' Q, K, V (K and V before GQA's repeat)
    and the output are kept."""
    cb, heads = compute_bytes(precision), model.num_heads / tp
    if selective:
        return (2 * model.hidden_size + 2 * model.kv_dim) / tp * cb
    qkvo = 4 * model.hidden_size / tp * cb
    if attention == "math":
        return qkvo + heads * seq_len * cb
    return qkvo + heads * STAT_BYTES


def scores_bytes_per_token(model: ModelSpec, *, tp: int, seq_len: int, precision: str) -> float:
    """The softmax output math attention keeps: ``heads/t x seq`` per token (micro-batch x heads x s x s in all)."""
    return model.num_heads / tp * seq_len * compute_bytes(precision)


def mlp_bytes_per_token(model: ModelSpec, *, tp: int, precision: str) -> float:
    return (4 if model.gated else 2) * model.ffn_hidden_size / tp * compute_bytes(precision)


def layer_bytes_per_token(model: ModelSpec, *, tp: int, seq_len: int, attention: str, precision: str,
                          recompute: Recompute | str | bool) -> float:
    """What one decoder layer keeps per token between its forward and backward (``recompute``: a
    :class:`~hethub.plan.Recompute` mode; a bool means full or none)."""
    mode = Recompute.of(recompute)
    if mode is Recompute.FULL:
        return float(model.hidden_size * RESIDUAL_BYTES)  # the checkpointed layer's input
    return (2 * norm_bytes_per_token(model, precision=precision)
            + attention_bytes_per_token(model, tp=tp, seq_len=seq_len, attention=attention, precision=precision,
                                        selective=mode is Recompute.SELECTIVE)
            + mlp_bytes_per_token(model, tp=tp, precision=precision))


def embedding_bytes_per_token(model: ModelSpec) -> float:
    """The token ids (the lookup's backward needs nothing else)."""
    return float(INDEX_BYTES)


def head_bytes_per_token(model: ModelSpec, *, vocab_tp: int, precision: str) -> float:
    """Final norm, the fp32 log-softmax of the logits (the loss upcasts them; a vocabulary-parallel
    loss keeps its local softmax, V/t), and the targets."""
    return norm_bytes_per_token(model, precision=precision) + 4 * model.vocab_size / vocab_tp + INDEX_BYTES


def head_transient_bytes_per_token(model: ModelSpec, *, vocab_tp: int, precision: str) -> float:
    """Logits in flight while one micro-batch's loss runs, beyond what is kept: the logits and their fp32
    upcast in forward (the upcast is a copy only under bf16), then the fp32 gradients of the
    log-softmax output and of the logits in backward. The larger of the two moments: backward's two
    fp32 V/t tensors (+ the compute-width gradient under bf16)."""
    v, cb = model.vocab_size / vocab_tp, compute_bytes(precision)
    return 2 * 4 * v + (cb * v if cb != 4 else 0.0)
