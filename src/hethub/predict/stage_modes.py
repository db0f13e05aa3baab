"""A stage's modes: its recomputation (none, selective, full) and sequence parallelism, the choices
that trade its time for memory once its layers and devices are set. The one list of them, fastest
first by the stage cost model, and which fit, for the planner's laid-out plans
(``choose_recompute``) and its splits (``search/split.CostBook.modes`` offers the same)."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, replace

from hethub.memo import Kept, reference
from hethub.plan import Plan, Recompute, Stage
from hethub.predict.memory import DEFAULT_MEM_HEADROOM
from hethub.predict.plan_costs import PlanCosts
from hethub.predict.predictor import pipeline_floor_s
from hethub.predict.seq_parallel import sp_applies
from hethub.predict.shard_memory import zero23_held
from hethub.predict.stage_cost import StageJob, stage_step
from hethub.predict.stage_fits import StageFits
from hethub.schedules import get_schedule

RECOMPUTE_ORDER = (Recompute.NONE, Recompute.SELECTIVE, Recompute.FULL)  # by falling memory, rising time
Mode = tuple[Recompute, bool]  # a stage's recomputation and sequence parallelism
_ORDERS = Kept(100_000)  # stage_modes' answers by stage shape and job: the planner asks the same shapes often
# A stage in another mode by the stage and mode: the planner's plans share most of their stages, and a copy
# is a frozen dataclass's whole construction.
_MODED = Kept(100_000)


def in_mode(s: Stage, recompute: Recompute, sp: bool) -> Stage:
    """``s`` recomputing ``recompute``, sequence-parallel where ``sp`` (``s`` itself where it already is)."""
    if s.recompute is recompute and s.sequence_parallel == sp:
        return s
    return _MODED.get((s, recompute, sp), lambda: replace(s, recompute=recompute, sequence_parallel=sp))


@dataclass(frozen=True)
class Chosen:
    """`choose_modes`' answer: the plan in its chosen modes, and whether every stage found one that fits
    (where not, a stage keeps its own mode, and ``predict`` may find the plan over memory)."""

    plan: Plan
    every_stage_fits: bool


def choose_recompute(plan: Plan, *, allow_recompute: bool = True, mem_headroom: float = DEFAULT_MEM_HEADROOM,
                     allow_sp: bool = True, strict: bool = False, fits: ModeFits | None = None) -> Plan | None:
    """Each stage's fastest mode that fits its memory (``stage_modes``: recomputation, and sequence
    parallelism where offered and ``allow_sp``); without ``allow_recompute`` only plain ``none`` is
    tried. A stage that fits under no mode tried keeps its own, or, ``strict``, the answer is None.
    ``fits``: this plan's ``ModeFits`` at ``mem_headroom`` where the caller made one (`modes_floor_s`'s),
    so that what it found is not found again."""
    chosen = choose_modes(plan, allow_recompute=allow_recompute, mem_headroom=mem_headroom, allow_sp=allow_sp,
                          strict=strict, fits=fits)
    return chosen.plan if chosen.every_stage_fits or not strict else None


def choose_modes(plan: Plan, *, allow_recompute: bool = True, mem_headroom: float = DEFAULT_MEM_HEADROOM,
                 allow_sp: bool = True, strict: bool = False, fits: ModeFits | None = None,
                 orders: dict[tuple[int, int], list[Mode]] | None = None) -> Chosen:
    """`choose_recompute`'s plan, saying whether every stage found a mode that fits; ``strict``: the search
    stops at the first stage that found none (the plan then given back as it came). ``orders``: the
    plan's ``stage_modes`` with the same flags where the caller has them (`modes_floor_s` asks them too)."""
    modes = stage_modes(plan, allow_recompute=allow_recompute, allow_sp=allow_sp) if orders is None else orders
    fits = ModeFits(plan, mem_headroom) if fits is None else fits
    pipes, every = [], True
    for pi, p in enumerate(plan.pipelines):
        stages = []
        for si, s in enumerate(p.stages):
            mode = next((m for m in modes[(pi, si)] if fits.fits(m, (pi, si))), None)
            if mode is None and strict:
                return Chosen(plan, every_stage_fits=False)
            every = every and mode is not None
            stages.append(in_mode(s, *(mode or (s.recompute, s.sequence_parallel))))
        # A pipeline (a plan) whose stages all keep their modes is itself: a copy is equal and costs a rebuild
        # (a shortcut: memo.py).
        kept = all(a is b for a, b in zip(stages, p.stages, strict=True)) and not reference()
        pipes.append(p if kept else replace(p, stages=tuple(stages)))
    same = all(a is b for a, b in zip(pipes, plan.pipelines, strict=True))
    return Chosen(plan if same else replace(plan, pipelines=tuple(pipes)), every_stage_fits=every)


