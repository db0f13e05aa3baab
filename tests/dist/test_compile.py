"""``--compile`` (torch.compile per decoder block, runtime/compile.py) trains like the eager model: a
2-layer model on one rank, 2 micro-batches, 2 AdamW steps with clipping, against one eager device.
Inductor needs a C++ compiler on a CPU host: without one the test is skipped, saying so. A cold
compile costs tens of seconds (minutes on a loaded 2-core host), so this is the only compile test."""

from __future__ import annotations

import shutil
from dataclasses import replace
from typing import Any

import pytest
import torch
from _harness import OPTIM, SPEC, TIMEOUT, F, batches, make_plan, reference

from hethub.comm.factory import make_communicator
from hethub.comm.local_ranks import run_local_ranks
from hethub.plan import Plan
from hethub.runtime.trainer import Trainer, TrainerConfig

# Inductor's fused kernels reorder some fp32 reductions: last-bit differences, which AdamW's first
# steps (of up to lr = 1e-3 each) can grow to ~1e-6.
TOL = 1e-5
COMPILERS = ("c++", "g++", "clang++")


def _worker(rank: int, plan: Plan, data: list[torch.Tensor]) -> dict[str, Any]:
    comm = make_communicator(plan=plan, rank=rank, timeout=TIMEOUT)
    trainer = Trainer(plan, rank=rank, comm=comm, cfg=TrainerConfig(optim=OPTIM, compile=True))
    compiled = all(hasattr(b, "_compiled_call_impl") and b._compiled_call_impl is not None
                   for b in trainer.model.layers.values())
    losses = [float(trainer.train_step(batch, step=i)["loss"]) for i, batch in enumerate(data)]
    return {"compiled": compiled, "losses": losses,
            "params": {n: p.detach().clone() for n, p in trainer.model.named_parameters()}}


@pytest.mark.skipif(not any(shutil.which(c) for c in COMPILERS),
                    reason=f"torch.compile's CPU backend needs a C++ compiler ({', '.join(COMPILERS)}); none on PATH")
def test_compiled_blocks_train_like_the_eager_model() -> None:
    spec = replace(SPEC, name="t2", num_layers=2)
    plan = make_plan([(2, 2, [(F, 1, 2)])], spec=spec)
    data = batches(plan, steps=2)
    ref = reference(spec, data, optim=OPTIM)
    (res,) = run_local_ranks(1, _worker, plan, data, timeout_s=900, collective_timeout_s=TIMEOUT.total_seconds(),
                             error=AssertionError)
    assert res["compiled"], "every decoder block is compiled"
    assert abs(res["losses"][0] - ref["loss"]) <= TOL
    assert max(abs(a - b) for a, b in zip(res["losses"], ref["losses"], strict=True)) <= TOL
    assert max((p - ref["params"][n]).abs().max().item() for n, p in res["params"].items()) <= TOL
