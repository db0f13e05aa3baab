"""Megatron-style tensor parallelism with an explicit group and communicator.

Why not DTensor / ``torch.distributed.tensor.parallel``: its collectives go straight to c10d on a
DeviceMesh, bypassing our Communicator (which must later route across device kinds through a
bridge), and the mixed-TP gradient sync needs plain local shards anyway. The whole of TP here is
two autograd functions: ``copy_to_tp`` (identity forward, all-reduce of the gradient backward) in
front of column-parallel linears and ``reduce_from_tp`` (all-reduce forward, identity backward)
after row-parallel ones. Inputs and outputs of every block are replicated across the TP group.

Sequence parallelism (Korthikanti et al. 2022, arXiv:2205.05198, Sec. 4.2.2; a stage's
``sequence_parallel``): between the blocks the residual stream, the norms and the dropout-free adds
are held split along the sequence over the TP group (TP rank q holds positions [q s/t, (q+1) s/t) of
the rank's sequence). ``gather_seq`` replaces ``copy_to_tp`` (all-gather forward, reduce-scatter of
the partial input gradients backward) and ``reduce_scatter_seq`` replaces ``reduce_from_tp``
(reduce-scatter forward, all-gather backward): the same bytes as the two all-reduces they replace
(an all-reduce is a reduce-scatter plus an all-gather), and every tensor between them is 1/t the
size. The parameters used on a slice (the norms' weights, row-parallel biases) get a partial
gradient on each TP rank, summed over the group in backward (``sum_grad_over_tp``).

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
    sequence_parallel: bool = False  # the stage holds its residual stream split along the sequence
    order: tuple[int, ...] = ()  # the group's ranks in TP rank order (empty: ascending, ``group``)

    def position(self) -> list[int]:
        """For each member in ascending rank order (how collectives lay out chunks), its TP rank."""
        order = self.order or self.group
        return [order.index(r) for r in sorted(order)] if order else list(range(self.size))


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


def _seq_all_gather(x: torch.Tensor, tp: TPContext) -> torch.Tensor:
    """[b, s/t, ...] slices (TP rank q's at q) -> [b, s, ...], gathered over the group."""
    parts = tp.comm.all_gather(x.contiguous(), group=tp.group, dim=1).chunk(tp.size, dim=1)  # type: ignore[union-attr]
    by_rank = dict(zip(tp.position(), parts, strict=True))
    return torch.cat([by_rank[q] for q in range(tp.size)], dim=1)


def _seq_reduce_scatter(x: torch.Tensor, tp: TPContext) -> torch.Tensor:
    """[b, s, ...] partial sums -> this rank's summed slice [b, s/t, ...]."""
    pieces = x.chunk(tp.size, dim=1)
    # The collective hands chunk i (ascending rank order) to the i-th member: lay the slices out so.
    flat = torch.cat([pieces[q].transpose(0, 1).reshape(-1) for q in tp.position()])
    out = tp.comm.reduce_scatter(flat, group=tp.group)  # type: ignore[union-attr]
    shape = pieces[tp.rank].transpose(0, 1).shape
    return out.view(shape).transpose(0, 1).contiguous()


def _seq_slice(x: torch.Tensor, tp: TPContext) -> torch.Tensor:
    return x.chunk(tp.size, dim=1)[tp.rank].contiguous()


class _GatherSeq(torch.autograd.Function):
    """All-gather of sequence slices; backward reduce-scatters (the input gradients are partial sums
    over the TP ranks' column-parallel GEMMs) or, with ``split``, takes this rank's slice of a
    gradient that every rank has whole (a replicated head)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, tp: TPContext, split: bool) -> torch.Tensor:
        ctx.tp, ctx.split = tp, split
        return _seq_all_gather(x, tp)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return (_seq_slice(grad, ctx.tp) if ctx.split else _seq_reduce_scatter(grad, ctx.tp)), None, None


class _ToSlice(torch.autograd.Function):
    """This rank's sequence slice of partial sums (``reduce``: reduce-scattered) or of a tensor every
    rank has whole (taken); backward all-gathers the slices' gradients."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, tp: TPContext, reduce: bool) -> torch.Tensor:
        ctx.tp = tp
        return _seq_reduce_scatter(x, tp) if reduce else _seq_slice(x, tp)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _seq_all_gather(grad, ctx.tp), None, None


def gather_seq(x: torch.Tensor, tp: TPContext, *, split_grad: bool = False) -> torch.Tensor:
    """Before a column-parallel block of a sequence-parallel stage: the whole sequence from every TP
    rank's slice. ``split_grad``: the gradient arrives whole on every rank (a replicated head)."""
    return _GatherSeq.apply(x, tp, split_grad)


def reduce_scatter_seq(x: torch.Tensor, tp: TPContext) -> torch.Tensor:
    """After a row-parallel block (or a vocabulary-parallel lookup): the sum, as this rank's slice."""
    return _ToSlice.apply(x, tp, True)


def scatter_seq(x: torch.Tensor, tp: TPContext) -> torch.Tensor:
    """A tensor every TP rank has whole -> this rank's sequence slice (backward all-gathers)."""
    return _ToSlice.apply(x, tp, False)


def sum_grad_over_tp(p: torch.Tensor, tp: TPContext) -> torch.Tensor:
    """``p`` as used on a sequence slice: identity forward, its gradient summed over the TP group in
    backward, so every rank's ``.grad`` is the whole gradient as without sequence parallelism (and the
    data-parallel sync, ZeRO and checkpoints see nothing new). One all-reduce of the parameter's size
    per micro-batch; Megatron sums these once per step instead, which its gradient buffer allows."""
    # copy_to_tp's function: identity forward, all-reduce of the gradient backward.
    return p if not tp.sequence_parallel or tp.size == 1 else _CopyToTP.apply(p, tp)


def enter_tp(x: torch.Tensor, tp: TPContext) -> torch.Tensor:
    """A block's input on every TP rank: ``copy_to_tp``, or under sequence parallelism ``gather_seq``."""
    return gather_seq(x, tp) if tp.sequence_parallel else copy_to_tp(x, tp)


def leave_tp(x: torch.Tensor, tp: TPContext) -> torch.Tensor:
    """A row-parallel block's partial output summed: ``reduce_from_tp``, or ``reduce_scatter_seq``."""
    return reduce_scatter_seq(x, tp) if tp.sequence_parallel else reduce_from_tp(x, tp)


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
    """Lookup in this rank's rows of the table, zeros for other ranks' ids, summed over the group (under
    sequence parallelism reduce-scattered: this rank's sequence slice). Backward is identity
    (``reduce_from_tp``): the incoming gradient is already the full one on every
    rank, and the masked rows route each token's gradient to the one rank that holds its row."""
    rows = weight.shape[0]
    local = ids - tp.rank * rows
    outside = (local < 0) | (local >= rows)
    emb = torch.nn.functional.embedding(local.masked_fill(outside, 0), weight)
    return leave_tp(emb.masked_fill(outside.unsqueeze(-1), 0.0), tp)


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
