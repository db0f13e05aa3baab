"""The one-tensor reduce-scatter (comm/reduce_scatter.py) on a torch with either of its names."""

from __future__ import annotations

import importlib
import warnings

import pytest
import torch
import torch.distributed as dist

from hethub.comm import reduce_scatter
from hethub.comm.local_ranks import run_local_ranks


def test_a_torch_without_reduce_scatter_single_gets_reduce_scatter_tensor(monkeypatch) -> None:
    try:
        monkeypatch.delattr(dist, "reduce_scatter_single", raising=False)
        assert importlib.reload(reduce_scatter)._REDUCE_SCATTER is dist.reduce_scatter_tensor
    finally:
        monkeypatch.undo()
        importlib.reload(reduce_scatter)
    if hasattr(dist, "reduce_scatter_single"):
        assert reduce_scatter._REDUCE_SCATTER is dist.reduce_scatter_single


def _ranks(rank: int, name: str) -> torch.Tensor:
    reduce_scatter._REDUCE_SCATTER = getattr(dist, name)
    out = torch.empty(3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # reduce_scatter_tensor, deprecated where both exist
        reduce_scatter.reduce_scatter_into(out, torch.arange(6.0) * (rank + 1), group=None)
    return out


@pytest.mark.parametrize("name", ["reduce_scatter_single", "reduce_scatter_tensor"])
def test_either_name_sums_and_scatters(name: str) -> None:
    if not hasattr(dist, name):
        pytest.skip(f"this torch has no dist.{name}")
    # Rank r holds arange(6) * (r + 1): the sum is arange(6) * 3, rank 0 gets [0, 3, 6], rank 1 [9, 12, 15].
    got = run_local_ranks(2, _ranks, name, timeout_s=60.0, collective_timeout_s=30.0)
    assert torch.equal(got[0], torch.tensor([0.0, 3.0, 6.0])) and torch.equal(got[1], torch.tensor([9.0, 12.0, 15.0]))
