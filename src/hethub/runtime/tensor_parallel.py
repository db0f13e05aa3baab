"""Megatron-style tensor parallelism with an explicit group and communicator.

Why not DTensor / ``torch.distributed.tensor.parallel``: its collectives go straight to c10d on a
DeviceMesh, bypassing our Communicator (which must later route across device kinds through a
bridge), and the mixed-TP gradient sync needs plain local shards anyway. The whole of TP here is
two autograd functions: ``copy_to_tp`` (identity forward, all-reduce of the gradient backward) in
front of column-parallel linears and ``reduce_from_tp`` (all-reduce forward, identity backward)
after row-parallel ones. Inputs and outputs of every block are replicated across the TP group.

Embedding and head are split by vocabulary (rank r holds rows [r·V/t, (r+1)·V/t)): the lookup masks
ids outside the rank's rows and sums over the group; the head is column-parallel and its loss is a
vocabulary-parallel cross-entropy, so no rank ever materialises the full logits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from hethub.comm.communicator import Communicator


@dataclass(frozen=True)
class TPContext:
    """This rank's TP position; ``comm`` is None only when ``size == 1``."""

    size: int = 1
    rank: int = 0
    group: tuple[int, ...] = ()
    comm: Communicator | None = None


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, tp: TPContext) -> torch.Tensor:
        ctx.tp = tp
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        tp: TPContext = ctx.tp
        g = grad.contiguous().clone()
        tp.comm.all_reduce(g, group=tp.group)  # type: ignore[union-attr]
        return g, None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, tp: TPContext) -> torch.Tensor:
        y = x.contiguous().clone()
        tp.comm.all_reduce(y, group=tp.group)  # type: ignore[union-attr]
        return y

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def copy_to_tp(x: torch.Tensor, tp: TPContext) -> torch.Tensor:
    return x if tp.size == 1 else _CopyToTP.apply(x, tp)


def reduce_from_tp(x: torch.Tensor, tp: TPContext) -> torch.Tensor:
    return x if tp.size == 1 else _ReduceFromTP.apply(x, tp)


def shard(full: torch.Tensor, *, dim: int | None, tp: TPContext) -> torch.Tensor:
    """This rank's slice of ``full`` along ``dim`` (None: replicated)."""
    if dim is None or tp.size == 1:
        return full
    return full.chunk(tp.size, dim=dim)[tp.rank].contiguous()


def vocab_parallel(vocab_size: int, tp: int) -> bool:
    """Whether a stage of TP degree ``tp`` splits embedding and head by vocabulary. An indivisible
    vocabulary falls back to replication on that stage: plans may use any vocabulary, and padding it
    (Megatron's way) would change the parameters' shapes, which checkpoints and one-device parity need."""
    return tp > 1 and vocab_size % tp == 0


def vocab_parallel_embedding(ids: torch.Tensor, weight: torch.Tensor, tp: TPContext) -> torch.Tensor:
    """Lookup in this rank's rows of the table, zeros for other ranks' ids, summed over the group.
    Backward is identity (``reduce_from_tp``): the incoming gradient is already the full one on every
    rank, and the masked rows route each token's gradient to the one rank that holds its row."""
    rows = weight.shape[0]
    local = ids - tp.rank * rows
    outside = (local < 0) | (local >= rows)
    emb = torch.nn.functional.embedding(local.masked_fill(outside, 0), weight)
    return reduce_from_tp(emb.masked_fill(outside.unsqueeze(-1), 0.0), tp)


class _VocabParallelCE(torch.autograd.Function):
    """Per-token cross-entropy of logits split by vocabulary: [N, V/t] local logits -> [N] loss,
    identical on every rank. Saves only the local softmax (what a fused loss keeps)."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, targets: torch.Tensor, tp: TPContext) -> torch.Tensor:
        comm, rows = tp.comm, logits.shape[-1]
        m = logits.detach().max(dim=-1).values
        comm.all_reduce(m, group=tp.group, op="max")  # type: ignore[union-attr]
        shifted = logits.detach() - m.unsqueeze(-1)
        local = targets - tp.rank * rows
        outside = (local < 0) | (local >= rows)
        local = local.masked_fill(outside, 0)
        target = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        exp = shifted.exp_()  # in place: one [N, V/t] buffer besides the logits, later the softmax
        # Sum of exponentials and the target's logit (from its one holder) in a single collective.
        sums = torch.stack([exp.sum(dim=-1), target])
        comm.all_reduce(sums, group=tp.group)  # type: ignore[union-attr]
        ctx.save_for_backward(exp.div_(sums[0].unsqueeze(-1)), local, outside)
        return sums[0].log() - sums[1]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        softmax, local, outside = ctx.saved_tensors
        # d loss / d logit = softmax - onehot(target); the onehot lives on the target's rank only.
        g = softmax * grad.unsqueeze(-1)
        hit = grad.masked_fill(outside, 0.0).to(g.dtype)
        g.scatter_add_(-1, local.unsqueeze(-1), -hit.unsqueeze(-1))
        return g, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, tp: TPContext) -> torch.Tensor:
    """``F.cross_entropy(full_logits, targets, reduction="none")`` from this rank's vocabulary slice
    ([..., V/t] logits, [...] targets); every rank gets the same loss, within fp32 rounding."""
    if tp.size == 1:
        return torch.nn.functional.cross_entropy(logits.flatten(0, -2), targets.flatten(),
                                                 reduction="none").view(targets.shape)
    loss = _VocabParallelCE.apply(logits.flatten(0, -2), targets.flatten(), tp)
    return loss.view(targets.shape)
