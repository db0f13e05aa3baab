"""Megatron-style tensor parallelism with an explicit group and communicator.

Why not DTensor / ``torch.distributed.tensor.parallel``: its collectives go straight to c10d on a
DeviceMesh, bypassing our Communicator (which must later route across device kinds through a
bridge), and the mixed-TP gradient sync needs plain local shards anyway. The whole of TP here is
two autograd functions: ``copy_to_tp`` (identity forward, all-reduce of the gradient backward) in
front of column-parallel linears and ``reduce_from_tp`` (all-reduce forward, identity backward)
after row-parallel ones. Inputs and outputs of every block are replicated across the TP group.
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
