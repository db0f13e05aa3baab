"""One stage's cost: the rules the predictor and the planner share.

A stage is a kind, a TP degree, a micro-batch size, a recomputation mode and a layer count (with or
without the embedding and the head). Its numbers come from here, for the predictor
(:class:`hethub.predict.plan_costs.PlanCosts`) and the planner (``hethub.search``, which keeps
caches over :class:`StageModel` and never restates a rule):

* **time**: compute (:func:`hethub.predict.compute.stage_times`: a measured profile, else the op
  model or the roofline) at the kind's precision and attention implementation *of the plan*
  (``training.kinds.<kind>``), plus Megatron TP's two all-reduces per layer each way over the kind's
  intra-node link at its fabric's achievable bandwidth, unless the profile measured them on a real TP
  group (``tp_comm_included``); under a runtime that overlaps the backward's all-reduces with the
  weight-gradient GEMMs (``hethub.runtimes``: ``tp_wgrad_overlap``) only their part longer than the
  GEMM is exposed, the rest is kept as ``tp_overlapped_s``;
* **profile rule**: a profile measured at another sequence length is not used (attention cost grows
  faster than linearly, so it is not rescaled): the roofline is, and ``compute_source`` says so;
* **memory**: :func:`hethub.predict.memory.stage_memory` with the runtime's vocabulary-parallel rule
  (:func:`~hethub.predict.memory.runtime_vocab_parallel`) and the plan's attention, by in-flight count;
* **hops and rings**: :func:`hethub.predict.comm.boundary_time_s` (both directions of a
  boundary as ``layout.hop`` sends them) and
  :func:`~hethub.predict.comm.rings_link`, which read ``Cluster.link`` and share a NIC among the
  messages through it (:func:`~hethub.predict.comm.shared_links`).

:class:`StageModel` is one stage shape for the planner: its time affine in the layer count (exact
where the profile does not change per-layer time with depth; :meth:`StageModel.step` is always
exact), its memory by in-flight count and the most layers that fit.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from hethub.layout import DEFAULT_BUCKET_ELEMS, ZERO_IN_FLIGHT_ROUNDS
from hethub.memo import Kept
from hethub.plan import Plan, Recompute
from hethub.predict.comm import tp_comm_time_s
from hethub.predict.compute import StageTimes, column_wgrad_s, stage_times
from hethub.predict.memory import (
    StageMemory,
    act_bytes_for,
    runtime_vocab_parallel,
    sharded_memory,
    stage_memory,
    stage_params,
    zero23_memory,
)
from hethub.predict.profiles import KindProfile, ProfileSet
from hethub.predict.seq_parallel import cp_compute_share, sp_tp_comm_s
from hethub.predict.sharding import unit_elems
from hethub.runtimes import DEFAULT_RUNTIME, runtime_profile
from hethub.spec.cluster import Cluster, Link, node_link
from hethub.spec.kind import DeviceKind
from hethub.spec.model import ModelSpec

# stage_memory's results by model and device kind (ids, pinned) and the stage's own key: the
# predictor and the planner ask the same shapes across many plans of one job.
_MEMORY = Kept(100_000)


@dataclass(frozen=True, eq=False)
class StageJob:
    """What every stage's cost depends on besides the stage: the model, the sequence length, the
    plan-wide precision (it sizes the activations sent between stages), each kind's precision and
    attention implementation, the runtime that trains it (what it overlaps: ``hethub.runtimes``)
    and the measured profiles."""

    model: ModelSpec
    seq_len: int
    precision: str
    precisions: Mapping[str, str]  # by kind name
    attentions: Mapping[str, str]  # by kind name
    profiles: ProfileSet | None = None
    runtime: str = DEFAULT_RUNTIME
    _usable: dict[str, KindProfile | None] = field(default_factory=dict, repr=False)

    @classmethod
    def of_plan(cls, plan: Plan, profiles: ProfileSet | None) -> StageJob:
        """The job of ``plan``: its per-kind precision and attention (``Plan.precision_of`` /
        ``attention_of``)."""
        kinds = plan.cluster.kinds
        return cls(model=plan.model, seq_len=plan.seq_len, precision=plan.precision, profiles=profiles,
                   precisions={k: plan.precision_of(k) for k in kinds},
                   attentions={k: plan.attention_of(k) for k in kinds}, runtime=plan.runtime)

    @classmethod
    def planned(cls, *, model: ModelSpec, cluster: Cluster, seq_len: int, precision: str,
                profiles: ProfileSet | None, runtime: str = DEFAULT_RUNTIME) -> StageJob:
        """The job of the plans the planner writes: no per-kind settings, so each kind trains in
        ``precision`` where it runs it and with its catalog attention (what ``Plan.precision_of`` /
        ``attention_of`` give such a plan), under ``runtime``."""
        kinds = cluster.kinds
        return cls(model=model, seq_len=seq_len, precision=precision, profiles=profiles,
                   precisions={k: v.precision_for(precision) for k, v in kinds.items()},
                   attentions={k: v.attention for k, v in kinds.items()}, runtime=runtime)

    def profile(self, kind: str) -> KindProfile | None:
        """The kind's profile where it applies (:func:`usable_profile`)."""
        if kind not in self._usable:
            self._usable[kind] = usable_profile(self.profiles, kind, seq_len=self.seq_len)
        return self._usable[kind]

    def hop_numel(self, mbs: int, *, cp: int = 1) -> int:
        """Elements of one micro-batch's activations sent from a stage to the next (of one CP rank's
        s / cp tokens: what its TP collectives carry too)."""
        return mbs * self.seq_len // cp * self.model.hidden_size

    def hop_bytes(self, mbs: int, *, cp: int = 1) -> float:
        """Bytes of ``hop_numel``."""
        return self.hop_numel(mbs, cp=cp) * act_bytes_for(self.precision)


