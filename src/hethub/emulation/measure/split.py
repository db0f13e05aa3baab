"""What the runtime's split backward (ZB-H1's B and W) costs on this host, against one backward.

The predictor assumes W is half of the backward and B the other half (the weight GEMMs' FLOPs
equal the input-gradient GEMMs'). On a CPU host with small layers the weightless ops and the
per-op overheads weigh more, so W is less than half, and B + W is more than one backward (the
deferred weight GEMMs read their operands back from memory). So the emulation model replays B and W
with the shares measured here (:class:`hethub.emulation.effects.HostEffects.split_backward`).
"""

from __future__ import annotations

import statistics
import time

import torch

from hethub.runtime import weight_grad
from hethub.runtime.model import StageModel
from hethub.runtime.tensor_parallel import TPContext
from hethub.spec.model import ModelSpec


def measure_split_backward(spec: ModelSpec, *, mbs: int, seq_len: int, repeats: int = 15,
                           device: torch.device | None = None) -> tuple[float, float]:
    """(B, W) thread CPU time of the runtime's split backward of a stack of up to 4 decoder layers,
    each as a fraction of that stack's whole backward; whole and split runs alternate, medians."""
    model = StageModel(spec, layers=(0, min(4, spec.num_layers)), embedding=False, head=False, tp=TPContext(),
                       rope_len=seq_len)
    x0 = torch.randn(mbs, seq_len, spec.hidden_size)
    if device is not None:
        model, x0 = model.to(device), x0.to(device)
    dy = torch.randn_like(x0)
    whole: list[float] = []
    b: list[float] = []
    w: list[float] = []
    for i in range(repeats + 2):  # the first two: warm-up (allocator, first calls)
        out = model(x0.detach().requires_grad_(True))
        t0 = time.thread_time()
        out.backward(dy)
        t1 = time.thread_time()
        with weight_grad.recording():
            out = model(x0.detach().requires_grad_(True))
        t2 = time.thread_time()
        with weight_grad.deferring() as later:
            out.backward(dy)
        t3 = time.thread_time()
        later.run()
        t4 = time.thread_time()
        model.zero_grad(set_to_none=False)
        if i >= 2:
            whole.append(t1 - t0)
            b.append(t3 - t2)
            w.append(t4 - t3)
    ref = statistics.median(whole)
    return statistics.median(b) / ref, statistics.median(w) / ref
