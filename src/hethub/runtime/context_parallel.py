"""Context parallelism: a stage's CP ranks split every sequence, attention runs as a ring.

CP rank c of cp holds the sequence positions ``layout.seq_positions`` gives it: the sequence cut into
2cp chunks, rank c taking chunks c and 2cp-1-c (the "zigzag" of Llama 3 and ring-flash-attention), so
that under the causal mask every rank does the same attention work. Everything outside attention is
per token and runs on the rank's own positions unchanged; attention passes K/V blocks around the CP
ring (Liu et al. 2023, "Ring Attention"): in step i a rank attends its queries to the block of rank
c - i while it sends the block it holds on and receives the next, and merges the partial outputs by
their log-sum-exp. With the zigzag layout each step is one of three cases: its own block under the
causal mask; an earlier rank's block, whose first chunk all its queries see and whose second none;
a later rank's block, all of which its second chunk sees and its first none. Backward re-runs the
ring, the K/V blocks travelling with their gradient accumulators, which end back at their owner.

Saved for backward per rank: its Q, K, V (K and V at their own head count), the output and the fp32
log-sum-exp, all for its own tokens; nothing of the other ranks' blocks. So a layer's activations
per rank are its tokens' share: divided by the CP degree (``predict/memory/activations.py``).

The blocks run through the flash kernel's forward and backward with log-sum-exp (``_BLOCK``: torch's
CPU flash kernel here; on CUDA its flash kernel, which needs 16-bit inputs), or a written-out
kernel for "math" stages and fp32 on CUDA; both keep no s x s scores past the block.

Ring messages go through the Communicator as point-to-point pairs, posted in an order that is safe
where a pair of ranks runs its messages in issue order (NCCL): even CP ranks send then receive,
odd ranks receive then send, so with two ranks (both neighbours the same) each send meets its receive.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from hethub.comm.communicator import Communicator

# Ring tags, far above the pipeline's (2 x micro-batch x chunks + 1): each CP message of a step is
# one of these, and a pair of CP ranks exchanges nothing else.
_TAG = 1 << 24


@dataclass(frozen=True)
class CPContext:
    """This rank's place in its stage's context parallelism; ``comm`` is None only when ``size == 1``."""

    size: int = 1
    rank: int = 0
    ring: tuple[int, ...] = ()  # the CP group's ranks in CP rank order
    comm: Communicator | None = None

    @property
    def next(self) -> int:
        return self.ring[(self.rank + 1) % self.size]

    @property
    def prev(self) -> int:
        return self.ring[(self.rank - 1) % self.size]


def _exchange(t: torch.Tensor, cp: CPContext, tag: int) -> tuple[Any, Any, torch.Tensor]:
    """Post sending ``t`` to the next CP rank and receiving the previous rank's into a new buffer."""
    buf = torch.empty_like(t)
    comm = cp.comm
    assert comm is not None
    t = t.contiguous()
    if cp.rank % 2 == 0:
        send = comm.isend(t, dst=cp.next, tag=tag)
        recv = comm.irecv(buf, src=cp.prev, tag=tag)
    else:
        recv = comm.irecv(buf, src=cp.prev, tag=tag)
        send = comm.isend(t, dst=cp.next, tag=tag)
    return send, recv, buf


def _wait(posted: tuple[Any, Any, torch.Tensor]) -> torch.Tensor:
    send, recv, buf = posted
    recv.wait()
    send.wait()
    return buf


# ---- one block: attention of some queries to one K/V block, with its log-sum-exp ------------------
def _repeat(t: torch.Tensor, rep: int) -> torch.Tensor:
    return t if rep == 1 else t.repeat_interleave(rep, dim=1)


