"""Costs the predictor assembles a plan from, cached by what determines them: each stage shape's
compute and TP time, memory, and each distinct pipeline's event simulation (``PlanCosts``, one per
prediction), and per stage the gradient-sync shape the runtime's flattened buffers give
(``sync_shape``). Large plans are mostly identical replicas, and the planner predicts many plans of
one job, so the pure results are also shared between predictions in bounded memos
(:class:`hethub.memo.Kept`).
"""

from __future__ import annotations

import bisect
import functools
import itertools
from collections.abc import Sequence
from dataclasses import replace

from hethub.memo import Kept, reference
from hethub.plan import Pipeline, Plan, Recompute, Stage
from hethub.predict.comm import boundary_time_s
from hethub.predict.compute import p2p_post_s
from hethub.predict.memory import StageMemory, act_bytes_for, message_bytes, p2p_buffer_bytes
from hethub.predict.memory.p2p import peak_micro_batches
from hethub.predict.profiles import KindProfile, ProfileSet
from hethub.predict.seq_parallel import boundary_hop_s, cp_ring_s, splits_sequence
from hethub.predict.stage_cost import StageJob, StageStepCost, stage_memory_of, stage_params_of, stage_step
from hethub.schedules import Op, Schedule, get_schedule
from hethub.schedules.messages import op_posts
from hethub.schedules.simulate import StageSchedule, simulate_pipeline, simulate_pipeline_time
from hethub.spec.cluster import Cluster

__all__ = ["PlanCosts", "StageStepCost", "sync_shape"]

# Pipeline finishes by the event simulation's inputs (pure: floats, counts, the schedule's name and
# the p2p mode).
_FINISH = Kept(4096)
# sync_shape by layout (the model's id, pinned; each stage's TP degree and layer ranges): the planner
# returns to a layout after hundreds of others (its candidates, then their modes and predictions).
_SYNC_SHAPES = Kept(256)
# Stage-to-stage boundary times by the cluster (id, pinned), the hop's devices (their places, hop_places,
# off the reference path), size and flat (and where sequences are split, each side's grid): the local
# search's moves keep every plan's devices, and the planner predicts the same hops in many plans.
_HOPS = Kept(100_000)
# op_times by PlanCosts.job_key and pipeline (id, pinned).
_OPS = Kept(4096, shortcut=True)
# boundary_s by the hop's devices themselves (and all else _HOPS keys by: the cluster's id, pinned, each
# side's grid, the micro-batch size, sequence length, hidden size, element size and flat), in front of
# _HOPS, which serves every replica's equal places.
_BOUNDARIES = Kept(100_000, shortcut=True)
# A stage's point-to-point buffer bytes by its pipeline's shape (the model (id, pinned), sequence
# length, schedule, micro-batch size, the count's class (peak_micro_batches), chunks, each stage's kind,
# TP, SP, CP and precision: what message_bytes and the buffer peak read) and its index: replicas and the
# planner's plans of one job repeat them.
_P2P = Kept(100_000, shortcut=True)
# An interleaved stage's activation peak by schedule, place, stages, micro-batches and chunk weights (the
# chunks' count is the weights'): replicas repeat it, and each is a walk of the stage's order.
_PEAK_HELD = Kept(100_000, shortcut=True)


