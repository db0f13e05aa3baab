"""The single-device baseline every plan must match: the whole model, the whole global batch."""

from __future__ import annotations

from typing import Any

import torch

from hethub.runtime.model import StageModel
from hethub.runtime.optim import OptimConfig, build_optimizer
from hethub.runtime.precision import DynamicLossScaler, autocast
from hethub.spec.model import ModelSpec


def train_single_device(spec: ModelSpec, data: list[torch.Tensor], *, optim: OptimConfig,
                        seed: int = 0, precision: str = "fp32",
                        scaler: DynamicLossScaler | None = None) -> dict[str, Any]:
    """Plain training on one device: loss and gradients of step 0, the clipped norms, final params.

    Each batch is [global_batch, seq_len + 1] tokens; the loss is the mean over sequences of each
    sequence's mean token loss, as the runtime's sample-weighted sync computes it. ``precision``
    autocasts on the CPU (bf16-mixed, fp16-mixed); with ``scaler`` the loss is scaled and steps whose
    gradients overflow are skipped, as the runtime does.
    """
    model = StageModel(spec, layers=(0, spec.num_layers), embedding=True, head=True, seed=seed)
    opt, sched = build_optimizer(model, optim)
    out: dict[str, Any] = {"norms": []}
    out["losses"], out["skipped"] = [], []
    for step, batch in enumerate(data):
        with autocast(torch.device("cpu"), precision):
            loss = model(batch[:, :-1], batch[:, 1:]) / batch.shape[0]
        (loss * scaler.scale if scaler else loss).backward()
        if scaler:
            torch._foreach_div_([p.grad for p in model.parameters()], scaler.scale)
        if step == 0:
            out["loss"] = float(loss.detach())
            out["grads"] = {n: p.grad.clone() for n, p in model.named_parameters()}
        out["losses"].append(float(loss.detach()))
        norm = float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]))
        skip = bool(scaler and scaler.overflowed(norm))
        out["skipped"].append(skip)
        if scaler:
            scaler.update(overflow=skip)
        if not skip:
            out["norms"].append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), optim.grad_clip)))
            opt.step()
            sched.step()
        opt.zero_grad(set_to_none=True)
    out["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return out
