"""Bytes autograd keeps for backward, per token, in hethub's decoder layers (one TP shard).

Follows the per-layer count of Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
Transformer Models" (arXiv:2205.05198, Sec. 4.1): a Megatron GPT layer with 16-bit activations keeps
``s*b*h*(34 + 5*a*s/h)`` bytes, i.e. 11 sbh + 5 a s^2 b for attention (QKV input, Q and K, softmax
output, its dropout mask and output, V, the projection input and its dropout mask), 19 sbh for the MLP
(input, the 4h GeLU input and output, dropout mask) and 4 sbh for the two LayerNorm inputs. Adapted
tensor by tensor to what hethub's runtime (``hethub.runtime.model``) saves, and checked against it
(``bench/memory_accuracy.py``, ``tests/unit/test_profiler.py``: saved-tensor hooks), in its two
recipes:

* mixed precision (bf16/fp16): the residual stream is in the compute dtype, so every tensor a layer
  keeps is 16-bit except per-token statistics; norms keep what a fused kernel keeps (``runtime/norms.py``):
  their input and fp32 statistics (the output is the projections' input, kept once for all of them);
  attention takes K and V at their own ``kv_heads`` width (SDPA's native GQA); RoPE tables are in the
  compute dtype, so rotary widens nothing and keeps nothing per token;
* fp32: as before, bit for bit: RMSNorm written out (``x * rsqrt(mean(x^2)) * w``) also keeps the
  normalised x, and K and V are repeated to every query head before SDPA, so the kernel keeps them at
  full width.

Further, in both:

* no dropout anywhere: the 2 masks of sbh/2 and the a s^2 b mask and its output are gone;
* attention through ``scaled_dot_product_attention``: with a memory-efficient ("flash") kernel it keeps
  Q, K, V, its output (the projection's input, the same storage) and the fp32 log-sum-exp (a/t per
  token): no s x s scores. The "math" kernel computes in fp32 whatever its inputs (torch's documented
  behaviour for 16-bit inputs) and keeps the scaled Q, K and V at full head count, the s x s softmax
  output (``micro-batch x heads x seq x seq``), all fp32, and the projection's input in the compute dtype;
* Llama's gated MLP keeps the two input projections, SiLU's output and the product (4 f/t); a GeLU/ReLU
  MLP keeps the projection and the activation output (2 f/t);
* LayerNorm keeps its input and output, plus mean and rstd.

With tensor parallelism (no sequence parallelism) the norms are replicated and everything between the
column- and row-parallel projections is split by t. Under sequence parallelism (``sp``) each TP rank
keeps the norms' inputs and statistics for its 1/t of the tokens; the all-gathered norm output, which
the projections keep as their input, stays whole (Megatron keeps the slice and all-gathers it again
in backward, which hethub's runtime does not). With context parallelism (``cp``) every count is per
token of the rank's own share of the sequence (the caller's tokens are s/cp per sequence), and the
attention core is the ring's (``runtime/context_parallel.py``): Q, K and V at their own head count,
the output and the fp32 log-sum-exp, whatever the kernel (its blocks' scores are recomputed). Full
recomputation keeps only each layer's input. Selective recomputation (the paper's Sec. 5) checkpoints
the attention core (in hethub's runtime: rotary, GQA's repeat where there is one, scores, softmax,
attention over V): the layer keeps the projections' Q, K and V (K and V at their own ``kv_heads``
width) and the output, and drops what the kernel saves (the log-sum-exp, or math's scores and fp32
copies), i.e. the paper's 5 a s^2 b.
"""

from __future__ import annotations

from hethub.plan import Recompute
from hethub.spec.model import ModelSpec

STAT_BYTES = 4  # per-token norm statistics and the attention log-sum-exp are fp32
MATH_BYTES = 4  # SDPA's math kernel computes (and keeps its tensors) in fp32 for any input
INDEX_BYTES = 8  # token ids and targets are int64
MIXED = ("bf16-mixed", "fp16-mixed")


def compute_bytes(precision: str) -> int:
    """Width of the tensors the layer keeps: the compute dtype (bf16/fp16 under autocast, else fp32),
    which is also the residual stream's (``runtime/model.StageModel``)."""
    return 2 if precision in MIXED else 4


def norm_bytes_per_token(model: ModelSpec, *, precision: str, tp: int = 1, sp: bool = False) -> float:
    """One norm: its input, its output (kept by the projections it feeds) and its statistics; the fp32
    recipe's written-out RMSNorm also keeps the normalised x. ``sp``: all but the (gathered) output
    for 1/tp of the tokens."""
    h, cb = model.hidden_size, compute_bytes(precision)
    if model.arch == "llama":
        normalised = h * cb if precision not in MIXED else 0
        own = h * cb + normalised + STAT_BYTES
    else:
        own = h * cb + 2 * STAT_BYTES
    return (own / tp if sp else own) + h * cb