def _fold(t: torch.Tensor, rep: int) -> torch.Tensor:
    """A gradient of K or V repeated to every query head, summed back over each group."""
    if rep == 1:
        return t
    b, h, s, d = t.shape
    return t.view(b, h // rep, rep, s, d).sum(dim=2)


def _block_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, kernel: str,
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """(output in q's dtype, fp32 log-sum-exp [b, heads, sq]) of softmax(q k^T / sqrt(d)) v."""
    rep = q.shape[1] // k.shape[1]
    k, v = _repeat(k, rep), _repeat(v, rep)
    if kernel == "flash" and q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal)
        return out, lse.float()
    if kernel == "flash" and q.device.type == "cuda" and q.dtype in (torch.float16, torch.bfloat16):
        res = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal)
        return res[0], res[1].float()
    scores = (q.float() @ k.float().transpose(-1, -2)) / math.sqrt(q.shape[-1])
    if causal:
        sq, sk = scores.shape[-2:]
        scores = scores.masked_fill(torch.ones(sq, sk, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    lse = scores.logsumexp(dim=-1)
    out = (scores - lse.unsqueeze(-1)).exp() @ v.float()
    return out.to(q.dtype), lse


def _block_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
               lse: torch.Tensor, *, causal: bool, kernel: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv (K and V at their own head count) of one block, given the whole attention's output
    and log-sum-exp (the softmax of the block is exp(scores - lse): its share of the whole)."""
    rep = q.shape[1] // k.shape[1]
    kr, vr = _repeat(k, rep), _repeat(v, rep)
    if kernel == "flash" and q.device.type == "cpu":
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, kr, vr, out, lse.to(torch.float32), 0.0, causal)
        return dq, _fold(dk, rep), _fold(dv, rep)
    if kernel == "flash" and q.device.type == "cuda" and q.dtype in (torch.float16, torch.bfloat16):
        # Dense inputs without dropout: no cumulative lengths and no RNG state, as SDPA's own backward
        # passes them. Not run in this repository's tests (no GPU): the CPU kernel above is.
        empty = torch.empty(0, device=q.device)
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            dout, q, kr, vr, out, lse, empty, empty, q.shape[2], k.shape[2], 0.0, causal, empty, empty)
        return dq, _fold(dk, rep), _fold(dv, rep)
    scale = 1.0 / math.sqrt(q.shape[-1])
    qf, kf, vf, df = q.float(), kr.float(), vr.float(), dout.float()
    scores = (qf @ kf.transpose(-1, -2)) * scale
    if causal:
        sq, sk = scores.shape[-2:]
        scores = scores.masked_fill(torch.ones(sq, sk, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    p = (scores - lse.unsqueeze(-1)).exp()
    dv = p.transpose(-1, -2) @ df
    dp = df @ vf.transpose(-1, -2)
    delta = (df * out.float()).sum(dim=-1, keepdim=True)
    ds = p * (dp - delta) * scale
    dq, dk = ds @ kf, ds.transpose(-1, -2) @ qf
    return dq.to(q.dtype), _fold(dk, rep).to(k.dtype), _fold(dv, rep).to(v.dtype)


def _merge(acc: torch.Tensor, acc_lse: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> None:
    """acc, acc_lse <- the softmax-weighted union of two partial attentions (in place, fp32)."""
    new = torch.logaddexp(acc_lse, lse)
    acc.mul_((acc_lse - new).exp().unsqueeze(-1)).add_(out.float() * (lse - new).exp().unsqueeze(-1))
    acc_lse.copy_(new)


def _plan(step: int, cp: CPContext, half: int) -> tuple[slice, slice, bool]:
    """Step ``step``'s (query rows, key columns, causal) for the block of CP rank c - step (zigzag)."""
    src = (cp.rank - step) % cp.size
    if step == 0:
        return slice(None), slice(None), True
    if src < cp.rank:  # the earlier rank's first chunk is before both of ours; its second after both
        return slice(None), slice(0, half), False
    return slice(half, None), slice(None), False  # a later rank: only our second chunk sees it, all of it


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp: CPContext,  # type: ignore[override]
                kernel: str) -> torch.Tensor:
        half = q.shape[2] // 2
        acc = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        acc_lse = torch.full(q.shape[:3], float("-inf"), dtype=torch.float32, device=q.device)
        kv = torch.stack([k, v])
        for step in range(cp.size):
            posted = _exchange(kv, cp, _TAG + step) if step + 1 < cp.size else None
            rows, cols, causal = _plan(step, cp, half)
            o, lse = _block_fwd(q[:, :, rows], kv[0][:, :, cols], kv[1][:, :, cols], causal=causal, kernel=kernel)
            _merge(acc[:, :, rows], acc_lse[:, :, rows], o, lse)
            if posted is not None:
                kv = _wait(posted)
        # The output in q's memory layout ([b, s, heads, d] underneath, as SDPA's): the projection's
        # reshape of it is then a view, and it is saved once.
        out = torch.empty_like(q)
        out.copy_(acc)
        ctx.save_for_backward(q, k, v, out, acc_lse)
        ctx.cp, ctx.kernel = cp, kernel
        return out

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None, None]:
        q, k, v, out, lse = ctx.saved_tensors
        cp, kernel = ctx.cp, ctx.kernel
        half = q.shape[2] // 2
        dout = dout.contiguous() if kernel != "flash" else dout
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        kv = torch.stack([k, v])
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)  # the held block's gradients
        for step in range(cp.size):
            posted = _exchange(kv, cp, _TAG + 2 * step) if step + 1 < cp.size else None
            rows, cols, causal = _plan(step, cp, half)
            gq, gk, gv = _block_bwd(dout[:, :, rows], q[:, :, rows], kv[0][:, :, cols], kv[1][:, :, cols],
                                    out[:, :, rows], lse[:, :, rows], causal=causal, kernel=kernel)
            dq[:, :, rows] += gq.float()
            dkv[0][:, :, cols] += gk.float()
            dkv[1][:, :, cols] += gv.float()
            if posted is not None:
                kv = _wait(posted)
            # The block moves on to the next rank (which handles it next step) with its gradients;
            # after the last step they reach the block's owner.
            dkv = _wait(_exchange(dkv, cp, _TAG + 2 * step + 1))
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp: CPContext, *,
                   kernel: str = "flash") -> torch.Tensor:
    """Causal attention of this CP rank's queries ([b, heads, s/cp, d], its zigzag positions in order)
    to every rank's keys and values ([b, kv_heads, s/cp, d]), each K/V head serving its group of query
    heads. ``kernel``: "flash" or "math" (the plan's attention for the stage's kind)."""
    if cp.size == 1:
        rep = q.shape[1] // k.shape[1]
        return F.scaled_dot_product_attention(q, _repeat(k, rep), _repeat(v, rep), is_causal=True)
    return _RingAttention.apply(q, k, v, cp, kernel)
