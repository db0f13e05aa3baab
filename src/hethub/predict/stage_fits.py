"""Whether a plan's stages fit their memory, without the timing: ``StageFits`` answers it for one
plan under several recomputation modes (the planner asks it per mode of every laid-out candidate),
with a proven floor (``StageFits.over``) that refuses a stage before the exact check; ``stage_mem``
is the one rule for a stage's unsharded memory that these checks and ``predict`` share."""

from __future__ import annotations

import copy
from collections.abc import Collection

from hethub.memo import Kept, reference
from hethub.plan import Plan, Recompute
from hethub.predict.memory import DEFAULT_MEM_HEADROOM, StageMemory, check_headroom, usable_bytes
from hethub.predict.plan_costs import PlanCosts
from hethub.predict.shard_memory import SCREEN_MARGIN, screened_fits, sharded_stage, with_sharding, zero23_held
from hethub.schedules import Schedule, get_schedule

# `StageFits._floor_over`'s answers by everything they depend on, between plans.
_FLOORS_OVER = Kept(100_000, shortcut=True)


def stage_memory_fits(plan: Plan, *, mem_headroom: float = DEFAULT_MEM_HEADROOM,
                      recompute: Recompute | None = None) -> dict[tuple[int, int], bool]:
    """Per (pipeline, stage): whether its predicted peak is within its usable memory, as ``predict``'s
    ``StagePrediction.fits`` says, without the timing (cheap: the planner asks it per candidate).
    ``recompute``: every stage's mode taken as this instead of its own, which is what the plan with
    that mode everywhere gives (a stage's memory depends on its own mode only; the sync shape on
    none), without building that plan (the planner asks this per mode of every candidate)."""
    return StageFits(plan, mem_headroom=mem_headroom).under(recompute)