def usable_profile(profiles: ProfileSet | None, kind: str, *, seq_len: int) -> KindProfile | None:
    """The kind's profile where it was measured at ``seq_len``, else None (the analytic model then
    prices the kind): attention cost grows faster than linearly with the sequence, so a profile of
    another length is not rescaled."""
    prof = profiles.get(kind) if profiles is not None else None
    return prof if prof is not None and prof.seq_len == seq_len else None


@dataclass(frozen=True)
class StageStepCost:
    """One stage's compute times with its TP collectives added (what the schedule simulation runs)."""

    times: StageTimes
    fwd_s: float  # compute + TP collectives (their exposed part)
    bwd_s: float
    tp_overlapped_s: float = 0.0  # TP collective time hidden under compute (forward + backward)


def tp_link(kind: DeviceKind) -> Link:
    """The link a TP group's collectives run over: the kind's intra-node one (TP stays in a node)."""
    return node_link(kind)


def stage_step(job: StageJob, kind: DeviceKind, *, layers: int, embedding: bool, head: bool, tp: int, mbs: int,
               recompute: Recompute, sp: bool = False, cp: int = 1) -> StageStepCost:
    """One micro-batch's forward and backward time of a stage, TP collectives included, and its update.
    ``sp``, ``cp``: the stage's sequence and context parallelism (their rules are
    :mod:`hethub.predict.seq_parallel`'s; the CP ring's passes depend on the devices and are added
    by ``PlanCosts.with_ring``)."""
    times = stage_times(job.model, kind, layers=layers, embedding=embedding, head=head, tp=tp, mbs=mbs,
                        seq_len=job.seq_len, recompute=recompute, precision=job.precisions[kind.name],
                        attention=job.attentions[kind.name], profile=job.profile(kind.name))
    if cp > 1:
        share = cp_compute_share(cp)
        times = replace(times, fwd_s=times.fwd_s * share, bwd_s=times.bwd_s * share)
    if times.tp_comm_included:  # profiles measured on a real TP group have the collectives inside
        return StageStepCost(times, times.fwd_s, times.bwd_s)
    act = job.hop_bytes(mbs, cp=cp)
    if sp and tp > 1:
        tp_f, tp_b = sp_tp_comm_s(act_bytes_per_layer=act, layers=layers, tp=tp, hidden_size=job.model.hidden_size,
                                  link=tp_link(kind))
        return StageStepCost(times, times.fwd_s + tp_f, times.bwd_s + tp_b)
    wgrad = (column_wgrad_s(job.model, kind, tp=tp, mbs=mbs, seq_len=job.seq_len // cp,
                            precision=job.precisions[kind.name])
             if tp > 1 and runtime_profile(job.runtime).tp_wgrad_overlap else ())
    tp_f, tp_b = tp_comm_time_s(act_bytes_per_layer=act, layers=layers, tp=tp, link=tp_link(kind), wgrad_s=wgrad)
    # forward and backward move the same bytes: what the backward does not expose runs beside its GEMMs
    return StageStepCost(times, times.fwd_s + tp_f, times.bwd_s + tp_b, tp_f - tp_b)


