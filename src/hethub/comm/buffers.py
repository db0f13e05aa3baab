"""Flat buffers for collectives: many tensors sent as one (the gradient sync and the host all-reduce
benchmark both flatten tensors with ``torch.cat`` and copy the result back with :func:`unflatten_into`)."""

from __future__ import annotations

import torch


def unflatten_into(flat: torch.Tensor, outs: list[torch.Tensor]) -> None:
    """Copy consecutive slices of `flat` back into `outs` (the inverse of cat of their flattened views)."""
    offset = 0
    for t in outs:
        t.copy_(flat[offset:offset + t.numel()].view_as(t))
        offset += t.numel()