class PlanCosts:
    """Caches of stage costs (:mod:`hethub.predict.stage_cost`) and pipeline simulations, keyed by
    everything that determines them."""

    def __init__(self, plan: Plan, profiles: ProfileSet | None) -> None:
        self.plan = plan
        self.profiles = profiles
        self.job = StageJob.of_plan(plan, profiles)
        self.act_bytes = act_bytes_for(plan.precision)
        self.stage: dict[tuple, StageStepCost] = {}
        self.memory: dict[tuple, StageMemory] = {}
        self.finish: dict[tuple, list[float]] = {}
        self.schedules: dict[tuple, list[StageSchedule]] = {}
        self.pipe_shape: dict[int, tuple] = {}  # per pipeline: its key in _P2P
        self.closed: dict[tuple, tuple] = {}  # pipeline_times and closed_form_of, by stage, hop and pipeline
        self.posts: dict[tuple, list[float]] = {}  # posts_s by chunks and stage kinds

    @functools.cached_property
    def sync_shape(self) -> dict[tuple[int, int], tuple[bool, bool, float]]:
        """`sync_shape` of the plan; computed on first use (the stage costs alone do not need it)."""
        return sync_shape(self.plan)

    def profile(self, kind: str) -> KindProfile | None:
        """The kind's profile where it applies (the stage cost model's sequence-length rule)."""
        return self.job.profile(kind)

    def of_stage(self, stage: Stage, *, mbs: int) -> StageStepCost:
        """``stage_cost`` of a plan stage at micro-batch size ``mbs``, all its layers as one."""
        return self.with_ring(stage, self.stage_cost(
            kind=stage.kind, layers=stage.num_layers, embedding=stage.embedding, head=stage.head, tp=stage.tp,
            mbs=mbs, recompute=stage.recompute, sp=stage.sequence_parallel, cp=stage.cp),
            mbs=mbs, layers=stage.num_layers)

    def pipeline_times(self, p: Pipeline) -> tuple[list[float], list[float], list[float]]:
        """Each stage's forward and backward time (``of_stage``: all its layers as one chunk) and each
        hop (``boundary_s``) of ``p``, as new lists (a caller may change them to price a move)."""
        mbs, memo = p.micro_batch_size, self.closed
        for s in p.stages:
            if (s, mbs) not in memo:
                c = self.of_stage(s, mbs=mbs)
                memo[(s, mbs)] = (c.fwd_s, c.bwd_s)
        for a, b in itertools.pairwise(p.stages):
            if (a.devices, b.devices, mbs) not in memo:
                memo[(a.devices, b.devices, mbs)] = (self.boundary_s(a, b, mbs=mbs),)
        return ([memo[(s, mbs)][0] for s in p.stages], [memo[(s, mbs)][1] for s in p.stages],
                [memo[(a.devices, b.devices, mbs)][0] for a, b in itertools.pairwise(p.stages)])

    def closed_form(self, fwd_s: list[float], bwd_s: list[float], p2p_s: list[float], *, chunks: int = 1,
                    ) -> tuple[float, float]:
        """The plan's schedule's closed form of a pipeline, T(m) = base + m x period, as (base, period)
        (``Schedule.fill_drain_s``, ``period_s``: what the planner prices pipelines with)."""
        sch = get_schedule(self.plan.schedule, chunks=chunks)
        per = sch.period_s(fwd_s=fwd_s, bwd_s=bwd_s, p2p_s=p2p_s)
        return sch.fill_drain_s(fwd_s=fwd_s, bwd_s=bwd_s, p2p_s=p2p_s, per_micro_batch_s=per), per

    def closed_form_of(self, p: Pipeline) -> tuple[float, float]:
        """``closed_form`` of a plan pipeline over its ``pipeline_times``."""
        key = (p.micro_batch_size, p.stages)
        if key not in self.closed:
            self.closed[key] = self.closed_form(*self.pipeline_times(p), chunks=p.virtual_stages)
        return self.closed[key]

    def stage_cost(self, *, kind: str, layers: int, embedding: bool, head: bool, tp: int, mbs: int,
                   recompute: Recompute, sp: bool = False, cp: int = 1) -> StageStepCost:
        """``sp``, ``cp``: the stage's sequence and context parallelism (``predict/seq_parallel.py``);
        the CP ring's passes depend on the devices and are added by ``with_ring``."""
        key = (kind, layers, embedding, head, tp, mbs, recompute, sp, cp)
        cost = self.stage.get(key)
        if cost is None:
            cost = self.stage[key] = stage_step(self.job, self.plan.cluster.kinds[kind], layers=layers,
                                                embedding=embedding, head=head, tp=tp, mbs=mbs, recompute=recompute,
                                                sp=sp, cp=cp)
        return cost

    def with_ring(self, stage: Stage, cost: StageStepCost, *, mbs: int, layers: int) -> StageStepCost:
        """``cost`` with the stage's CP ring passes for ``layers`` layers added (none without CP)."""
        if stage.cp == 1:
            return cost
        plan = self.plan
        f, b = cp_ring_s(plan.cluster, stage, model=plan.model, mbs=mbs, seq_len=plan.seq_len,
                         act_bytes=self.act_bytes, layers=layers)
        return replace(cost, fwd_s=cost.fwd_s + f, bwd_s=cost.bwd_s + b)

    def boundary_s(self, src: Stage, dst: Stage, *, mbs: int, flat: bool = True) -> float:
        """One micro-batch's transfer from stage ``src`` to ``dst`` and its gradient back, the slower
        of the two: the plain TP rule (``comm.boundary_time_s``) or, where either splits sequences,
        seq_parallel's."""
        plan = self.plan
        if reference():
            return self._boundary_s(src, dst, mbs=mbs, flat=flat, where=(src.devices, dst.devices))
        cluster = plan.cluster
        # By the devices themselves first: each boundary of a search's plans is priced again and again
        # (every floor, prediction and plan sharing the layout), and its places cost a walk of them.
        grids = (src.tp, src.cp, src.sequence_parallel, dst.tp, dst.cp, dst.sequence_parallel)
        return _BOUNDARIES.get(
            (id(cluster), src.devices, dst.devices, grids, mbs, plan.seq_len, plan.model.hidden_size, self.act_bytes,
             flat), lambda: self._boundary_s(src, dst, mbs=mbs, flat=flat,
                                             where=hop_places(cluster, src.devices, dst.devices)), pin=(cluster,))

    def _boundary_s(self, src: Stage, dst: Stage, *, mbs: int, flat: bool, where: tuple) -> float:
        """``boundary_s`` with the hop's devices as ``where`` (their places, or the devices themselves)."""
        plan = self.plan
        cluster = plan.cluster
        if splits_sequence((src, dst)):  # the devices' places and each side's TP x CP grid and SP
            grids = (src.tp, src.cp, src.sequence_parallel, dst.tp, dst.cp, dst.sequence_parallel)
            return _HOPS.get((id(cluster), where, grids, mbs, plan.seq_len, plan.model.hidden_size, self.act_bytes,
                              flat), lambda: boundary_hop_s(cluster, src, dst, mbs=mbs, seq_len=plan.seq_len,
                                                            hidden_size=plan.model.hidden_size,
                                                            act_bytes=self.act_bytes, flat=flat), pin=(cluster,))
        numel = self.job.hop_numel(mbs)
        return _HOPS.get((id(cluster), where, numel, self.act_bytes, flat),
                         lambda: boundary_time_s(cluster, senders=src.devices, receivers=dst.devices, numel=numel,
                                                 nbytes=numel * self.act_bytes, flat=flat), pin=(cluster,))

    def memory_of(self, shape: tuple, recompute: Recompute | None = None) -> StageMemory:
        """The stage cost model's memory of a `stage_shape` (recomputing ``recompute`` where given,
        else its own mode), kept per PlanCosts and between predictions."""
        key = shape if recompute is None or recompute == shape[6] else (*shape[:6], recompute, *shape[7:])
        mem = self.memory.get(key)
        if mem is None:
            (kind, layers, embedding, head, tp, mbs, recompute, in_flight, synced, mixed_sync, neighbours,
             sync_bucket_params, sequence_parallel, cp, p2p_bytes) = key
            mem = self.memory[key] = stage_memory_of(
                self.job, self.plan.cluster.kinds[kind], layers=layers, embedding=embedding, head=head, tp=tp,
                mbs=mbs, recompute=recompute, in_flight=in_flight, synced=synced, mixed_sync=mixed_sync,
                neighbours=neighbours, sync_bucket_params=sync_bucket_params, sp=sequence_parallel, cp=cp,
                p2p_bytes=p2p_bytes)
        return mem

    def stage_shape(self, pi: int, si: int, *, in_flight: float, p2p_bound: bool = False,
                    without_p2p: bool = False) -> tuple:
        """What stage ``si`` of pipeline ``pi``'s memory depends on, its gradient sync as the runtime does
        it: (kind, layers, embedding, head, tp, micro-batch size, recompute, in_flight, synced, mixed
        sync, pipeline neighbours, sync bucket parameters, sequence parallel, CP degree, point-to-point
        buffer bytes). ``in_flight``:
        micro-batches of the whole stage held at the peak (fractional for chunks). ``p2p_bound``: the
        point-to-point buffers as the memory model's closed-form upper bound (None: in-flight + 1
        whole messages, ``schedules.messages.max_live_messages``) where every stage's messages have
        one dtype, as that bound assumes, instead of replaying the stage's order: a screen, since
        a stage that fits with it fits with the exact bytes. ``without_p2p``: no such buffers, a floor
        (the memory grows with them)."""
        p = self.plan.pipelines[pi]
        s, n = p.stages[si], len(p.stages)
        synced, mixed, bucket = self.sync_shape[(pi, si)]
        if s.cp > 1 and not synced:  # CP ranks sum their gradients like data-parallel holders: all of them
            synced, bucket = True, None
        return (s.kind, s.num_layers, s.embedding, s.head, s.tp, p.micro_batch_size, s.recompute, in_flight, synced,
                mixed, (si > 0) + (si < n - 1), bucket, s.sequence_parallel, s.cp,
                0.0 if without_p2p else None if p2p_bound and self.one_message_dtype else self.p2p_bytes(pi, si))

    @functools.cached_property
    def one_message_dtype(self) -> bool:
        """Whether every stage's activations (its messages) have one element size."""
        plan = self.plan
        return len({act_bytes_for(plan.precision_of(s.kind)) for p in plan.pipelines for s in p.stages}) == 1

    def p2p_bytes(self, pi: int, si: int) -> float:
        """Point-to-point buffer bytes one device of stage ``si`` of pipeline ``pi`` holds at once
        (``predict/memory/p2p.py``), kept per pipeline shape: replicas repeat it."""
        p = self.plan.pipelines[pi]
        if pi not in self.pipe_shape:
            plan = self.plan
            # The micro-batch count as the buffer peak reads it (peak_micro_batches): one class of counts
            # has one peak, so candidates differing only in their counts share it.
            m = peak_micro_batches(plan.schedule, num_stages=len(p.stages), num_micro_batches=p.num_micro_batches,
                                   chunks=p.virtual_stages)
            self.pipe_shape[pi] = (id(plan.model), plan.seq_len, plan.schedule, p.micro_batch_size, m,
                                   p.virtual_stages,
                                   tuple((s.kind, s.tp, s.sequence_parallel, s.cp, plan.precision_of(s.kind))
                                         for s in p.stages))
        return _P2P.get((self.pipe_shape[pi], si), lambda: self._p2p_bytes(pi, si), pin=(self.plan.model,))

    def _p2p_bytes(self, pi: int, si: int) -> float:
        p = self.plan.pipelines[pi]
        return p2p_buffer_bytes(self.plan.schedule, message_bytes(self.plan, pi, si), stage=si,
                                num_stages=len(p.stages), num_micro_batches=p.num_micro_batches,
                                chunks=p.virtual_stages)

    def plan_stage_memory(self, pi: int, si: int, *, in_flight: float, recompute: Recompute | None = None,
                          without_p2p: bool = False) -> StageMemory:
        """Memory of stage ``si`` of pipeline ``pi`` of the plan (`stage_shape`, ``without_p2p`` as there),
        recomputing ``recompute`` where given (the sync shape keeps), else its own mode."""
        return self.memory_of(self.stage_shape(pi, si, in_flight=in_flight, without_p2p=without_p2p), recompute)

    def simulate(self, sig: tuple, *, fwd: list[float], bwd: list[float], p2p: list[float], m: int,
                 ops: bool, chunks: int = 1) -> list[float]:
        """Each device's finish; with ``chunks`` > 1 the inputs are per virtual stage (schedules.simulate)."""
        if ops:
            if sig not in self.schedules:
                self.schedules[sig] = simulate_pipeline(fwd_s=fwd, bwd_s=bwd, p2p_s=p2p, num_micro_batches=m,
                                                        schedule=self.plan.schedule, chunks=chunks, p2p=self.plan.p2p)
            return [st.finish_s for st in self.schedules[sig]]
        if sig not in self.finish:
            kw = {"fwd_s": fwd, "bwd_s": bwd, "p2p_s": p2p, "num_micro_batches": m, "schedule": self.plan.schedule,
                  "chunks": chunks, "p2p": self.plan.p2p}
            # The plain rule of virtual stages is the records' simulation; its finish-only twin
            # (schedules.chunked_sim.chunked_finish) does the same arithmetic without records.
            plain = chunks != 1 and reference()
            # Shared between predictions: the planner predicts the same pipelines again under each
            # optimizer sharding, in the kind-alone and combined searches and in the polish.
            hit = _FINISH.get((tuple(fwd), tuple(bwd), tuple(p2p), m, self.plan.schedule, chunks, self.plan.p2p),
                              lambda: tuple(st.finish_s for st in simulate_pipeline(**kw)) if plain
                              else tuple(simulate_pipeline_time(**kw)))
            self.finish[sig] = list(hit)
        return self.finish[sig]

    def op_times(self, p: Pipeline) -> tuple[list[float], list[float], list[float], list[float]]:
        """What the pipeline's simulation runs (the prediction's inputs): per (virtual) stage each op's
        forward and backward with its point-to-point posts (``posts_s``), and each hop; and the posts.
        Kept per pipeline (the object, pinned: plans are frozen) and job (``job_key``) between
        PlanCosts: the scoring's floors and the prediction that follows read them for the same
        pipelines; each call returns new lists."""
        if reference():
            return self._op_times(p)
        fwd, bwd, hops, posts = _OPS.get((self.job_key, id(p)), lambda: self._op_times(p),
                                         pin=(p, self.plan.cluster, self.plan.model, self.profiles))
        return list(fwd), list(bwd), list(hops), list(posts)

    @functools.cached_property
    def job_key(self) -> tuple:
        """All a pipeline's ``op_times`` read besides the pipeline: the cluster, model and profiles (ids;
        pin them), the sequence length, the plan's precision (its messages' element size), each
        kind's precision and attention and the runtime (``StageJob``)."""
        job = self.job
        return (id(self.plan.cluster), id(job.model), id(self.profiles), job.seq_len, job.precision,
                tuple(sorted(job.precisions.items())), tuple(sorted(job.attentions.items())), job.runtime)

    def _op_times(self, p: Pipeline) -> tuple[list[float], list[float], list[float], list[float]]:
        mbs, n = p.micro_batch_size, len(p.stages)
        costs = [self.of_stage(s, mbs=mbs) for s in p.stages]
        fwd, bwd = [c.fwd_s for c in costs], [c.bwd_s for c in costs]
        p2p = [self.boundary_s(s, p.stages[si + 1], mbs=mbs) if si < n - 1 else 0.0 for si, s in enumerate(p.stages)]
        if p.virtual_stages > 1:
            fwd, bwd, p2p = self.chunk_times(p, p2p=p2p)
        posts = self.posts_s(p)
        return ([t + x for t, x in zip(fwd, posts, strict=True)], [t + x for t, x in zip(bwd, posts, strict=True)],
                p2p, posts)

    def chunk_times(self, p: Pipeline, *, p2p: list[float]) -> tuple[list[float], list[float], list[float]]:
        """Forward, backward and hop times per virtual stage (k = c x n + s) of an interleaved pipeline:
        each chunk costed with its own layers (the embedding on chunk 0 of the first stage, the head on
        the last chunk of the last stage); hops within a chunk are the stages' ``p2p``, the wrap from
        the last stage to the first is that link's."""
        n, v, mbs = len(p.stages), p.virtual_stages, p.micro_batch_size
        fwd, bwd = [0.0] * (n * v), [0.0] * (n * v)
        for si, s in enumerate(p.stages):
            for c, (a, b) in enumerate(s.layer_ranges):
                cost = self.with_ring(s, self.stage_cost(kind=s.kind, layers=b - a, embedding=s.embedding and c == 0,
                                                         head=s.head and c == v - 1, tp=s.tp, mbs=mbs,
                                                         recompute=s.recompute, sp=s.sequence_parallel, cp=s.cp),
                                      mbs=mbs, layers=b - a)
                fwd[c * n + si], bwd[c * n + si] = cost.fwd_s, cost.bwd_s
        # The wrap never sends a flat TP slice (layout.wrap_hops).
        wrap = self.boundary_s(p.stages[-1], p.stages[0], mbs=mbs, flat=False)
        hops = [p2p[k % n] if k % n < n - 1 else wrap for k in range(n * v - 1)]
        return fwd, bwd, hops

    def posts_s(self, p: Pipeline) -> list[float]:
        """Per virtual stage (k = c x n + s) the host time its F op, and as much its B op, spends
        posting its point-to-point receive and send (``schedules.messages.op_posts``, each
        ``compute.p2p_post_s``) as the runtime does per op (runtime/p2p.py): the work a chunk adds
        besides its layers and its link time, so v chunks pay it v times per micro-batch. A fan-out
        to several receivers of another TP degree counts as one post."""
        n, v = len(p.stages), p.virtual_stages
        key = (v, tuple(s.kind for s in p.stages))  # all they read: replicas and the plans of one job repeat it
        if key not in self.posts:
            self.posts[key] = [op_posts(Op("F", 0, k // n), stage=k % n, num_stages=n, chunks=v)
                               * p2p_post_s(self.plan.cluster.kinds[s.kind], self.plan.precision_of(s.kind))
                               for k in range(n * v) for s in (p.stages[k % n],)]
        return list(self.posts[key])

    def chunk_in_flight(self, p: Pipeline, si: int, *, schedule: Schedule) -> float:
        """The activations an interleaved stage holds at its peak, in units of one micro-batch of the
        whole stage's (what ``stage_memory``'s ``in_flight`` multiplies): the schedule's peak over its
        order with each chunk weighed by its own activation bytes (chunks may differ)."""
        s, v = p.stages[si], p.virtual_stages

        kind = self.plan.cluster.kinds[s.kind]

        def acts(layers: int, emb: bool, head: bool) -> float:
            return stage_memory_of(self.job, kind, layers=layers, embedding=emb, head=head, tp=s.tp,
                                   mbs=p.micro_batch_size, recompute=s.recompute, in_flight=1, synced=False,
                                   neighbours=0, sp=s.sequence_parallel, cp=s.cp).activations_bytes

        weights = [acts(b - a, s.embedding and c == 0, s.head and c == v - 1)
                   for c, (a, b) in enumerate(s.layer_ranges)]
        whole = acts(s.num_layers, s.embedding, s.head)
        n, m = len(p.stages), p.num_micro_batches
        peak = _PEAK_HELD.get((schedule.name, si, n, m, tuple(weights)), lambda: schedule.peak_held(
            stage=si, num_stages=n, num_micro_batches=m, chunk_weights=weights))  # type: ignore[attr-defined]
        return peak / whole if whole > 0 else 0.0


def sync_shape(plan: Plan) -> dict[tuple[int, int], tuple[bool, bool, float]]:
    """`_sync_shape_of`, kept for the last few hundred layouts: it depends only on the model, each stage's TP
    degree and layer ranges, and the planner asks it again for the same layout under each
    recomputation mode and each move of the local search (0.1 s on a 768-stage plan). Read-only."""
    key = (id(plan.model), tuple(tuple((s.tp, s.layer_ranges) for s in p.stages) for p in plan.pipelines))
    return _SYNC_SHAPES.get(key, lambda: _sync_shape_of(plan, key[1]), pin=(plan.model,))


def _sync_shape_of(plan: Plan, layouts: tuple[tuple[tuple[int, tuple], ...], ...],
                   ) -> dict[tuple[int, int], tuple[bool, bool, float]]:
    """`_sync_shape_rule` of the plan (``layouts``: each pipeline's stages' TP degree and layer ranges)
    found on two pipelines of each layout (off the reference path: a shortcut, memo.py). Every group
    holds every pipeline, each at the stage holding its layers, so pipelines of one layout are in the
    same groups with the same parameters: equal shapes; and two of each keep the groups, their units,
    TP degrees and whether a stage is synced (more than one pipeline)."""
    kept: dict[tuple, list[int]] = {}
    for pi, layout in enumerate(layouts):
        kept.setdefault(layout, []).append(pi)
    some = sorted(pi for pis in kept.values() for pi in pis[:2])
    if reference() or len(some) == len(layouts):
        return _sync_shape_rule(plan, range(len(layouts)))
    if len(kept) == 1:  # one layout: every group's holders share its TP degree, so none is mixed
        (layout,) = kept
        held = [si for si, (_, ranges) in enumerate(layout)
                if si in (0, len(layout) - 1) or any(b > a for a, b in ranges)]
        return {(pi, si): (True, False, 0.0) for pi in range(len(layouts)) for si in held}
    got = _sync_shape_rule(plan, some)
    at = {pi: i for i, pi in enumerate(some)}
    out = {}
    for pi, layout in enumerate(layouts):
        rep = at.get(pi, at[kept[layout][0]])
        out.update(((pi, si), got[(rep, si)]) for si in range(len(layout)) if (rep, si) in got)
    return out


def _sync_shape_rule(plan: Plan, pipes: Sequence[int]) -> dict[tuple[int, int], tuple[bool, bool, float]]:
    """Per stage of the plan's pipelines ``pipes`` (numbered in that order) taken alone: whether other
    replicas hold its parameters, whether any of its sync groups (units with the same holders,
    runtime/data_parallel.py) mixes TP degrees, and the parameters on one device of those mixed groups
    (their full-size buckets are built for the reduction, all in flight at once; other groups are
    reduced in place in the gradient buffer)."""
    model, pipelines = plan.model, [plan.pipelines[pi] for pi in pipes]
    # Layers between consecutive stage boundaries (of any pipeline) have the same holders: one
    # "segment" per such run, so the work is segments x pipelines, not layers x pipelines.
    bounds = sorted({0, model.num_layers, *(x for p in pipelines for s in p.stages for r in s.layer_ranges
                                             for x in r)})
    # Each pipeline's non-empty layer ranges (a stage's chunks, with virtual stages) by start, and the
    # stage holding each: bisect finds the one holding a segment's first layer.
    held = [sorted((a, si) for si, s in enumerate(p.stages) for a, b in s.layer_ranges if b > a)
            for p in pipelines]
    starts = [[a for a, _ in h] for h in held]
    groups: dict[tuple, dict[str, int]] = {}

    def add(key: tuple, unit: str, count: int) -> None:
        counts = groups.setdefault(key, {})
        counts[unit] = counts.get(unit, 0) + count

    tps = [[s.tp for s in p.stages] for p in pipelines]
    for a, b in itertools.pairwise(bounds):
        if b > a:
            key = tuple((pi, si, tps[pi][si]) for pi in range(len(tps))
                        for si in (held[pi][bisect.bisect_right(starts[pi], a) - 1][1],))
            add(key, "layer", b - a)
    add(tuple((pi, 0, tp[0]) for pi, tp in enumerate(tps)), "embedding", 1)
    add(tuple((pi, len(tp) - 1, tp[-1]) for pi, tp in enumerate(tps)), "head", 1)
    sizes: dict[tuple[str, int], float] = {}  # (unit type, TP) -> parameters on one device

    def size(u: str, tp: int) -> float:
        t = u if u in ("embedding", "head") else "layer"
        if (t, tp) not in sizes:
            sizes[(t, tp)] = stage_params_of(model, layers=t == "layer", embedding=t == "embedding", head=t == "head",
                                             tp=tp)
        return sizes[(t, tp)]

    buckets: dict[tuple[int, int], dict[tuple, list]] = {}
    for hs, counts in groups.items():
        mixed = len({tp for _, _, tp in hs}) > 1
        for pi, si, tp in hs:
            n = sum(c * size(t, tp) for t, c in counts.items())
            buckets.setdefault((pi, si), {})[hs] = [n, mixed]
    out: dict[tuple[int, int], tuple[bool, bool, float]] = {}
    for sid, mine in buckets.items():
        synced = [(n, mixed) for key, (n, mixed) in mine.items() if len(key) > 1]
        if not synced:
            out[sid] = (False, False, 0.0)
            continue
        mixed = [n for n, m in synced if m]
        out[sid] = (True, bool(mixed), float(sum(mixed)))
    return out


def hop_places(cluster: Cluster, senders: tuple[int, ...], receivers: tuple[int, ...]) -> tuple:
    """What a boundary's price (``comm.boundary_time_s``) reads of its devices: each one's node group
    and its node and NIC numbered by first appearance. Boundaries with equal places have the same
    links pair by pair (``Cluster.link``: same node or not, the groups' kinds and NICs) and the
    same NIC sharing (``comm.shared_links``), so one price serves every replica of a pipeline."""
    nodes: dict[int, int] = {}
    nics: dict[int, int] = {}
    out = [len(senders)]
    for d in (*senders, *receivers):
        dev = cluster.devices[d]
        out.append((dev.group, nodes.setdefault(dev.node, len(nodes)), nics.setdefault(dev.nic, len(nics))))
    return tuple(out)
