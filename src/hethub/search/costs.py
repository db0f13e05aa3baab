"""Closed-form stage costs for the search, built from the predictor's own building blocks.

Every decoder layer is identical, so a stage's time and memory are affine in its layer count. We
evaluate the predictor's functions (compute.stage_times, memory.stage_memory, comm.*) at a few
layer counts and keep the coefficients: the search then prices a stage in O(1) and computes the
largest layer count that fits memory in closed form, yet agrees with the predictor.
"""

from __future__ import annotations

from dataclasses import dataclass

from hethub.plan import Recompute
from hethub.predict.comm import tp_comm_time_s
from hethub.predict.compute import stage_times
from hethub.predict.memory import (
    DEFAULT_MEM_HEADROOM,
    StageMemory,
    act_bytes_for,
    runtime_vocab_parallel,
    sharded_memory,
    stage_memory,
    stage_params,
    usable_bytes,
)
from hethub.predict.profiles import ProfileSet
from hethub.spec.cluster import Link
from hethub.spec.kind import DeviceKind
from hethub.spec.model import ModelSpec

# The recomputation modes, by falling memory and rising backward time: a stage takes the first that fits.
RECOMPUTE_ORDER = (Recompute.NONE, Recompute.SELECTIVE, Recompute.FULL)


def recompute_options(allow_recompute: bool) -> tuple[Recompute, ...]:
    """The modes a stage may take once the layout is fixed (polish, baselines): all, or only ``none``."""
    return RECOMPUTE_ORDER if allow_recompute else (Recompute.NONE,)


@dataclass(frozen=True)
class Job:
    """What every stage cost depends on besides the stage itself."""

    model: ModelSpec
    seq_len: int
    precision: str
    schedule: str
    profiles: ProfileSet | None = None
    chunks: int = 1  # model chunks per stage the schedule runs (interleaved: v)
    relax_memory: bool = False  # the upper bound prices kinds that cannot hold the model
    mem_headroom: float = DEFAULT_MEM_HEADROOM  # share of each device's memory plans leave free
    # ZeRO-1: each stage keeps AdamW state for 1/holders of its parameters (an assumption the
    # predictor checks on the finalists with the plan's real holders); 1: unsharded.
    optimizer_shard_holders: int = 1


@dataclass(frozen=True)
class Affine:
    per_layer: float
    base: float  # cost of a stage with zero layers (embedding/head only)

    def at(self, layers: int) -> float:
        return self.base + layers * self.per_layer


class RecomputeFloor:
    """What the search's floors (bounds.py, mixed.py) take for "a stage that recomputes": the most
    layers either recomputing mode holds (full's, in practice) at the least time either takes
    (selective's). The split prices both modes (split._options), so a floor built from none and this
    stays below every split whichever mode each stage takes."""

    def __init__(self, selective: StageCost, full: StageCost) -> None:
        self.modes = (selective, full)
        for name in ("fwd_per_layer_s", "bwd_per_layer_s", "emb_fwd_s", "emb_bwd_s", "head_fwd_s", "head_bwd_s"):
            setattr(self, name, min(getattr(m, name) for m in self.modes))

    def work(self, *, emb: bool, head: bool) -> Affine:
        works = [m.work(emb=emb, head=head) for m in self.modes]
        return Affine(min(w.per_layer for w in works), min(w.base for w in works))

    def max_layers(self, *, emb: bool, head: bool, in_flight: int, limit: int) -> int:
        return max(m.max_layers(emb=emb, head=head, in_flight=in_flight, limit=limit) for m in self.modes)