def tp_options(cluster: Cluster, model: ModelSpec, kind: str, degrees: tuple[int, ...]) -> tuple[int, ...]:
    """The TP degrees of ``degrees`` a stage of ``kind`` can run ``model`` at: within a node of each of its
    groups, and dividing the attention heads, the key-value heads and the FFN width it shards."""
    sizes = [g.devices_per_node for g in cluster.groups if g.kind == kind]
    return tuple(t for t in sorted(set(degrees)) if all(n % t == 0 for n in sizes)
                 and model.num_heads % t == 0 and model.num_kv_heads % t == 0 and model.ffn_hidden_size % t == 0)


def stage_params_of(model: ModelSpec, *, layers: int, embedding: bool, head: bool, tp: int) -> float:
    """Parameters on one device of a stage, its embedding and head split as the runtime splits them."""
    return stage_params(model, layers=layers, embedding=embedding, head=head, tp=tp,
                        vocab_parallel=runtime_vocab_parallel(model, tp))


def communicators(*, tp: int, synced: bool, neighbours: int, cp: int = 1) -> int:
    """Collective-library communicators a stage's device holds: the world's, its TP group's, its
    data-parallel group's, one per pipeline neighbour and its CP ring's (each costs buffers:
    predict/memory)."""
    return 1 + (tp > 1) + synced + neighbours + (cp > 1)


def stage_memory_of(job: StageJob, kind: DeviceKind, *, layers: int, embedding: bool, head: bool, tp: int,
                    mbs: int, recompute: Recompute, in_flight: float, synced: bool, mixed_sync: bool = False,
                    neighbours: int, sync_bucket_params: float | None = None, sp: bool = False,
                    cp: int = 1, p2p_bytes: float | None = None) -> StageMemory:
    """Peak memory of one device of a stage holding ``in_flight`` micro-batches (kept between calls);
    ``sp``, ``cp``: its sequence and context parallelism; ``p2p_bytes``: its point-to-point buffers
    (``PlanCosts.p2p_bytes`` for a plan's stage; None: the memory model's estimate before a plan exists)."""
    precision, attention = job.precisions[kind.name], job.attentions[kind.name]
    comms = communicators(tp=tp, synced=synced, neighbours=neighbours, cp=cp)
    key = (layers, embedding, head, tp, mbs, recompute, in_flight, synced, mixed_sync, comms, sync_bucket_params,
           sp, cp, p2p_bytes)
    return _MEMORY.get(
        (id(job.model), id(kind), job.seq_len, precision, attention, key),
        lambda: stage_memory(job.model, layers=layers, embedding=embedding, head=head, tp=tp, mbs=mbs,
                             seq_len=job.seq_len, recompute=recompute, precision=precision, in_flight=in_flight,
                             vocab_parallel=runtime_vocab_parallel(job.model, tp), attention=attention, kind=kind,
                             synced=synced, mixed_sync=mixed_sync, communicators=comms,
                             sync_bucket_params=sync_bucket_params, sequence_parallel=sp, cp=cp,
                             p2p_bytes=p2p_bytes),
        pin=(job.model, kind))


def planned_zero23(mem: StageMemory, model: ModelSpec, *, zero_stage: int, elems: float, holders: int, tp: int,
                   emb: bool, head: bool, precision: str) -> StageMemory:
    """``mem`` (sharded as ZeRO-1) under ZeRO-2 or 3 before a plan exists (``memory.zero23_memory`` with
    the parts ``zero23_bytes.zero23_rank_bytes`` gives a plan, estimated): an equal 1/holders slice of the
    stage's ``elems`` parameters, every unit gathered under ZeRO-3 (its holders at one position), the
    largest unit or bucket as the reduction round, two units gathered at once (the one in use and the
    prefetched next)."""
    units = ["layer.0"] + ["embed"] * emb + ["head"] * head
    unit = max(unit_elems(model, u, tp=tp) for u in units)
    rounds = (ZERO_IN_FLIGHT_ROUNDS + 1) * min(elems, max(unit, DEFAULT_BUCKET_ELEMS)) * 4
    wbytes = ModelSpec.state_bytes_per_param(precision)["weights"]
    return zero23_memory(mem, stage=zero_stage, moment_elems=elems / holders, grad_bytes=4 * elems / holders,
                         whole_weight_bytes=0.0, gathered_bytes=2 * min(unit, elems) * wbytes, round_bytes=rounds)


