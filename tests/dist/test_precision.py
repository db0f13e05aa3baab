"""Per-kind precision in the runtime, on CPU (autocast bf16/fp16 works there): a mixed-precision
plan against one device in the same precision and recipe (parameters stored in the compute dtype,
AdamW on fp32 masters, fp32 main grads), kinds of different precision in one pipeline, and fp16
loss scaling that skips a step whose gradients overflowed and then carries on."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import pytest
import torch
from _harness import OPTIM, SPEC, TIMEOUT, batches, make_plan, run_ranks

from hethub.comm.factory import make_communicator
from hethub.plan import Plan
from hethub.runtime.precision import DynamicLossScaler
from hethub.runtime.precision import compute_dtype as ref_dtype
from hethub.runtime.reference import train_single_device
from hethub.runtime.tensor_parallel import shard
from hethub.runtime.trainer import Trainer, TrainerConfig

# Stated tolerances against one device in the same precision. The differences are 16-bit rounding in
# another order, and the activation rounded to 16 bits where it crosses a stage boundary. Measured here
# (3 steps, t6 model): loss 6e-5 (bf16) / 9e-6 (fp16), parameters 2.8e-3 / 8.7e-4 (Adam turns tiny
# gradient differences into steps of up to lr = 1e-3 each). The bounds leave 3-20x margin.
TOL = {"bf16-mixed": {"loss": 1e-3, "param": 1e-2}, "fp16-mixed": {"loss": 2e-4, "param": 5e-3}}
STAGES = [(2, 2, [("cpu-fast", 1, 3), ("cpu-slow", 1, 3)]), (2, 2, [("cpu-fast", 1, 6)])]


def _plan_in(precision_of_kind: dict[str, str], stages=STAGES) -> tuple[Plan, dict[str, str]]:
    """The harness plan in bf16-mixed, and the per-kind precisions the Trainer is told to use."""
    return replace(make_plan(stages), precision="bf16-mixed").validate(), precision_of_kind


def _worker(rank: int, plan: Plan, data: list[torch.Tensor], cfg: TrainerConfig,
            poison: tuple[int, int] | None) -> dict[str, Any]:
    comm = make_communicator(plan=plan, rank=rank, timeout=TIMEOUT)
    trainer = Trainer(plan, rank=rank, comm=comm, cfg=cfg)
    named = dict(trainer.model.named_parameters())
    out: dict[str, Any] = {"precision": trainer.precision, "losses": [], "skipped": [], "scale": [], "moved": []}
    for step, batch in enumerate(data):
        before = {n: p.detach().clone() for n, p in named.items()}
        out["scale"].append(trainer.scaler.scale if trainer.scaler else 1.0)
        loss, _ = trainer.forward_backward(batch)
        trainer.sync_grads()
        if poison == (step, rank):  # an overflow on one rank only, after the sync, as a bad kernel would give
            next(iter(named.values())).main_grad.view(-1)[0] = math.inf
        trainer.clip_and_update()
        out["losses"].append(loss)
        out["skipped"].append(trainer.last_step_skipped)
        out["moved"].append(any(not torch.equal(before[n], p.detach()) for n, p in named.items()))
    tp = trainer.place.stage.tp
    # The fp32 masters AdamW steps; the parameters are their compute-dtype rounding.
    assert trainer.masters is not None
    out["params"] = {n: trainer.masters.of(p).detach().clone() for n, p in named.items()}
    out["dtypes"] = {n: str(p.dtype) for n, p in named.items()}
    out["dims"] = {n: trainer.model.shard_dim(n) for n in named}
    out["tp"] = (tp, trainer.place.tp_rank)
    out["out_dtype"] = str(trainer.executor.out_dtype)
    return out


def _param_diff(r: dict[str, Any], ref: dict[str, Any]) -> float:
    from hethub.runtime.tensor_parallel import TPContext

    tp = TPContext(size=r["tp"][0], rank=r["tp"][1])
    return max((p - shard(ref["params"][n], dim=r["dims"][n], tp=tp)).abs().max().item()
               for n, p in r["params"].items())


@pytest.mark.parametrize("precision", ["bf16-mixed", "fp16-mixed"])
def test_mixed_precision_plan_matches_one_device_in_that_precision(precision: str) -> None:
    plan, kinds = _plan_in({"cpu-fast": precision, "cpu-slow": precision})
    data = batches(plan, steps=3)
    scale = 2.0**8  # small enough never to overflow here: both runs take every step
    ref = train_single_device(SPEC, data, optim=OPTIM, precision=precision, master_copy=True,
                              scaler=DynamicLossScaler(scale=scale) if precision == "fp16-mixed" else None)
    cfg = TrainerConfig(optim=OPTIM, init_loss_scale=scale, cpu_autocast=True, precision=kinds)
    res = run_ranks(plan.world_size, _worker, plan, data, cfg, None)
    tol = TOL[precision]
    for r in res:
        assert r["precision"] == precision and not any(r["skipped"])
        assert set(r["dtypes"].values()) == {str(ref_dtype(precision))}, "parameters in the compute dtype"
        for got, want in zip(r["losses"], ref["losses"], strict=True):
            assert abs(got - want) <= tol["loss"], (got, want)
        assert _param_diff(r, ref) <= tol["param"]
    # Activations really cross stage boundaries in 16 bits (rank 0 is a first stage of a 2-stage pipeline).
    assert res[0]["out_dtype"] == str(ref_dtype(precision))


def test_kinds_of_different_precision_in_one_pipeline() -> None:
    """cpu-fast trains in fp32, cpu-slow in bf16: the activation crosses in fp32 one way, its gradient
    comes back in fp32; the run tracks the fp32 reference within the bf16 tolerance."""
    plan, kinds = _plan_in({"cpu-fast": "fp32", "cpu-slow": "bf16-mixed"},
                           stages=[(2, 2, [("cpu-fast", 1, 3), ("cpu-slow", 1, 3)])])
    data = batches(plan, steps=3)
    ref = train_single_device(SPEC, data, optim=OPTIM)
    cfg = TrainerConfig(optim=OPTIM, cpu_autocast=True, precision=kinds)
    res = run_ranks(plan.world_size, _worker, plan, data, cfg, None)
    assert [r["precision"] for r in res] == ["fp32", "bf16-mixed"]
    for r in res:
        assert max(abs(a - b) for a, b in zip(r["losses"], ref["losses"], strict=True)) <= TOL["bf16-mixed"]["loss"]
        assert _param_diff(r, ref) <= TOL["bf16-mixed"]["param"]


def test_fp16_loss_scaling_skips_an_overflow_everywhere_and_recovers() -> None:
    """An inf in one rank's gradient at step 1 makes every rank skip step 1 (no parameter moves, no
    LR step), the scale halves, and training then goes on exactly as if that batch had never come:
    it matches one fp16 device trained on the other batches."""
    plan, kinds = _plan_in({"cpu-fast": "fp16-mixed", "cpu-slow": "fp16-mixed"})
    data = batches(plan, steps=5)
    optim = replace(OPTIM, total_steps=5)
    cfg = TrainerConfig(optim=optim, init_loss_scale=2.0**10, loss_scale_growth_interval=2, cpu_autocast=True,
                        precision=kinds)
    res = run_ranks(plan.world_size, _worker, plan, data, cfg, (1, 2))
    ref = train_single_device(SPEC, [data[0], *data[2:]], optim=optim, precision="fp16-mixed", master_copy=True,
                              scaler=DynamicLossScaler(scale=2.0**10))
    for r in res:
        assert r["precision"] == "fp16-mixed"
        assert r["skipped"] == [False, True, False, False, False]
        assert r["moved"] == [True, False, True, True, True]
        # 1024 for steps 0-1, halved after the overflow, doubled after 2 good steps (2 and 3).
        assert r["scale"] == [1024.0, 1024.0, 512.0, 512.0, 1024.0]
        assert all(math.isfinite(x) for x in r["losses"])
        assert _param_diff(r, ref) <= TOL["fp16-mixed"]["param"]


def test_a_real_overflow_from_too_large_a_scale_is_caught() -> None:
    """No injection: a scale of 2**40 overflows fp16 gradients for real; every rank (the bf16 one too:
    one fp16 kind makes the whole job scale) skips steps with the scale halving until it fits, then
    training proceeds."""
    plan, kinds = _plan_in({"cpu-fast": "bf16-mixed", "cpu-slow": "fp16-mixed"},
                           stages=[(2, 2, [("cpu-fast", 1, 3), ("cpu-slow", 1, 3)])])
    data = batches(plan, steps=40)
    cfg = TrainerConfig(optim=replace(OPTIM, total_steps=40), init_loss_scale=2.0**40, cpu_autocast=True,
                        precision=kinds)
    res = run_ranks(plan.world_size, _worker, plan, data, cfg, None)
    assert [r["precision"] for r in res] == ["bf16-mixed", "fp16-mixed"]
    skipped = res[0]["skipped"]
    assert res[1]["skipped"] == skipped
    first_good = skipped.index(False)
    assert first_good >= 1 and not any(skipped[first_good:])
    assert res[0]["scale"][first_good] == 2.0**40 / 2**first_good
    assert not any(res[0]["moved"][:first_good]) and all(res[0]["moved"][first_good:])
