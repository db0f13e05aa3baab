"""Wake penalty: the extra CPU time of work that starts after its rank sat idle.

On a local emulation host a rank is idle a lot: a pipeline stage waits for activations, an emulated
slow kind sleeps after every chunk, replicas wait in all-reduces. Work that starts after an idle
gap runs slower than the same work back to back: the core's caches were refilled by someone else
meanwhile (other tenants of a virtual machine's host, too) and the core may have dropped to a
lower power state. A profile measured back to back misses it, and it grows with the gap, so it is
measured at several gaps (figures for a small VM: docs/profiles.md).

Measurement, at one micro-batch size (the profile's middle one), in this process (one thread):
pairs of (a forward + backward of a stack of the runtime's decoder layers straight after another,
then the same after sleeping ``gap`` seconds), timed by the thread's CPU time; the penalty at that
gap is the median over pairs of the difference (a pair's two halves see nearly the same machine).
Stored once per profile file (``wake_penalty``, read into ``HostEffects``); the predictor's shared-core replay
(:mod:`hethub.emulation.contention`) adds it to each chunk of CPU work by the idle time before it.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from hethub.runtime.model import StageModel
from hethub.runtime.tensor_parallel import TPContext
from hethub.spec.model import ModelSpec

WAKE_GAPS_S = (0.005, 0.02, 0.06)


def stack_chunk(spec: ModelSpec, *, mbs: int, seq_len: int, device: torch.device | None = None,
                ) -> Callable[[], float]:
    """A function running one forward + backward of a stack of up to 4 of the runtime's decoder layers
    (gradients accumulating, as micro-batches do) and returning the thread CPU seconds it took."""
    model = StageModel(spec, layers=(0, min(4, spec.num_layers)), embedding=False, head=False, tp=TPContext())
    x = torch.randn(mbs, seq_len, spec.hidden_size)
    if device is not None:
        model, x = model.to(device), x.to(device)

    def chunk_cpu_s() -> float:
        start = time.thread_time()
        out = model(x.detach().requires_grad_(True), None)
        out.backward(torch.ones_like(out))
        model.zero_grad(set_to_none=False)
        return time.thread_time() - start

    return chunk_cpu_s


def synced_start(chunk: Callable[[], float], *, lead_s: float) -> float:
    """Warm ``chunk`` up, then wait with every rank of the default group for one common instant
    ``lead_s`` ahead of the slowest rank (one host: one monotonic clock) and return it, so ranks
    that measure side by side start together."""
    for _ in range(3):
        chunk()  # warm-up
    start = torch.tensor([time.monotonic() + lead_s], dtype=torch.float64)
    dist.all_reduce(start, op=dist.ReduceOp.MAX)
    t0 = float(start)
    while time.monotonic() < t0:
        pass
    return t0


def measure_wake_penalty(spec: ModelSpec, *, mbs: int, seq_len: int, gaps_s: Sequence[float] = WAKE_GAPS_S,
                         pairs: int = 16, device: torch.device | None = None) -> tuple[tuple[float, float], ...]:
    """((gap_s, extra CPU seconds of the chunk after it), ...) for a stack of up to 4 decoder layers."""
    chunk_cpu_s = stack_chunk(spec, mbs=mbs, seq_len=seq_len, device=device)
    for _ in range(2):
        chunk_cpu_s()  # warm-up: allocator, first-call costs
    out = []
    for gap in gaps_s:
        extra = []
        for _ in range(pairs):
            warm = chunk_cpu_s()
            time.sleep(gap)
            extra.append(chunk_cpu_s() - warm)
        out.append((float(gap), max(0.0, statistics.median(extra))))
    return tuple(out)
