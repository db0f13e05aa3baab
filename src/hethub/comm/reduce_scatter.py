"""The one-tensor reduce-scatter and all-gather under either of torch's names.

Recent torch releases call them ``dist.reduce_scatter_single`` / ``dist.all_gather_single`` and
deprecate ``reduce_scatter_tensor`` / ``all_gather_into_tensor`` (a FutureWarning per call); the
releases down to the supported floor (2.5) have only the older names (gloo included from 2.2). Same
arguments, same collectives.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def reduce_scatter_into(out: torch.Tensor, inp: torch.Tensor, *, group: Any, op: Any = None,
                        async_op: bool = False) -> Any:
    """Reduce ``inp`` (``len(group)`` equal chunks, contiguous; a sum unless ``op``) over ``group`` (a
    process group, None for the world) and write this member's chunk into ``out``."""
    return _REDUCE_SCATTER(out, inp, op=dist.ReduceOp.SUM if op is None else op, group=group, async_op=async_op)


def all_gather_into(out: torch.Tensor, inp: torch.Tensor, *, group: Any) -> None:
    """Every member's ``inp`` (equal sizes), concatenated in group order into contiguous ``out``."""
    _ALL_GATHER(out, inp, group=group)