def kv_width(model: ModelSpec, *, precision: str) -> int:
    """Width of K and V as SDPA receives them: their own (native GQA, mixed precision) or repeated to
    every query head (fp32)."""
    return model.kv_dim if precision in MIXED else model.hidden_size


def attention_bytes_per_token(model: ModelSpec, *, tp: int, seq_len: int, attention: str, precision: str,
                              selective: bool = False, cp: int = 1) -> float:
    """Q, K, V and the output, plus the log-sum-exp (flash) or the scores (math: Q, K and V in fp32 at
    full width too). ``selective``: the core is recomputed, so only the projections' Q, K, V (at their
    own width) and the output are kept. ``cp`` > 1: the ring's, K and V at their own width and the
    log-sum-exp for any kernel."""
    cb, h, heads = compute_bytes(precision), model.hidden_size, model.num_heads / tp
    if selective:
        return (2 * h + 2 * model.kv_dim) / tp * cb
    if cp > 1:
        return (2 * h + 2 * model.kv_dim) / tp * cb + heads * STAT_BYTES
    if attention == "math":
        return 3 * h / tp * MATH_BYTES + h / tp * cb + scores_bytes_per_token(model, tp=tp, seq_len=seq_len)
    if attention == "fused":
        # Megatron's FusedScaleMaskSoftmax keeps its 16-bit output for backward; the score and value
        # GEMMs keep Q, K, V (K and V at their own width) and the output projection its input. An
        # estimate of a runtime hethub does not run (no dropout, as hethub's recipes).
        w = kv_width(model, precision=precision)
        return (2 * h + 2 * w) / tp * cb + heads * seq_len * cb
    return (2 * h + 2 * kv_width(model, precision=precision)) / tp * cb + heads * STAT_BYTES


def scores_bytes_per_token(model: ModelSpec, *, tp: int, seq_len: int) -> float:
    """The softmax output math attention keeps, fp32: ``heads/t x seq`` per token (micro-batch x heads x
    s x s in all)."""
    return model.num_heads / tp * seq_len * MATH_BYTES


def mlp_bytes_per_token(model: ModelSpec, *, tp: int, precision: str) -> float:
    return (4 if model.gated else 2) * model.ffn_hidden_size / tp * compute_bytes(precision)


def layer_bytes_per_token(model: ModelSpec, *, tp: int, seq_len: int, attention: str, precision: str,
                          recompute: Recompute | str | bool, sp: bool = False, cp: int = 1) -> float:
    """What one decoder layer keeps per token between its forward and backward (``recompute``: a
    :class:`~hethub.plan.Recompute` mode; a bool means full or none). ``sp``: sequence parallelism;
    ``cp``: the context-parallel degree (per token of the rank's share)."""
    mode = Recompute.of(recompute)
    if mode is Recompute.FULL:  # the checkpointed layer's input: this rank's slice under sequence parallelism
        return model.hidden_size * compute_bytes(precision) / (tp if sp else 1)
    return (2 * norm_bytes_per_token(model, precision=precision, tp=tp, sp=sp)
            + attention_bytes_per_token(model, tp=tp, seq_len=seq_len, attention=attention, precision=precision,
                                        selective=mode is Recompute.SELECTIVE, cp=cp)
            + mlp_bytes_per_token(model, tp=tp, precision=precision))


def embedding_bytes_per_token(model: ModelSpec, *, vocab_tp: int = 1) -> float:
    """The token ids (the lookup's backward needs nothing else); a vocabulary-parallel lookup also
    keeps the mask of ids outside its rows (one byte each)."""
    return float(INDEX_BYTES + (vocab_tp > 1))


def head_bytes_per_token(model: ModelSpec, *, vocab_tp: int, precision: str, tp: int = 1, sp: bool = False) -> float:
    """Final norm, the fp32 log-softmax of the logits (the loss upcasts them; a vocabulary-parallel
    loss keeps its local softmax, V/t, and the mask of targets outside its rows), and the targets."""
    return (norm_bytes_per_token(model, precision=precision, tp=tp, sp=sp) + 4 * model.vocab_size / vocab_tp
            + INDEX_BYTES + (vocab_tp > 1))


def head_bytes_per_micro_batch(*, vocab_tp: int) -> float:
    """What the head keeps per micro-batch beyond its tokens: torch's cross-entropy keeps its fp32
    total weight (the vocabulary-parallel loss keeps nothing more)."""
    return 4.0 if vocab_tp == 1 else 0.0


def head_transient_bytes_per_token(model: ModelSpec, *, vocab_tp: int, precision: str) -> float:
    """Logits in flight while one micro-batch's loss runs, beyond what is kept: the logits and their fp32
    upcast in forward (the upcast is a copy only under bf16), then the fp32 gradients of the
    log-softmax output and of the logits in backward. The larger of the two moments: backward's two
    fp32 V/t tensors (+ the compute-width gradient under bf16)."""
    v, cb = model.vocab_size / vocab_tp, compute_bytes(precision)
    return 2 * 4 * v + (cb * v if cb != 4 else 0.0)