class StageCost:
    """Costs of one stage shape: (kind, tp, micro-batch size, recompute mode)."""

    def __init__(self, job: Job, kind: DeviceKind, *, tp: int, mbs: int, recompute: Recompute | bool) -> None:
        recompute = Recompute.of(recompute)
        self.job, self.kind, self.tp, self.mbs, self.recompute = job, kind, tp, mbs, recompute
        m = job.model
        prof = job.profiles.get(kind.name) if job.profiles else None
        # Same rule as the predictor: a profile measured at another sequence length is not used.
        if prof is not None and prof.seq_len != job.seq_len:
            prof = None

        def times(layers: int, emb: bool, head: bool) -> tuple[float, float, float]:
            st = stage_times(m, kind, layers=layers, embedding=emb, head=head, tp=tp, mbs=mbs,
                             seq_len=job.seq_len, recompute=recompute, precision=kind.precision_for(job.precision),
                             profile=prof)
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
        self.tied_matrix = self.emb_params + self.head_params - (
            stage_params(m, layers=0, embedding=True, head=True, tp=tp) - p0)
        self.capacity_bytes = float("inf") if job.relax_memory else usable_bytes(kind, headroom=job.mem_headroom)
        self._max: dict[tuple[bool, bool, int, int], int] = {}
        self._forms: dict[tuple[bool, bool], tuple | bool] = {}
        self._coef: dict[tuple[bool, bool], tuple[float, ...] | None] = {}

    def fwd_s(self, layers: int, *, emb: bool, head: bool) -> float:
        return layers * self.fwd_per_layer_s + emb * self.emb_fwd_s + head * self.head_fwd_s

    def bwd_s(self, layers: int, *, emb: bool, head: bool) -> float:
        return layers * self.bwd_per_layer_s + emb * self.emb_bwd_s + head * self.head_bwd_s

    def update_s(self, layers: int, *, emb: bool, head: bool) -> float:
        return layers * self.update_per_layer_s + emb * self.emb_update_s + head * self.head_update_s

    def params(self, layers: int, *, emb: bool, head: bool) -> float:
        """Parameters on one device of the stage (``stage_params``: a tied head beside the embedding
        shares its matrix)."""
        shared = self.tied_matrix if emb and head else 0.0
        return layers * self.params_per_layer + emb * self.emb_params + head * self.head_params - shared

    def work(self, *, emb: bool, head: bool) -> Affine:
        """Forward + backward time of one micro-batch as a function of the layer count."""
        return Affine(self.fwd_per_layer_s + self.bwd_per_layer_s,
                      self.fwd_s(0, emb=emb, head=head) + self.bwd_s(0, emb=emb, head=head))

    def memory(self, layers: int, *, emb: bool, head: bool, in_flight: int) -> StageMemory:
        """predict's memory model for this stage shape. The plan is not known yet, so the stage is
        taken to sync with other replicas and to talk to two pipeline neighbours (the most a stage
        does); the predictor, which re-scores the finalists, counts the plan's own."""
        j, k = self.job, self.kind
        mem = stage_memory(j.model, layers=layers, embedding=emb, head=head, tp=self.tp, mbs=self.mbs,
                           seq_len=j.seq_len, recompute=self.recompute, precision=k.precision_for(j.precision),
                           in_flight=in_flight, vocab_parallel=runtime_vocab_parallel(j.model, self.tp),
                           attention=k.attention, kind=k, synced=True, communicators=1 + (self.tp > 1) + 1 + 2)
        if j.optimizer_shard_holders > 1:
            mem = sharded_memory(mem, moment_elems=self.params(layers, emb=emb, head=head) / j.optimizer_shard_holders,
                                 master_elems=0.0, precision=k.precision_for(j.precision), kind=k)
        return mem

    def memory_bytes(self, layers: int, *, emb: bool, head: bool, in_flight: int) -> float:
        """``memory(...).total_bytes``, from per-part coefficients (the search asks this ~10^5 times)."""
        form = self._forms.get((emb, head))
        if form is None:
            form = self._forms[(emb, head)] = self._part_form(emb, head)
        if form is False:
            return self.memory(layers, emb=emb, head=head, in_flight=in_flight).total_bytes
        return _total_from_form(form, layers, in_flight)

    def _part_form(self, emb: bool, head: bool) -> tuple | bool:
        """Each part of predict's memory model as a line in the layer count (activations also times
        the in-flight micro-batches), read off stage_memory at a few points and checked at two more;
        False where the parts are not of that shape (then stage_memory is called each time)."""
        def mem(n: int, f: int) -> StageMemory:
            return self.memory(n, emb=emb, head=head, in_flight=f)

        z, one, two, one_f2 = mem(0, 1), mem(1, 1), mem(2, 1), mem(1, 2)

        def line(get) -> tuple[float, float, float]:  # (value at 0 layers, at n >= 1: base, slope)
            return get(z), get(one) - (get(two) - get(one)), get(two) - get(one)

        form = (line(lambda m: m.persistent_bytes), line(lambda m: m.grad_sync_buffer_bytes),
                line(lambda m: m.optimizer_temporaries_bytes),
                # activations per in-flight micro-batch
                line(lambda m: m.activations_bytes), z.fb_temporaries_bytes + z.p2p_buffers_bytes,
                one.fb_temporaries_bytes + one.p2p_buffers_bytes,
                one.fragmentation_ratio, one.framework_context_bytes + one.comm_buffers_bytes)
        if one_f2.activations_bytes != 2 * one.activations_bytes:
            return False
        for n, f in ((3, 3), (7, 5)):
            if abs(_total_from_form(form, n, f) - mem(n, f).total_bytes) > 1e-9 * mem(n, f).total_bytes:
                return False
        return form

    def max_layers(self, *, emb: bool, head: bool, in_flight: int, limit: int) -> int:
        """Most layers (<= limit) this stage holds within memory; -1 if not even zero fit."""
        if self.capacity_bytes == float("inf"):
            return limit
        key = (emb, head, in_flight, limit)
        n = self._max.get(key)
        if n is None:
            n = self._max[key] = self._solve_max_layers(emb, head, in_flight, limit)
        return n

    def _solve_max_layers(self, emb: bool, head: bool, in_flight: int, limit: int) -> int:
        """The largest n with memory(n) <= capacity, as predict's stage_memory gives it. Where memory is
        bilinear in (layers >= 1, in-flight micro-batches), four coefficients give a starting point;
        exact evaluations confirm it (the peak's moment can change with n, which bends the line)."""
        coef = self._memory_coefficients(emb, head)
        cap, f = self.capacity_bytes, in_flight

        def exact_over(n: int) -> bool:
            return self.memory_bytes(n, emb=emb, head=head, in_flight=f) > cap

        if exact_over(0):
            return -1
        if coef is not None:  # the closed-form answer, confirmed exactly (two evaluations)
            _, _, a, b, c, d = coef
            slope = b + f * d
            n = limit if slope <= 0 else max(1, min(limit, 1 + int((cap - a - b - f * (c + d)) // slope)))
            # From one layer up memory grows with n (the bisection below relies on it too), so n >= 1
            # fitting means one fits: no need to ask whether it does first.
            if not exact_over(n) and (n == limit or exact_over(n + 1)):
                return n
        if exact_over(1):
            return 0
        # Memory grows with n, so bisection finds the exact answer (the peak's moment can change with n,
        # which bends the line the coefficients describe).
        lo, hi = 1, limit
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if not exact_over(mid) else (lo, mid - 1)
        return lo

    def _memory_coefficients(self, emb: bool, head: bool) -> tuple[float, ...] | None:
        """(a0, c0, a, b, c, d): memory(0, f) = a0 + c0 f and memory(n >= 1, f) = a + b n + f (c + d n),
        fitted on predict's stage_memory and checked at two more points; None if it is not that shape."""
        key = (emb, head)
        if key not in self._coef:
            def m(n: int, f: int) -> float:
                return self.memory_bytes(n, emb=emb, head=head, in_flight=f)

            c0 = m(0, 2) - m(0, 1)
            g1, g2 = m(1, 2) - m(1, 1), m(2, 2) - m(2, 1)
            d = g2 - g1
            c = g1 - d
            b = (m(2, 1) - c - 2 * d) - (m(1, 1) - c - d)
            coef = (m(0, 1) - c0, c0, m(1, 1) - c - d - b, b, c, d)
            ok = all(abs(coef[2] + coef[3] * n + f * (coef[4] + coef[5] * n) - m(n, f)) <= 1e-12 * m(n, f)
                     for n, f in ((3, 3), (7, 5)))
            self._coef[key] = coef if ok else None
        return self._coef[key]


def _total_from_form(form: tuple, n: int, f: int) -> float:
    """Mirror of StageMemory.total_bytes for the per-part lines of StageCost._part_form."""
    (pers, sync, step, acts, work0, work1, frag, outside) = form
    # Each line read at n as (value at 0) or (base + slope n), inlined: the search asks ~10^5 times.
    if n == 0:
        fb, at_pers, at_sync, at_step = f * acts[0] + work0, pers[0], sync[0], step[0]
    else:
        fb = f * (acts[1] + acts[2] * n) + work1
        at_pers, at_sync, at_step = pers[1] + pers[2] * n, sync[1] + sync[2] * n, step[1] + step[2] * n
    top = fb
    if at_sync > top:
        top = at_sync
    if at_step > top:
        top = at_step
    return (at_pers + top) * (1 + frag) + outside


class CostBook:
    """StageCosts by shape, and layer splits by template: built once per job, shared by searches."""

    def __init__(self, job: Job, kinds: dict[str, DeviceKind]) -> None:
        self.job, self.kinds = job, kinds
        self._cache: dict[tuple[str, int, int, bool], StageCost] = {}
        self.splits: dict[tuple, object] = {}
        self.options: dict[tuple, list] = {}
        self.capacity: dict[tuple, object] = {}  # bounds.Capacity by (kind, tp, micro-batch size)
        self.floors: dict[tuple, tuple[float, float] | None] = {}  # bounds.py: kind-pure templates' time floors
        self.stage_floors: dict[tuple, tuple[float, float]] = {}  # bounds.py: (per layer, base) of a stage
        self.pipe_floors: dict[tuple, object] = {}  # bounds.pipe_floor by (segments, micro-batch size)
        self.solo: dict[tuple[int, int], tuple[object, float]] = {}  # (id(pipe), replicas) -> (pipe, sync tail)

    def recompute_floor(self, kind: str, *, tp: int, mbs: int) -> RecomputeFloor:
        """The floors' stand-in for every recomputing mode of one stage shape (see RecomputeFloor)."""
        key = ("floor", kind, tp, mbs)
        hit = self.options.get(key)
        if hit is None:
            hit = self.options[key] = RecomputeFloor(self.stage(kind, tp=tp, mbs=mbs, recompute=Recompute.SELECTIVE),
                                                     self.stage(kind, tp=tp, mbs=mbs, recompute=Recompute.FULL))
        return hit  # type: ignore[return-value]

    def stage(self, kind: str, *, tp: int, mbs: int, recompute: Recompute | bool) -> StageCost:
        """The cost model of one stage shape (a bool ``recompute`` means full or none)."""
        recompute = Recompute.of(recompute)
        key = (kind, tp, mbs, recompute)
        sm = self._cache.get(key)
        if sm is None:
            sm = self._cache[key] = StageCost(self.job, self.kinds[kind], tp=tp, mbs=mbs, recompute=recompute)
        return sm
