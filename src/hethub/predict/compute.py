"""Per-micro-batch compute time of a stage: from a measured profile, else an analytic roofline.

Analytic: time = FLOPs / (peak FLOP/s x efficiency), with the kind's documented efficiency factor
(catalog.toml). Backward is twice the forward; full recomputation adds one more forward. The optimizer
update streams the stage's training state through device memory once (read and write).
"""

from __future__ import annotations

from dataclasses import dataclass

from hethub.predict.memory import stage_params
from hethub.predict.profiles import KindProfile
from hethub.spec.cluster import DeviceKind
from hethub.spec.model import ModelSpec


@dataclass(frozen=True)
class StageTimes:
    fwd_s: float  # one micro-batch, this stage, compute only
    bwd_s: float  # includes recomputation
    update_s: float  # optimizer step, once per training step
    source: str  # "profile" or "analytic"
    # Whether fwd/bwd already contain the TP all-reduces (profiles measured on a real TP group).
    tp_comm_included: bool = False
    # Of fwd_s / bwd_s, the emulation's sleep on an emulated kind (no core needed; contention.py).
    fwd_idle_s: float = 0.0
    bwd_idle_s: float = 0.0


def stage_times(
    model: ModelSpec, kind: DeviceKind, *, layers: int, embedding: bool, head: bool, tp: int, mbs: int,
    seq_len: int, recompute: bool, precision: str, profile: KindProfile | None = None,
) -> StageTimes:
    entry = profile.lookup(mbs=mbs, tp=tp) if profile is not None else None
    if entry is not None:
        # Per-layer time at this stage's depth: a deep stack costs more per layer (what it keeps for
        # backward outgrows the caches) where the profile measured stacks of several layers.
        per_layer = entry.layer_at(layers)
        fwd = layers * per_layer.fwd_s
        bwd = layers * per_layer.bwd_s
        upd = layers * per_layer.update_s
        for part, present in ((entry.embedding, embedding), (entry.head, head)):
            if present:
                fwd, bwd, upd = fwd + part.fwd_s, bwd + part.bwd_s, upd + part.update_s
        if recompute:
            bwd += layers * per_layer.fwd_s
        # A profile measures real speed; an emulated kind is slowed on top of it, in its forward and
        # backward chunks only (the runtime's emulation sleeps there, not in the optimizer step), and
        # only their CPU share: the runtime sleeps (k-1) x a chunk's thread CPU time, so time spent
        # waiting in TP collectives is not stretched.
        stretch = (kind.emulated_slowdown - 1.0) * entry.cpu_fraction
        return StageTimes(fwd * (1 + stretch), bwd * (1 + stretch), upd, "profile", entry.tp_comm_included,
                          fwd * stretch, bwd * stretch)
    tokens = mbs * seq_len
    flops = layers * model.layer_fwd_flops(tokens=tokens, seq_len=seq_len)
    if head:
        flops += model.head_fwd_flops(tokens=tokens)
    fwd = flops / tp / kind.effective_flops
    bwd = 2 * fwd + (layers * model.layer_fwd_flops(tokens=tokens, seq_len=seq_len) / tp / kind.effective_flops
                     if recompute else 0.0)
    upd = 0.0
    if kind.mem_bw_bytes_per_s:
        state = sum(ModelSpec.state_bytes_per_param(precision).values())
        params = stage_params(model, layers=layers, embedding=embedding, head=head, tp=tp)
        upd = 2 * params * state / kind.mem_bw_bytes_per_s
    # An emulated kind's analytic speed already includes its slowdown; the share it would sleep:
    idle = 1.0 - 1.0 / kind.emulated_slowdown
    return StageTimes(fwd, bwd, upd, "analytic", fwd_idle_s=fwd * idle, bwd_idle_s=bwd * idle)