class StageFits:
    """`stage_memory_fits` of one plan under several recomputation modes: the plan's costs, which
    pipelines repeat an earlier one and each stage's memory shape but for its mode are found once,
    for every mode asked."""

    def __init__(self, plan: Plan, *, mem_headroom: float = DEFAULT_MEM_HEADROOM, p2p_bound: bool = False,
                 costs: PlanCosts | None = None, twins: list[int] | None = None,
                 held: dict[tuple[int, int], tuple[int, int, int]] | None = None) -> None:
        """``p2p_bound``: point-to-point buffers at their closed-form upper bound (``PlanCosts.stage_shape``).
        ``costs``: the ``PlanCosts(plan, None)`` of this plan to share, if any. ``twins``, ``held``: this
        plan's ``memory_twins`` and ``zero23_held`` where the caller has them (a plan differing from
        this one only in its stages' modes has the same: ``ModeFits``)."""
        self.plan, self.costs = plan, PlanCosts(plan, None) if costs is None else costs
        self.schedule = get_schedule(plan.schedule)
        self.mem_headroom, self.p2p_bound = check_headroom(mem_headroom), p2p_bound
        self._held = held
        self.twins = twins = memory_twins(self.costs) if twins is None else twins
        # each stage of a pipeline that is no earlier one's twin
        self.own = [(pi, si) for pi, p in enumerate(plan.pipelines) if twins[pi] == pi for si in range(len(p.stages))]
        # An own stage's memory shape's index in ``shapes`` (PlanCosts.stage_shape; each distinct shape
        # once) or, for chunked pipelines, None (asked per mode through stage_mem): found where first read.
        self.shapes: list[tuple] = []
        self._index: dict[tuple, int] = {}
        self._shape_of: dict[tuple[int, int], int | None] = {}
        self._floors: dict[tuple[int, int], tuple | None] = {}  # `over`'s shapes (None: chunked), by own stage
        # per kind, not per stage
        self.usable = {kind: usable_bytes(plan.cluster.kinds[kind], headroom=self.mem_headroom)
                       for kind in {s.kind for p in plan.pipelines for s in p.stages}}

    @property
    def held(self) -> dict[tuple[int, int], tuple[int, int, int]]:
        """``zero23_held`` of the plan, found once (every mode's floor reads it)."""
        if self._held is None:
            self._held = zero23_held(self.plan)
        return self._held

    def with_bound(self, p2p_bound: bool) -> StageFits:
        """This plan's checks with the point-to-point buffers at their bound or exact: its twins and
        costs shared, its shapes found anew."""
        other = copy.copy(self)
        other.p2p_bound, other.shapes, other._index, other._shape_of = p2p_bound, [], {}, {}
        return other

    def shape_index(self, pi: int, si: int) -> int | None:
        """Own stage ``(pi, si)``'s index in ``shapes`` (None for a chunked pipeline's)."""
        k = self._shape_of.get((pi, si), -1)
        if k == -1:
            p = self.plan.pipelines[pi]
            k = None
            if p.virtual_stages == 1:
                held = self.schedule.in_flight(stage=si, num_stages=len(p.stages),
                                               num_micro_batches=p.num_micro_batches)
                shape = self.costs.stage_shape(pi, si, in_flight=held, p2p_bound=self.p2p_bound)
                k = self._index.get(shape)
                if k is None:
                    k = self._index[shape] = len(self.shapes)
                    self.shapes.append(shape)
            self._shape_of[(pi, si)] = k
        return k

    def under(self, recompute: Recompute | None = None, *, asked: Collection[tuple[int, int]] | None = None,
              ) -> dict[tuple[int, int], bool]:
        """Per (pipeline, stage): whether it fits, every stage recomputing ``recompute`` (None: its own mode).
        ``asked``: the stages to answer for (None: all); under a sharded optimizer every stage's memory is
        still found, as its split weighs them all; without one only the asked stages' (off the reference
        path: a stage's memory is then its own)."""
        plan, costs, usable = self.plan, self.costs, self.usable
        by_shape: dict[int, StageMemory] = {}

        def mem_of(pi: int, si: int) -> StageMemory:
            k = self.shape_index(pi, si)
            if k is None:
                return stage_mem(costs, self.schedule, pi, si, recompute=recompute)[1]
            if k not in by_shape:
                by_shape[k] = costs.memory_of(self.shapes[k], recompute)
            return by_shape[k]

        if asked is not None and not plan.sharded_optimizer and not reference():  # a shortcut (memo.py)
            return {(pi, si): mem_of(self.twins[pi], si).total_bytes <= usable[plan.pipelines[pi].stages[si].kind]
                    for pi, si in asked}
        mems: dict[tuple[int, int], StageMemory] = {(pi, si): mem_of(pi, si) for pi, si in self.own}
        for pi, twin in enumerate(self.twins):
            if twin != pi:
                for si in range(len(plan.pipelines[pi].stages)):
                    mems[(pi, si)] = mems[(twin, si)]
        if plan.sharded_optimizer and plan.shard_weights is None and not reference():  # a shortcut (memo.py)
            hit = screened_fits(plan, mems, headroom=self.mem_headroom, usable=usable, asked=asked, held=self.held)
            if hit is not None:
                return hit
        mems, _ = with_sharding(plan, mems, headroom=self.mem_headroom, held=self.held)
        if asked is None:
            return {(pi, si): mems[(pi, si)].total_bytes <= usable[s.kind]
                    for pi, p in enumerate(plan.pipelines) for si, s in enumerate(p.stages)}
        return {(pi, si): mems[(pi, si)].total_bytes <= usable[plan.pipelines[pi].stages[si].kind] for pi, si in asked}

    def over(self, recompute: Recompute | None = None, *, asked: Collection[tuple[int, int]]) -> set[tuple[int, int]]:
        """Those of the ``asked`` stages for which a floor under their memory (``under``'s, every stage
        recomputing ``recompute``) is already over the usable bytes, so ``under`` says they do not fit
        whatever the other stages hold: the memory without point-to-point buffers and, under a sharded
        optimizer, without an optimizer slice (every part grows with both, as ``screened_fits`` relies on)."""
        plan, held = self.plan, self.held
        made: dict[tuple, bool] = {}
        by_place: dict[tuple, bool] = {}  # replicas' stages: one answer
        out = set()
        for pi, si in asked:
            twin = self.twins[pi]
            place = (twin, si, held.get((pi, si)))
            if place in by_place:
                if by_place[place]:
                    out.add((pi, si))
                continue
            if (twin, si) not in self._floors:  # the same for every mode: kept for the next one's floor
                p = plan.pipelines[twin]
                self._floors[(twin, si)] = None if p.virtual_stages > 1 else self.costs.stage_shape(
                    twin, si, without_p2p=True, in_flight=self.schedule.in_flight(
                        stage=si, num_stages=len(p.stages), num_micro_batches=p.num_micro_batches))
            shape = self._floors[(twin, si)]
            key = ((twin, si) if shape is None else shape, place[2])
            if key not in made:
                made[key] = self._floor_over((pi, si), twin=twin, shape=shape, recompute=recompute, held=place[2])
            by_place[place] = made[key]
            if made[key]:
                out.add((pi, si))
        return out

    def _floor_over(self, sid: tuple[int, int], *, twin: int, shape: tuple | None, recompute: Recompute | None,
                    held: tuple[int, int, int] | None) -> bool:
        """`over`'s answer for stage ``sid`` (its memory that of stage ``twin``, ``sid[1]``; ``shape``: their
        floor's ``stage_shape``, None for a chunked pipeline's). A shaped floor's answer is kept between
        plans (``_FLOORS_OVER``, a shortcut: memo.py): the enumeration checks hundreds of candidates whose
        stages repeat one another's shapes, and the answer depends on nothing else than its key holds
        (the memory model's job and kind, as ``stage_memory_of`` keys it; the optimizer's slice rule;
        the usable bytes)."""
        plan, costs = self.plan, self.costs
        kind = plan.pipelines[sid[0]].stages[sid[1]].kind
        cap = self.usable[kind]

        def over() -> bool:
            mem = (costs.memory_of(shape, recompute) if shape is not None else
                   stage_mem(costs, self.schedule, twin, sid[1], recompute=recompute, without_p2p=True)[1])
            if plan.sharded_optimizer:
                mem = sharded_stage(plan, sid, mem, (0, 0), held)
            return mem.total_bytes > cap + abs(cap) * SCREEN_MARGIN

        if shape is None:
            return over()
        job, device = costs.job, plan.cluster.kinds[kind]
        return _FLOORS_OVER.get((id(plan.model), id(device), job.seq_len, job.precisions[kind], job.attentions[kind],
                                 plan.sharded_optimizer, plan.zero_stage, held, cap, shape, recompute), over,
                                pin=(plan.model, device))


