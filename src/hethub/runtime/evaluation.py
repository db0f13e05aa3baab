"""Held-out loss under the training plan: forward passes only, through the same stages and shares.

Each replica runs forwards of its micro-batches of each held-out global batch (the schedule's
forward ops, no backward), without autograd; the head stages' summed sample losses are all-reduced
and divided by the sample count, as in training. Collective: every rank calls it.
"""

from __future__ import annotations

import torch

from hethub.runtime.data import micro_batches
from hethub.runtime.pipeline import PipelineExecutor
from hethub.runtime.precision import autocast
from hethub.runtime.trainer import Trainer


def _forward_only(trainer: Trainer) -> PipelineExecutor:
    plan, place = trainer.plan, trainer.place
    ex = PipelineExecutor(trainer.model, place=place, comm=trainer.comm, schedule=plan.schedule,
                          seq_len=plan.seq_len, hidden_size=plan.model.hidden_size, emulator=trainer.emulator,
                          device=trainer.device, in_dtype=trainer.executor.in_dtype,
                          out_dtype=trainer.executor.out_dtype)
    # The schedule's forward ops in their order (whatever the op type carries besides kind and micro-batch).
    ex.ops = type(ex.ops)(op for op in ex.ops if op[0] == "F")
    return ex


def evaluate(trainer: Trainer, batches: list[torch.Tensor]) -> float:
    """Mean held-out loss over ``batches`` ([global_batch, seq_len+1] each); nan if there are none."""
    if not batches:
        return float("nan")
    ex = _forward_only(trainer)
    reports = trainer.place.stage.head and trainer.place.tp_rank == 0
    total = 0.0
    was_training = trainer.model.training
    trainer.model.eval()
    try:
        with torch.no_grad(), autocast(trainer.device, trainer.precision):
            for batch in batches:
                mbs = [(x.to(trainer.device), y.to(trainer.device)) for x, y in micro_batches(batch, trainer.share)]
                loss_sum, _ = ex.run(mbs)
                total += float(loss_sum) if reports else 0.0
    finally:
        trainer.model.train(was_training)
    t = torch.tensor([total], dtype=torch.float64, device=trainer.device)
    trainer.comm.all_reduce(t)
    return float(t) / (trainer.plan.global_batch * len(batches))