@dataclass(frozen=True)
class Affine:
    """A cost as a line in the layer count: ``base`` with no layers, ``per_layer`` each."""

    per_layer: float
    base: float

    def at(self, layers: int) -> float:
        return self.base + layers * self.per_layer


class StageModel:
    """One stage shape (kind, TP degree, micro-batch size, recomputation) as the planner prices it.

    Before a plan exists a stage is taken to sync with other replicas and to talk to two pipeline
    neighbours (the most buffers a stage holds), and, sharded (``shard_holders`` > 1), to keep
    optimizer state for ``1 / shard_holders`` of its parameters, under ZeRO-2 (``zero_stage``) also
    their gradients, under ZeRO-3 also the parameters, gathered per layer (``planned_zero23``); the
    predictor re-scores the planner's finalists with each plan's own holders and slices.
    ``capacity_bytes``: the memory a stage may use (inf: unlimited). ``sp``, ``cp``: sequence and
    context parallelism (time and memory; the CP ring's passes depend on the devices
    and are :func:`hethub.predict.seq_parallel.cp_ring_s`'s, as hops are the links').
    """

    def __init__(self, job: StageJob, kind: DeviceKind, *, tp: int, mbs: int, recompute: Recompute,
                 capacity_bytes: float, shard_holders: int = 1, sp: bool = False, cp: int = 1,
                 zero_stage: int = 1) -> None:
        self.job, self.kind, self.tp, self.mbs, self.recompute = job, kind, tp, mbs, Recompute.of(recompute)
        self.capacity_bytes, self.shard_holders, self.sp, self.cp = capacity_bytes, shard_holders, sp, cp
        self.zero_stage = zero_stage
        self._steps: dict[tuple[int, bool, bool], StageStepCost] = {}
        self._works: dict[tuple[bool, bool], Affine] = {}
        z, one = self.step(0, emb=False, head=False), self.step(1, emb=False, head=False)
        e, h = self.step(0, emb=True, head=False), self.step(0, emb=False, head=True)
        self.fwd_per_layer_s = one.fwd_s - z.fwd_s
        self.bwd_per_layer_s = one.bwd_s - z.bwd_s
        self.update_per_layer_s = one.times.update_s - z.times.update_s
        self.emb_fwd_s, self.emb_bwd_s = e.fwd_s - z.fwd_s, e.bwd_s - z.bwd_s
        self.head_fwd_s, self.head_bwd_s = h.fwd_s - z.fwd_s, h.bwd_s - z.bwd_s
        prof = job.profile(kind.name)
        entry = prof.lookup(mbs=mbs, tp=tp) if prof is not None else None
        # Measured per-layer times that change with the stack's depth make the time non-affine:
        # step() then evaluates each count (the coefficients still order the split's choices).
        self.affine = entry is None or not entry.layer_by_depth
        p0 = self.params(0, emb=False, head=False)
        self.params_per_layer = self.params(1, emb=False, head=False) - p0
        self._max: dict[tuple[bool, bool, float], tuple[int, int]] = {}  # -> (limit solved for, answer)
        self._lines: dict[tuple[bool, bool], _MemoryLines | None] = {}

    # ---- time ---------------------------------------------------------------------------------------
    def step(self, layers: int, *, emb: bool, head: bool) -> StageStepCost:
        """Exactly the predictor's stage cost at this layer count (kept per count)."""
        key = (layers, emb, head)
        hit = self._steps.get(key)
        if hit is None:
            hit = self._steps[key] = stage_step(self.job, self.kind, layers=layers, embedding=emb, head=head,
                                                tp=self.tp, mbs=self.mbs, recompute=self.recompute, sp=self.sp,
                                                cp=self.cp)
        return hit

    def work(self, *, emb: bool, head: bool) -> Affine:
        """Forward + backward time of one micro-batch as a line in the layer count (kept per (emb, head): the
        search's floors ask it ~10^4 times per search, of a few lines per stage shape)."""
        hit = self._works.get((emb, head))
        if hit is None:
            zero = self.step(0, emb=False, head=False)
            hit = self._works[(emb, head)] = Affine(
                self.fwd_per_layer_s + self.bwd_per_layer_s,
                emb * (self.emb_fwd_s + self.emb_bwd_s) + head * (self.head_fwd_s + self.head_bwd_s) + zero.fwd_s
                + zero.bwd_s)
        return hit

    # ---- parameters and memory ------------------------------------------------------------------
    def params(self, layers: int, *, emb: bool, head: bool) -> float:
        """Parameters on one device of the stage."""
        return stage_params_of(self.job.model, layers=layers, embedding=emb, head=head, tp=self.tp)

    def memory(self, layers: int, *, emb: bool, head: bool, in_flight: float,
               p2p_bytes: float | None = None) -> StageMemory:
        """The stage's peak memory under the planning assumptions (see the class); ``p2p_bytes``: its
        point-to-point buffers where a plan gives them (``PlanCosts.p2p_bytes``), else the memory
        model's estimate (the search's: the stage's position and schedule order are not known yet)."""
        mem = stage_memory_of(self.job, self.kind, layers=layers, embedding=emb, head=head, tp=self.tp,
                              mbs=self.mbs, recompute=self.recompute, in_flight=in_flight, synced=True, neighbours=2,
                              sp=self.sp, cp=self.cp, p2p_bytes=p2p_bytes)
        if self.shard_holders > 1:
            elems = self.params(layers, emb=emb, head=head)
            precision = self.job.precisions[self.kind.name]
            mem = sharded_memory(mem, moment_elems=elems / self.shard_holders, master_elems=0.0, precision=precision,
                                 kind=self.kind)
            if self.zero_stage >= 2:
                mem = planned_zero23(mem, self.job.model, zero_stage=self.zero_stage, elems=elems,
                                     holders=self.shard_holders, tp=self.tp, emb=emb, head=head, precision=precision)
        return mem

    def memory_bytes(self, layers: int, *, emb: bool, head: bool, in_flight: float) -> float:
        """``memory(...).total_bytes`` from per-part lines in the layer count (checked where read),
        or from ``memory`` itself where the parts are not such lines."""
        key = (emb, head)
        if key not in self._lines:
            self._lines[key] = _MemoryLines.read(lambda n, f: self.memory(n, emb=emb, head=head, in_flight=f))
        lines = self._lines[key]
        if lines is None:
            return self.memory(layers, emb=emb, head=head, in_flight=in_flight).total_bytes
        return lines.total(layers, in_flight)

    def max_layers(self, *, emb: bool, head: bool, in_flight: float, limit: int) -> int:
        """Most layers (<= limit) the stage holds within ``capacity_bytes``; -1 if not even zero fit.
        Solved once per shape up to the model's layers (memory grows with the count, so a smaller
        limit's answer is the smaller of the two)."""
        if self.capacity_bytes == float("inf"):
            return limit
        key = (emb, head, in_flight)
        hit = self._max.get(key)
        if hit is None or hit[0] < limit:
            top = max(limit, self.job.model.num_layers)
            hit = self._max[key] = (top, self._solve_max_layers(emb, head, in_flight, top))
        return min(hit[1], limit)

    def _solve_max_layers(self, emb: bool, head: bool, in_flight: float, limit: int) -> int:
        cap = self.capacity_bytes
        lines = self._lines.get((emb, head))
        if lines is not None:  # what memory_bytes reads, without its dispatch (~10^5 evaluations a search)
            total = lines.total

            def over(n: int) -> bool:
                return total(n, in_flight) > cap
        else:
            def over(n: int) -> bool:
                return self.memory_bytes(n, emb=emb, head=head, in_flight=in_flight) > cap

        if over(0):
            return -1
        lines = self._lines.get((emb, head))
        if lines is not None:  # the closed-form answer, confirmed by two exact evaluations
            n = lines.most_layers(cap, in_flight, limit)
            if n >= 1 and not over(n) and (n == limit or over(n + 1)):
                return n
        if over(1):
            return 0
        # From one layer up memory grows with the count (the peak's phase may change, bending the
        # lines), so bisection finds the exact answer.
        lo, hi = 1, limit
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if not over(mid) else (lo, mid - 1)
        return lo