def fits_some_mode(plan: Plan, *, allow_recompute: bool = True, mem_headroom: float = DEFAULT_MEM_HEADROOM,
                   allow_sp: bool = True, orders: dict[tuple[int, int], list[Mode]] | None = None,
                   fits: ModeFits | None = None, screened: bool = False) -> bool:
    """Whether every stage of ``plan`` fits its memory under some mode (what ``choose_recompute`` then
    picks), with the plan's real gradient-sync shape. ``orders``, ``fits``: the plan's ``stage_modes`` (the same
    flags) and ``ModeFits`` (the same headroom) where the caller has them; ``screened``: the caller proved no
    stage ``ModeFits.hopeless`` (pipeline_floors.fits_some_mode_kept)."""
    modes = stage_modes(plan, allow_recompute=allow_recompute, allow_sp=allow_sp) if orders is None else orders
    fits = ModeFits(plan, mem_headroom) if fits is None else fits
    # The modes holding the fewest activations first (full recomputation): they usually settle it; SP's
    # last, as its plan's memory is found anew.
    order = sorted({m for ms in modes.values() for m in ms}, key=lambda m: (m[1], -RECOMPUTE_ORDER.index(m[0])))
    if not screened and fits.hopeless(modes):
        return False
    left = set(modes)
    for m in order:
        asked = [sid for sid in left if m in modes[sid]]
        if asked:
            ok = fits(m, asked)
            left.difference_update(sid for sid in asked if ok[sid])
        if not left:
            return True
    return False


def modes_floor_s(plan: Plan, *, costs: PlanCosts, allow_recompute: bool = True, allow_sp: bool = True,
                  fits: ModeFits | None = None, orders: dict[tuple[int, int], list[Mode]] | None = None) -> float:
    """A floor under ``predictor.step_floor_s`` of ``choose_recompute(plan, ...)`` (the same flags),
    whatever modes it picks, before they are chosen: each stage at the least forward and the least
    backward time over its modes and its own (``pipeline_floor_s`` only grows with each; float
    rounding is monotone too; a CP ring's passes, added by ``PlanCosts.with_ring``, do not depend on
    the mode). ``costs``: as for ``step_floor_s``. ``fits``: the plan's ``ModeFits`` at the headroom
    ``choose_recompute`` is given (to pass on to it): a tighter floor, leaving out the modes it proves
    a stage over memory in (``ModeFits.refused``), which ``choose_recompute`` never picks (it tries
    the rest, then keeps the stage's own), at the cost of those proofs (a memory floor per mode).
    ``orders``: as for ``choose_modes``."""
    modes = stage_modes(plan, allow_recompute=allow_recompute, allow_sp=allow_sp) if orders is None else orders
    drain, best, costed, least = not get_schedule(plan.schedule).split_backward, 0.0, {}, {}
    refused: dict[Mode, set[tuple[int, int]]] = {}  # `fits.refused`'s sets, asked once per mode here
    # Pipelines of equal stage costs and counts (replicas) have one floor, found once (a shortcut: memo.py);
    # a CP ring's passes read the devices.
    floors: dict[tuple, float] = {}
    for pi, p in enumerate(plan.pipelines):
        if p.virtual_stages > 1:
            continue
        kepts = []
        for si, s in enumerate(p.stages):
            key = (s.kind, s.tp, s.cp, s.layers, s.embedding, s.head, s.recompute, s.sequence_parallel,
                   p.micro_batch_size)  # a replica's stages share it: its modes and costs depend on nothing else
            own = (s.recompute, s.sequence_parallel)
            if key not in costed:
                costed[key] = {m: costs.stage_cost(kind=s.kind, layers=s.num_layers, embedding=s.embedding, head=s.head,
                                                   tp=s.tp, mbs=p.micro_batch_size, recompute=m[0], sp=m[1], cp=s.cp)
                               for m in {*modes[(pi, si)], own}}
            # Only the modes `choose_recompute` tries before the stage's own are asked whether refused (it asks
            # them too, where it reaches them); the rest stay in.
            order = modes[(pi, si)]
            if fits is None:
                kepts.append((key, (own, *order)))
                continue
            ahead = order[:order.index(own)] if own in order else order
            for m in ahead:
                if m not in refused:
                    refused[m] = fits.refused(m)
            kepts.append((key, (own, *(m for m in order if m not in ahead or (pi, si) not in refused[m]))))
        ring = any(s.cp > 1 for s in p.stages)
        sig = (p.num_micro_batches, tuple(kepts))
        floor = None if ring or reference() else floors.get(sig)
        if floor is None:
            times = []
            for s, (key, kept) in zip(p.stages, kepts, strict=True):
                if (key, kept) not in least:
                    by_mode = costed[key]
                    least[key, kept] = replace(by_mode[kept[0]], fwd_s=min(by_mode[m].fwd_s for m in kept),
                                               bwd_s=min(by_mode[m].bwd_s for m in kept))
                times.append(costs.with_ring(s, least[key, kept], mbs=p.micro_batch_size, layers=s.num_layers))
            floor = floors[sig] = pipeline_floor_s([t.fwd_s for t in times], [t.bwd_s for t in times],
                                                   num_micro_batches=p.num_micro_batches, drain=drain)
        best = max(best, floor)
    return best


