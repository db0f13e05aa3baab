"""The single-device baseline every plan must match: the whole model, the whole global batch."""

from __future__ import annotations

import copy
from typing import Any

import torch

from hethub.runtime.grad_clip import total_norm
from hethub.runtime.model import StageModel
from hethub.runtime.optim import OptimConfig, build_optimizer
from hethub.runtime.precision import DynamicLossScaler, autocast, compute_dtype
from hethub.spec.model import ModelSpec


def train_single_device(spec: ModelSpec, data: list[torch.Tensor], *, optim: OptimConfig,
                        seed: int = 0, precision: str = "fp32",
                        scaler: DynamicLossScaler | None = None, master_copy: bool = False) -> dict[str, Any]:
    """Plain training on one device: loss and gradients of step 0, the clipped norms, final params.

    Each batch is [global_batch, seq_len + 1] tokens; the loss is the mean over sequences of each
    sequence's mean token loss, as the runtime's sample-weighted sync computes it. ``precision``
    autocasts on the CPU (bf16-mixed, fp16-mixed); with ``scaler`` the loss is scaled and steps whose
    gradients overflow are skipped, as the runtime does. With ``master_copy`` (mixed precision only) the
    model's parameters are stored in the compute dtype and AdamW steps an fp32 master copy, whose
    values are cast back after each step (the recipe of a ZeRO-1 run in mixed precision,
    ``runtime/zero.py``); gradients, norms and the returned parameters are the masters'.
    """
    master = StageModel(spec, layers=(0, spec.num_layers), embedding=True, head=True, seed=seed,
                        compute_dtype=compute_dtype(precision))
    dtype = compute_dtype(precision) if master_copy else None
    model = master
    if dtype is not None:  # parameters only: buffers (RoPE tables) stay as they are, as in the runtime
        model = copy.deepcopy(master)
        for p in model.parameters():
            p.data = p.data.to(dtype)
    opt, sched = build_optimizer(master, optim)
    out: dict[str, Any] = {"norms": []}
    out["losses"], out["skipped"] = [], []
    for step, batch in enumerate(data):
        with autocast(torch.device("cpu"), precision):
            loss = model(batch[:, :-1], batch[:, 1:]) / batch.shape[0]
        (loss * scaler.scale if scaler else loss).backward()
        if model is not master:
            for mp, p in zip(master.parameters(), model.parameters(), strict=True):
                mp.grad, p.grad = p.grad.float(), None
        if scaler:
            torch._foreach_div_([p.grad for p in master.parameters()], scaler.scale)
        if step == 0:
            out["loss"] = float(loss.detach())
            out["grads"] = {n: p.grad.clone() for n, p in master.named_parameters()}
        out["losses"].append(float(loss.detach()))
        norm = float(total_norm([p.grad for p in master.parameters()]))
        skip = bool(scaler and scaler.overflowed(norm))
        out["skipped"].append(skip)
        if scaler:
            scaler.update(overflow=skip)
        if not skip:
            out["norms"].append(float(torch.nn.utils.clip_grad_norm_(master.parameters(), optim.grad_clip)))
            opt.step()
            sched.step()
            if model is not master:
                with torch.no_grad():
                    for mp, p in zip(master.parameters(), model.parameters(), strict=True):
                        p.copy_(mp)
        opt.zero_grad(set_to_none=True)
    out["params"] = {n: p.detach().clone() for n, p in master.named_parameters()}
    return out
