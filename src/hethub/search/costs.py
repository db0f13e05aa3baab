"""Closed-form stage costs for the search, built from the predictor's own building blocks.

Every decoder layer is identical, so a stage's time and memory are affine in its layer count. We
evaluate the predictor's functions (compute.stage_times, memory.stage_memory, comm.*) at a few
layer counts and keep the coefficients: the search then prices a stage in O(1) and computes the
largest layer count that fits memory in closed form, yet agrees with the predictor.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from hethub.predict.comm import tp_comm_time_s
from hethub.predict.compute import stage_times
from hethub.predict.memory import USABLE_FRACTION, act_bytes_for, stage_memory, stage_params
from hethub.predict.profiles import ProfileSet
from hethub.spec.cluster import DeviceKind, Link
from hethub.spec.model import ModelSpec


@dataclass(frozen=True)
class Job:
    """What every stage cost depends on besides the stage itself."""

    model: ModelSpec
    seq_len: int
    precision: str
    schedule: str
    profiles: ProfileSet | None = None
    relax_memory: bool = False  # the upper bound prices kinds that cannot hold the model


@dataclass(frozen=True)
class Affine:
    per_layer: float
    base: float  # cost of a stage with zero layers (embedding/head only)

    def at(self, layers: int) -> float:
        return self.base + layers * self.per_layer


class StageModel:
    """Costs of one stage shape: (kind, tp, micro-batch size, recompute)."""

    def __init__(self, job: Job, kind: DeviceKind, *, tp: int, mbs: int, recompute: bool) -> None:
        self.job, self.kind, self.tp, self.mbs, self.recompute = job, kind, tp, mbs, recompute
        m = job.model
        prof = job.profiles.get(kind.name) if job.profiles else None
        # Same rule as the predictor: a profile measured at another sequence length is not used.
        if prof is not None and prof.seq_len != job.seq_len:
            prof = None

        def times(layers: int, emb: bool, head: bool) -> tuple[float, float, float]:
            st = stage_times(m, kind, layers=layers, embedding=emb, head=head, tp=tp, mbs=mbs,
                             seq_len=job.seq_len, recompute=recompute, precision=job.precision, profile=prof)
            return st.fwd_s, st.bwd_s, st.update_s

        z, one = times(0, False, False), times(1, False, False)
        e, h = times(0, True, False), times(0, False, True)
        link = Link(kind.intra_node_bw_bytes_per_s, kind.intra_node_latency_s)
        act = mbs * job.seq_len * m.hidden_size * act_bytes_for(job.precision)
        tpf, tpb = tp_comm_time_s(act_bytes_per_layer=act, layers=1, tp=tp, link=link)
        self.fwd_per_layer_s = one[0] - z[0] + tpf
        self.bwd_per_layer_s = one[1] - z[1] + tpb
        self.update_per_layer_s = one[2] - z[2]
        self.emb_fwd_s, self.emb_bwd_s, self.emb_update_s = (e[i] - z[i] for i in range(3))
        self.head_fwd_s, self.head_bwd_s, self.head_update_s = (h[i] - z[i] for i in range(3))
        p0 = stage_params(m, layers=0, embedding=False, head=False, tp=tp)
        self.params_per_layer = stage_params(m, layers=1, embedding=False, head=False, tp=tp) - p0
        self.emb_params = stage_params(m, layers=0, embedding=True, head=False, tp=tp) - p0
        self.head_params = stage_params(m, layers=0, embedding=False, head=True, tp=tp) - p0
        self.capacity_bytes = float("inf") if job.relax_memory else kind.mem_bytes * USABLE_FRACTION

    def fwd_s(self, layers: int, *, emb: bool, head: bool) -> float:
        return layers * self.fwd_per_layer_s + emb * self.emb_fwd_s + head * self.head_fwd_s

    def bwd_s(self, layers: int, *, emb: bool, head: bool) -> float:
        return layers * self.bwd_per_layer_s + emb * self.emb_bwd_s + head * self.head_bwd_s

    def update_s(self, layers: int, *, emb: bool, head: bool) -> float:
        return layers * self.update_per_layer_s + emb * self.emb_update_s + head * self.head_update_s

    def params(self, layers: int, *, emb: bool, head: bool) -> float:
        """Parameters on one device of the stage."""
        return layers * self.params_per_layer + emb * self.emb_params + head * self.head_params

    def work(self, *, emb: bool, head: bool) -> Affine:
        """Forward + backward time of one micro-batch as a function of the layer count."""
        return Affine(self.fwd_per_layer_s + self.bwd_per_layer_s,
                      self.fwd_s(0, emb=emb, head=head) + self.bwd_s(0, emb=emb, head=head))

    def memory_bytes(self, layers: int, *, emb: bool, head: bool, in_flight: int) -> float:
        j = self.job
        return stage_memory(j.model, layers=layers, embedding=emb, head=head, tp=self.tp, mbs=self.mbs,
                            seq_len=j.seq_len, recompute=self.recompute, precision=j.precision,
                            in_flight=in_flight).total_bytes

    def max_layers(self, *, emb: bool, head: bool, in_flight: int, limit: int) -> int:
        """Most layers (<= limit) this stage holds within memory; -1 if not even zero fit."""
        if self.capacity_bytes == float("inf"):
            return limit
        return _max_layers(self, emb, head, in_flight, limit)


@functools.lru_cache(maxsize=200_000)
def _max_layers(sm: StageModel, emb: bool, head: bool, in_flight: int, limit: int) -> int:
    cap = sm.capacity_bytes
    if sm.memory_bytes(0, emb=emb, head=head, in_flight=in_flight) > cap:
        return -1
    m1 = sm.memory_bytes(1, emb=emb, head=head, in_flight=in_flight)
    if m1 > cap:
        return 0
    slope = sm.memory_bytes(2, emb=emb, head=head, in_flight=in_flight) - m1
    n = limit if slope <= 0 else min(limit, 1 + int((cap - m1) // slope))
    # Float rounding may put the affine estimate one layer off the predictor's own check.
    while n > 1 and sm.memory_bytes(n, emb=emb, head=head, in_flight=in_flight) > cap:
        n -= 1
    while n < limit and sm.memory_bytes(n + 1, emb=emb, head=head, in_flight=in_flight) <= cap:
        n += 1
    return n


class CostBook:
    """StageModels by shape, and layer splits by template: built once per job, shared by searches."""

    def __init__(self, job: Job, kinds: dict[str, DeviceKind]) -> None:
        self.job, self.kinds = job, kinds
        self._cache: dict[tuple[str, int, int, bool], StageModel] = {}
        self.splits: dict[tuple, object] = {}
        self.options: dict[tuple, list] = {}
        self.capacity: dict[tuple, object] = {}  # bounds.Capacity by (kind, tp, micro-batch size)
        self.solo: dict[tuple[int, int], tuple[object, float]] = {}  # (id(pipe), replicas) -> (pipe, sync tail)

    def stage(self, kind: str, *, tp: int, mbs: int, recompute: bool) -> StageModel:
        key = (kind, tp, mbs, recompute)
        sm = self._cache.get(key)
        if sm is None:
            sm = self._cache[key] = StageModel(self.job, self.kinds[kind], tp=tp, mbs=mbs, recompute=recompute)
        return sm
