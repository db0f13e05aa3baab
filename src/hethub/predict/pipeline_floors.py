"""Whether a laid-out plan fits some mode per stage (``stage_modes.fits_some_mode``), with each pipeline's
proof that a stage of it fits no mode (``ModeFits.hopeless``) kept between plans where it carries over:
the enumeration checks hundreds of candidates built from a few dozen pipelines, most of those that do
not fit because one such pipeline's stage cannot hold its parameters' mixed gradient buckets."""

from __future__ import annotations

from collections.abc import Sequence

from hethub.memo import reference
from hethub.plan import Pipeline, Plan
from hethub.predict.stage_modes import ModeFits, fits_some_mode, stage_modes
from hethub.schedules import get_schedule


def floor_keys(pipelines: Sequence[Pipeline], *, schedule: str, zero_stage: int) -> list[tuple] | None:
    """Per pipeline of a plan of ``pipelines`` (any devices: their count is read) under ``schedule`` and ZeRO
    ``zero_stage``, all that its stages' memory floors (``StageFits.over``) and modes depend on where each
    pipeline runs one TP degree, of at least two between them: its stages' fields, micro-batch size and
    in-flight counts. Every parameter unit then has holders of two TP degrees, so each stage syncs all of
    its parameters in mixed buckets (``plan_costs._sync_shape_rule``) whatever the other pipelines hold,
    and a pipeline with a stage over memory under every mode is so in every such plan of one job,
    sharding, headroom and modes. None for any other plan, under ZeRO-2/3 (their held bytes read every
    pipeline) and on the reference path (a shortcut: memo.py)."""
    tps = [{s.tp for s in p.stages} for p in pipelines]
    if (reference() or zero_stage >= 2 or any(len(t) != 1 for t in tps) or len(set().union(*tps)) < 2
            or any(p.virtual_stages > 1 for p in pipelines)):
        return None
    sched = get_schedule(schedule)
    return [(p.micro_batch_size, tuple(sched.in_flight(stage=si, num_stages=len(p.stages),
                                                       num_micro_batches=p.num_micro_batches)
                                       for si in range(len(p.stages))),
             tuple((s.kind, len(s.devices), s.layers, s.embedding, s.head, s.recompute, s.sequence_parallel, s.cp)
                   for s in p.stages)) for p in pipelines]


def fits_some_mode_kept(plan: Plan, hopeless: dict[tuple, bool], *, allow_recompute: bool, mem_headroom: float,
                        allow_sp: bool) -> bool:
    """``fits_some_mode(plan, ...)``. ``hopeless``: by `floor_keys`' key, whether a pipeline has a stage that fits
    no mode (filled here, kept by the caller for plans of one job, headroom and flags): where the plan has
    keys, one that says so answers it, and a key met first is proven on its pipeline's stages alone. Where none
    says so, no stage of the plan is hopeless (each pipeline's proof is its own), so ``fits_some_mode`` is asked
    without that screen, on the modes and checks the proofs used."""
    keys = floor_keys(plan.pipelines, schedule=plan.schedule, zero_stage=plan.zero_stage)
    if keys is None:
        return fits_some_mode(plan, allow_recompute=allow_recompute, mem_headroom=mem_headroom, allow_sp=allow_sp)
    if any(hopeless.get(k) for k in keys):
        return False
    modes = stage_modes(plan, allow_recompute=allow_recompute, allow_sp=allow_sp)
    fits = ModeFits(plan, mem_headroom)
    for pi, k in enumerate(keys):
        if k not in hopeless:
            hopeless[k] = fits.hopeless({sid: ms for sid, ms in modes.items() if sid[0] == pi})
    if any(hopeless[k] for k in keys):
        return False
    return fits_some_mode(plan, allow_recompute=allow_recompute, mem_headroom=mem_headroom, allow_sp=allow_sp,
                          orders=modes, fits=fits, screened=True)