def memory_twins(costs: PlanCosts) -> list[int]:
    """Per pipeline of ``costs.plan``, the first pipeline equal to it in all that its stages' unsharded
    memory (``stage_mem``) depends on: PlanCosts.stage_shape's fields but the in-flight count and the
    buffers, which its place in the schedule and its shape give, and the gradient-sync shape, which
    pipelines of one layout (each stage's TP degree and layer ranges, read here as the stage's fields)
    share (``plan_costs._sync_shape_of``). Replicas share their memory (each its own on the reference
    path: a shortcut, memo.py)."""
    if reference():
        return list(range(len(costs.plan.pipelines)))
    seen: dict[tuple, int] = {}
    return [seen.setdefault((p.micro_batch_size, p.num_micro_batches, tuple(
        (s.kind, len(s.devices), s.layers, s.chunks, s.embedding, s.head, s.recompute, s.sequence_parallel, s.cp)
        for s in p.stages)), pi) for pi, p in enumerate(costs.plan.pipelines)]


def stage_mem(costs: PlanCosts, schedule: Schedule, pi: int, si: int,
               recompute: Recompute | None = None, *, without_p2p: bool = False) -> tuple[int, StageMemory]:
    """The schedule's in-flight micro-batches and the (unsharded) memory of stage ``si`` of pipeline ``pi``
    (recomputing ``recompute`` where given, else the stage's own mode; ``without_p2p``: PlanCosts.stage_shape's)."""
    p = costs.plan.pipelines[pi]
    if p.virtual_stages > 1:  # in_flight counts (micro-batch, chunk) activations; memory weighs each chunk's
        schedule = get_schedule(costs.plan.schedule, chunks=p.virtual_stages)
    in_flight = schedule.in_flight(stage=si, num_stages=len(p.stages), num_micro_batches=p.num_micro_batches)
    held = in_flight if p.virtual_stages == 1 else costs.chunk_in_flight(p, si, schedule=schedule)
    return in_flight, costs.plan_stage_memory(pi, si, in_flight=held, recompute=recompute, without_p2p=without_p2p)