def stage_modes(plan: Plan, *, allow_recompute: bool = True, allow_sp: bool = True,
                ) -> dict[tuple[int, int], list[Mode]]:
    """Per stage, the modes it may take, fastest first by the stage cost model (``stage_step``: forward
    plus backward of one micro-batch; of equal times the one holding more memory, as listed): every
    recomputation mode, each with and without sequence parallelism where offered (``sp_applies``: TP > 1,
    the sequence splits over the TP ranks, the plan's runtime runs it). The same modes the search's
    splits price (``CostBook.modes``)."""
    job = StageJob.of_plan(plan, None)
    rcs = RECOMPUTE_ORDER if allow_recompute else (Recompute.NONE,)
    out: dict[tuple[int, int], list[Mode]] = {}
    # Replicas' stages differ only in their devices: one answer per stage shape (its fields, read as they
    # are; TP is the device count over CP), off the reference path.
    seen: dict[tuple, list[Mode]] = {}
    for pi, p in enumerate(plan.pipelines):
        for si, s in enumerate(p.stages):
            shape = (s.kind, len(s.devices), s.cp, s.layers, s.chunks, s.embedding, s.head, s.sequence_parallel,
                     p.micro_batch_size)
            if (hit := seen.get(shape)) is not None and not reference():
                out[(pi, si)] = hit
                continue
            offered = allow_recompute and allow_sp and sp_applies(tp=s.tp, seq_len=plan.seq_len, cp=s.cp,
                                                                  runtime=plan.runtime)
            sps = (False, True) if offered else (s.sequence_parallel,)
            kind = plan.cluster.kinds[s.kind]
            key = (id(plan.model), id(kind), plan.seq_len, job.precisions[s.kind], job.attentions[s.kind], job.runtime,
                   s.num_layers, s.embedding, s.head, s.tp, s.cp, p.micro_batch_size, rcs, sps)

            def order(s=s, kind=kind, mbs=p.micro_batch_size, sps=sps) -> list[Mode]:
                cands = [(rc, sp) for rc in rcs for sp in sps]
                times = [stage_step(job, kind, layers=s.num_layers, embedding=s.embedding, head=s.head, tp=s.tp,
                                    mbs=mbs, recompute=rc, sp=sp, cp=s.cp) for rc, sp in cands]
                return [m for _, _, m in sorted((t.fwd_s + t.bwd_s, i, m) for i, (t, m) in
                                                enumerate(zip(times, cands, strict=True)))]
            out[(pi, si)] = seen[shape] = _ORDERS.get(key, order, pin=(plan.model, kind))
    return out


