"""The vocabulary-parallel embedding and cross-entropy on 2 forked gloo ranks against the
single-device torch ops: values and gradients within fp32 rounding."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from _harness import TIMEOUT, run_ranks

from hethub.comm.communicator import Communicator
from hethub.runtime.tensor_parallel import (
    TPContext,
    vocab_parallel,
    vocab_parallel_cross_entropy,
    vocab_parallel_embedding,
)

V, N, H = 10, 6, 3


def _inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    # Large logits: the max shift must be global, or exp overflows on one rank's slice.
    logits = torch.randn(2, N // 2, V, generator=g) * 30
    targets = torch.randint(0, V, (2, N // 2), generator=g)
    targets[0, 0], targets[1, -1] = 0, V - 1  # both ends of the vocabulary, one on each rank
    weights = torch.randn(2, N // 2, generator=g)  # a non-uniform upstream gradient
    table = torch.randn(V, H, generator=g)
    return logits, targets, weights, table


def _worker(rank: int) -> dict[str, torch.Tensor]:
    tp = TPContext(size=2, rank=rank, group=(0, 1), comm=Communicator(timeout=TIMEOUT))
    logits, targets, weights, table = _inputs()
    rows = V // 2
    mine = logits[..., rank * rows:(rank + 1) * rows].clone().requires_grad_(True)
    loss = vocab_parallel_cross_entropy(mine, targets, tp)
    (loss * weights).sum().backward()
    shard = table[rank * rows:(rank + 1) * rows].clone().requires_grad_(True)
    emb = vocab_parallel_embedding(targets, shard, tp)
    (emb * torch.arange(H, dtype=emb.dtype)).sum().backward()
    return {"loss": loss.detach().numpy(), "grad": mine.grad.numpy(), "emb": emb.detach().numpy(),
            "emb_grad": shard.grad.numpy()}


def test_matches_torch_on_two_ranks() -> None:
    logits, targets, weights, table = _inputs()
    full = logits.clone().requires_grad_(True)
    ref = F.cross_entropy(full.flatten(0, 1), targets.flatten(), reduction="none").view(targets.shape)
    (ref * weights).sum().backward()
    tab = table.clone().requires_grad_(True)
    emb = F.embedding(targets, tab)
    (emb * torch.arange(H, dtype=emb.dtype)).sum().backward()
    res = run_ranks(2, _worker)
    for r in res:
        torch.testing.assert_close(torch.from_numpy(r["loss"]), ref.detach(), rtol=1e-6, atol=1e-5)
        torch.testing.assert_close(torch.from_numpy(r["emb"]), emb.detach(), rtol=0, atol=0)
    grads = torch.cat([torch.from_numpy(r["grad"]) for r in res], dim=-1)
    torch.testing.assert_close(grads, full.grad, rtol=1e-6, atol=1e-6)
    emb_grads = torch.cat([torch.from_numpy(r["emb_grad"]) for r in res])
    torch.testing.assert_close(emb_grads, tab.grad, rtol=0, atol=0)


def test_indivisible_vocabulary_is_replicated() -> None:
    assert vocab_parallel(256, 2) and vocab_parallel(256, 8)
    assert not vocab_parallel(255, 2) and not vocab_parallel(256, 1) and not vocab_parallel(250, 4)
