"""What the predictor returns: one object with the step's time, throughput, memory and timeline."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hethub.predict.memory import StageMemory


@dataclass(frozen=True)
class Event:
    """One interval on one device's timeline. `category`: forward, backward, p2p, allreduce, optimizer."""

    device: int
    category: str
    name: str
    start_s: float
    end_s: float
    pipeline: int
    stage: int
    micro_batch: int | None = None

    @property
    def dur_s(self) -> float:
        return self.end_s - self.start_s


@dataclass(frozen=True)
class StagePrediction:
    pipeline: int
    stage: int
    kind: str
    devices: tuple[int, ...]
    layers: tuple[int, int]
    tp: int
    fwd_s: float  # per micro-batch, compute + TP collectives
    bwd_s: float
    update_s: float
    p2p_s: float  # send of one micro-batch's activations to the next stage
    sync_s: float  # data-parallel gradient synchronisation of this stage's parameters
    weights_bytes: float
    grads_bytes: float
    optimizer_bytes: float
    activations_bytes: float
    capacity_bytes: float  # what the plan may use: device memory less the headroom
    compute_source: str
    # Where one device of this stage spends the step (seconds per step; they add up to the step):
    # its compute (forward + backward, all micro-batches, TP collectives excluded), its exposed
    # communication (TP collectives, which the model does not overlap, and the part of the gradient
    # sync that runs after its last backward), its optimizer update, and the rest: pipeline bubble
    # (fill, drain, waiting for other stages and their transfers).
    compute_s: float = 0.0
    exposed_comm_s: float = 0.0
    bubble_s: float = 0.0
    # The full breakdown (predict/memory); None only for hand-built predictions in tests.
    memory: StageMemory | None = None
    device_mem_bytes: float = 0.0  # the kind's memory as sold
    precision: str = ""
    attention: str = ""
    in_flight: int = 0
    # Communication of one device per step by kind ("tp", "p2p", "dp"): {"exposed_s", "overlapped_s"}.
    # Exposed: time the device waits for it (in exposed_comm_s); overlapped: time it runs beside compute
    # (TP all-reduces under weight-gradient GEMMs, sends during the next ops, gradient buckets during
    # the last backward), as the plan's runtime does (hethub.runtimes); "p2p" also "posts_s": the host
    # time its ops spend posting their sends and receives (PlanCosts.posts_s), in exposed_comm_s.
    comm_s: dict[str, dict[str, float]] = field(default_factory=dict)

    @property
    def peak_mem_bytes(self) -> float:
        if self.memory is not None:
            return self.memory.total_bytes
        return self.weights_bytes + self.grads_bytes + self.optimizer_bytes + self.activations_bytes

    @property
    def fits(self) -> bool:
        return self.peak_mem_bytes <= self.capacity_bytes

    @property
    def over_device_memory(self) -> bool:
        return bool(self.device_mem_bytes) and self.peak_mem_bytes > self.device_mem_bytes

    def memory_dict(self) -> dict[str, Any]:
        """The stage's memory breakdown as ``hethub predict --json`` prints it: parts add up to peak."""
        m = self.memory
        if m is None:
            parts = {"weights": self.weights_bytes, "grads": self.grads_bytes, "optimizer": self.optimizer_bytes,
                     "activations": self.activations_bytes}
            return {"peak_bytes": self.peak_mem_bytes, "parts": parts}
        return {"peak_bytes": m.total_bytes, "parts": m.parts, "peak_phase": m.peak_phase,
                "phases": m.phases, "allocated_bytes": m.allocated_bytes, "reserved_bytes": m.reserved_bytes,
                "usable_bytes": self.capacity_bytes, "device_bytes": self.device_mem_bytes,
                "precision": self.precision, "attention": self.attention, "in_flight_micro_batches": self.in_flight}


@dataclass(frozen=True)
class Prediction:
    step_time_s: float
    tokens_per_s: float
    pipeline_times_s: tuple[float, ...]  # end of each pipeline's last backward
    stages: tuple[StagePrediction, ...]
    timeline: tuple[Event, ...] = field(default=(), repr=False)
    model_flops_per_step: float = 0.0
    # Model FLOP utilisation per device kind and over all devices ("all"), at the predicted step.
    mfu_by_kind: dict[str, float] = field(default_factory=dict)
    # What each part of the prediction rests on: measured (profiles, host all-reduce fits) or analytic.
    sources: dict[str, Any] = field(default_factory=dict)
    warnings: tuple[str, ...] = ()  # e.g. a stage within the memory headroom

    @property
    def fits_memory(self) -> bool:
        return all(s.fits for s in self.stages)

    @property
    def peak_mem_bytes_by_device(self) -> dict[int, float]:
        return {d: s.peak_mem_bytes for s in self.stages for d in s.devices}

    @property
    def peak_mem_bytes_by_kind(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for s in self.stages:
            out[s.kind] = max(out.get(s.kind, 0.0), s.peak_mem_bytes)
        return out

    @property
    def compute_sources(self) -> dict[str, str]:
        return {s.kind: s.compute_source for s in self.stages}

    def to_dict(self) -> dict[str, Any]:
        return {
            "step_time_s": self.step_time_s,
            "tokens_per_s": self.tokens_per_s,
            "pipeline_times_s": list(self.pipeline_times_s),
            "fits_memory": self.fits_memory,
            "peak_mem_bytes_by_kind": self.peak_mem_bytes_by_kind,
            "compute_sources": self.compute_sources,
            "mfu_by_kind": self.mfu_by_kind,
            "sources": self.sources,
            "stages": [
                {"pipeline": s.pipeline, "stage": s.stage, "kind": s.kind, "devices": list(s.devices),
                 "layers": list(s.layers), "tp": s.tp, "fwd_s": s.fwd_s, "bwd_s": s.bwd_s,
                 "update_s": s.update_s, "p2p_s": s.p2p_s, "sync_s": s.sync_s,
                 "step_breakdown_s": {"compute": s.compute_s, "exposed_comm": s.exposed_comm_s,
                                      "update": s.update_s, "bubble": s.bubble_s},
                 "comm_s": s.comm_s,
                 "peak_mem_bytes": s.peak_mem_bytes, "capacity_bytes": s.capacity_bytes,
                 "compute_source": s.compute_source, "memory": s.memory_dict()}
                for s in self.stages
            ],
            "warnings": list(self.warnings),
        }
