"""A rank on the range's floor (torch 2.5) trains as one on a newer torch: with every fallback for a
newer API forced (gradient clipping without get_total_norm / clip_grads_with_norm_, RMSNorm without
aten._fused_rms_norm, the reduce-scatter under its older name), a bf16 ZeRO-1 plan with TP and
unequal holders gives the same losses, norms and parameters, bit for bit on CPU (where torch's fused
RMSNorm kernel is itself a composite of the same fp32 ops; on a GPU the kernel rounds within bf16)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _harness import OPTIM, TIMEOUT, F, S, batches, make_plan, run_ranks

from hethub.comm import reduce_scatter
from hethub.comm.factory import make_communicator
from hethub.plan import Plan
from hethub.predict.predictor import with_shard_weights
from hethub.runtime import grad_clip, norms
from hethub.runtime.trainer import Trainer, TrainerConfig


def _force_fallbacks() -> None:
    """What a torch 2.5 process has (this runs in a forked rank, so the parent keeps torch's own)."""
    grad_clip._TORCH_TOTAL_NORM = None
    grad_clip._TORCH_CLIP_WITH_NORM = None
    norms._FUSED_KERNEL = None
    reduce_scatter._REDUCE_SCATTER = dist.reduce_scatter_tensor


def _train(rank: int, plan: Plan, data: list[torch.Tensor], fallbacks: bool) -> dict[str, Any]:
    if fallbacks:
        _force_fallbacks()
    comm = make_communicator(plan=plan, rank=rank, timeout=TIMEOUT)
    trainer = Trainer(plan, rank=rank, comm=comm,
                      cfg=TrainerConfig(optim=OPTIM, precision=plan.precision, cpu_autocast=True))
    assert trainer.zero is not None
    losses, norms_ = [], []
    for batch in data:
        loss, _ = trainer.forward_backward(batch)
        trainer.sync_grads()
        norms_.append(float(trainer.clip_and_update()))
        losses.append(float(loss))
    return {"losses": losses, "norms": norms_,
            "params": {n: p.detach().clone() for n, p in trainer.model.named_parameters()}}


@pytest.mark.slow
def test_a_bf16_zero1_run_with_every_fallback_equals_the_run_with_torchs_apis() -> None:
    plan = make_plan([(2, 2, [(F, 1, 3), (F, 2, 3)]), (2, 2, [(S, 1, 6)])])
    plan = with_shard_weights(replace(plan, precision="bf16-mixed", optimizer_sharding="zero1").validate())
    data = batches(plan, steps=2)
    new = run_ranks(plan.world_size, _train, plan, data, False)
    old = run_ranks(plan.world_size, _train, plan, data, True)
    assert max(new[0]["norms"]) > OPTIM.grad_clip  # clipping scaled the gradients at least once
    for a, b in zip(new, old, strict=True):
        assert a["losses"] == b["losses"] and a["norms"] == b["norms"]
        assert a["params"].keys() == b["params"].keys()
        assert all(torch.equal(a["params"][n], b["params"][n]) for n in a["params"]), "parameters differ"