@dataclass(frozen=True)
class _Line:
    """A memory part in the layer count: its value with no layers, and base + slope x n from one up."""

    at0: float
    base: float
    slope: float

    def at(self, n: int) -> float:
        return self.at0 if n == 0 else self.base + self.slope * n


@dataclass(frozen=True)
class _MemoryLines:
    """A stage's memory parts as lines in the layer count (activations also times the in-flight
    count), mirroring ``StageMemory.total_bytes``: persistent state plus the largest of the three
    phases' transients, times the fragmentation, plus what sits outside the allocator."""

    persistent: _Line
    sync: _Line
    step: _Line
    acts: _Line  # per in-flight micro-batch (with the point-to-point buffers that grow with it)
    work0: float  # forward/backward transients besides those, without and with layers
    work1: float
    frag: float
    outside: float

    @classmethod
    def read(cls, mem) -> _MemoryLines | None:
        """The lines read off ``mem(layers, in_flight)`` and checked at two more points; None where
        the parts are not of that shape."""
        z, one, two, one_f2 = mem(0, 1), mem(1, 1), mem(2, 1), mem(1, 2)
        # The pre-plan point-to-point estimate grows by one message per micro-batch in flight.
        per_f = one_f2.p2p_buffers_bytes - one.p2p_buffers_bytes

        def line(get) -> _Line:
            return _Line(get(z), get(one) - (get(two) - get(one)), get(two) - get(one))

        lines = cls(line(lambda m: m.persistent_bytes), line(lambda m: m.grad_sync_buffer_bytes),
                    line(lambda m: m.optimizer_temporaries_bytes), line(lambda m: m.activations_bytes + per_f),
                    _fb_besides_acts(z) - per_f, _fb_besides_acts(one) - per_f, one.fragmentation_ratio,
                    one.framework_context_bytes + one.comm_buffers_bytes)
        if one_f2.activations_bytes != 2 * one.activations_bytes:
            return None
        for n, f in ((3, 3), (7, 5)):
            exact = mem(n, f).total_bytes
            if abs(lines.total(n, f) - exact) > 1e-9 * exact:
                return None
        return lines

    def total(self, n: int, f: float) -> float:
        """Each part's ``_Line.at(n)``, written out (the same sums: max_layers asks ~10^5 of them)."""
        if n == 0:
            top = max(f * self.acts.at0 + self.work0, self.sync.at0, self.step.at0)
            return (self.persistent.at0 + top) * (1 + self.frag) + self.outside
        a, sync, step, p = self.acts, self.sync, self.step, self.persistent
        top = max(f * (a.base + a.slope * n) + self.work1, sync.base + sync.slope * n, step.base + step.slope * n)
        return (p.base + p.slope * n + top) * (1 + self.frag) + self.outside

    def most_layers(self, cap: float, f: float, limit: int) -> int:
        """The largest n >= 1 whose forward/backward peak fits in ``cap`` by the lines (a starting
        point the caller confirms)."""
        g = 1 + self.frag
        slope = (self.persistent.slope + f * self.acts.slope) * g
        base = (self.persistent.base + f * self.acts.base + self.work1) * g + self.outside
        if slope <= 0:
            return limit
        return max(1, min(limit, int((cap - base) // slope)))


def _fb_besides_acts(mem: StageMemory) -> float:
    """The forward/backward moment's transients other than the kept activations (working set,
    point-to-point buffers, gathered parameters)."""
    return mem.phases["forward_backward"] - mem.activations_bytes


class ModesFloor:
    """Several modes of one stage shape as one: the most layers any holds at the least time any takes.
    The search's floors (``search/bounds.py``, ``mixed.py``) take it for "a stage that trades time for
    memory" (every mode but plain ``none``: ``split.CostBook.recompute_floor``); the split prices every
    mode, so a floor built from plain ``none`` and this stays below every split."""

    def __init__(self, *modes: StageModel) -> None:
        self.modes = modes
        for name in ("fwd_per_layer_s", "bwd_per_layer_s", "emb_fwd_s", "emb_bwd_s", "head_fwd_s", "head_bwd_s"):
            setattr(self, name, min(getattr(m, name) for m in self.modes))

    def work(self, *, emb: bool, head: bool) -> Affine:
        works = [m.work(emb=emb, head=head) for m in self.modes]
        return Affine(min(w.per_layer for w in works), min(w.base for w in works))

    def max_layers(self, *, emb: bool, head: bool, in_flight: int, limit: int) -> int:
        return max(m.max_layers(emb=emb, head=head, in_flight=in_flight, limit=limit) for m in self.modes)