class ModeFits:
    """Per mode, whether each stage fits with every stage in that mode (``StageFits``), found once per
    mode asked; with SP the plan's stages where it applies run sequence-parallel (what their memory and
    their messages' sizes depend on)."""

    def __init__(self, plan: Plan, mem_headroom: float) -> None:
        self.plan, self.mem_headroom = plan, mem_headroom
        self._fits: dict[tuple[bool, bool], StageFits] = {}
        self._under: dict[Mode, dict[tuple[int, int], bool]] = {}
        self._refused: dict[Mode, set[tuple[int, int]]] = {}
        self._alone: dict[tuple[Mode, int, int], bool] = {}  # `fits`' answers by mode, twin pipeline and stage

    def __call__(self, mode: Mode, asked: Collection[tuple[int, int]] | None = None) -> dict[tuple[int, int], bool]:
        """Per stage (of ``asked``; None: all, kept per mode): whether it fits with every stage in ``mode``."""
        hit = self._under.get(mode)
        if hit is None:
            # The point-to-point buffers at their closed-form bound first (PlanCosts.stage_shape): a
            # stage that fits so fits exactly, and the exact replay runs only where one does not.
            hit = self._stage_fits(mode[1], bound=True).under(mode[0], asked=asked)
            if not all(hit.values()):
                hit = self._stage_fits(mode[1], bound=False).under(mode[0], asked=asked)
            if asked is None:
                self._under[mode] = hit
        return hit

    def fits(self, mode: Mode, sid: tuple[int, int]) -> bool:
        """``self(mode)[sid]``, found only as far as it is read (off the reference path): a stage a floor
        ``refused`` does not fit; without a sharded optimizer a stage's memory is its own, so only its
        exact buffers are replayed, where their bound does not fit (a stage that fits with the bound fits
        with the exact bytes, as ``__call__`` relies on)."""
        if reference():
            return self(mode)[sid]
        if sid in self.refused(mode):
            return False
        if self.plan.sharded_optimizer:
            return self(mode)[sid]
        bound = self._stage_fits(mode[1], bound=True)
        key = (mode, bound.twins[sid[0]], sid[1])  # a stage's memory is its twin's (StageFits.under)
        hit = self._alone.get(key)
        if hit is None:
            hit = self._alone[key] = (bound.under(mode[0], asked=(sid,))[sid]
                                      or self._stage_fits(mode[1], bound=False).under(mode[0], asked=(sid,))[sid])
        return hit

    def refused(self, mode: Mode) -> set[tuple[int, int]]:
        """The stages a floor under their memory with every stage in ``mode`` (``StageFits.over``, which no
        other stage's mode changes) proves over it, so ``self(mode)`` says they do not fit: a proven
        refusal that spares the exact check where it settles every stage asking ``mode`` (found once
        per mode; none on the reference path: memo.py)."""
        hit = self._refused.get(mode)
        if hit is None:
            everyone = [(pi, si) for pi, p in enumerate(self.plan.pipelines) for si in range(len(p.stages))]
            hit = self._refused[mode] = (set() if reference() else
                                         self._stage_fits(mode[1], bound=True).over(mode[0], asked=everyone))
        return hit

    def hopeless(self, modes: dict[tuple[int, int], list[Mode]]) -> bool:
        """Whether a stage (a key of ``modes``) is ``refused`` under each of its ``modes``, so no mode
        fits it: a proven screen that spares the exact checks of every mode (off on the reference path)."""
        left = set() if reference() else set(modes)  # those over under every mode asked so far
        for m in sorted({m for sid in left for m in modes[sid]}):
            asked = [sid for sid in left if m in modes[sid]]
            over = self._stage_fits(m[1], bound=True).over(m[0], asked=asked) if asked else set()
            left.difference_update(sid for sid in asked if sid not in over)
            if not left:
                return False
        return bool(left)

    def _stage_fits(self, sp: bool, *, bound: bool) -> StageFits:
        hit = self._fits.get((sp, bound))
        if hit is not None:
            return hit
        other = self._fits.get((sp, not bound))
        if other is not None:  # the bound's and the exact buffers' checks of one plan share its costs and twins
            hit = self._fits[(sp, bound)] = other.with_bound(bound)
            return hit
        plan = self.plan
        flags = [[sp and sp_applies(tp=s.tp, seq_len=plan.seq_len, cp=s.cp, runtime=plan.runtime) for s in p.stages]
                 for p in plan.pipelines]
        if any(s.sequence_parallel != f for p, fs in zip(plan.pipelines, flags, strict=True)
               for s, f in zip(p.stages, fs, strict=True)):
            plan = replace(plan, pipelines=tuple(replace(p, stages=tuple(
                in_mode(s, s.recompute, f)
                for s, f in zip(p.stages, fs, strict=True))) for p, fs in zip(plan.pipelines, flags, strict=True)))
        # Both SP modes' plans set a stage's SP by its own TP and CP degrees, so their twins are one another's,
        # and ZeRO-2/3's held bytes do not read SP: the second plan's checks take the first's.
        first = next(iter(self._fits.values()), None)
        hit = self._fits[(sp, bound)] = StageFits(plan, mem_headroom=self.mem_headroom, p2p_bound=bound,
                                                  twins=first and first.twins,
                                                  held=first.held if first else zero23_held(plan))
        return hit
