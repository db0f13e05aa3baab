"""The one-tensor reduce-scatter under either of torch's names.

Recent torch releases call it ``dist.reduce_scatter_single`` and deprecate ``reduce_scatter_tensor``
(a FutureWarning per call); the releases down to the supported floor (2.5) have only
``reduce_scatter_tensor`` (torch 1.13 on, gloo included from 2.2). Same arguments, same collective.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def reduce_scatter_into(out: torch.Tensor, inp: torch.Tensor, *, group: Any) -> None:
    """Sum ``inp`` (``len(group)`` equal chunks, contiguous) over ``group`` (a process group, None for
    the world) and write this member's chunk into ``out``."""
    _REDUCE_SCATTER(out, inp, group=group)
