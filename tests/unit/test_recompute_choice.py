"""The planner's per-stage recomputation: none, selective (the attention core only) or full, the
fastest that fits each stage's memory once the plan is laid out (layout_assemble.py)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from hethub.plan import Plan, Recompute
from hethub.predict.predictor import predict
from hethub.predict.stage_fits import stage_memory_fits
from hethub.predict.stage_modes import choose_recompute
from hethub.search.config import PlannerConfig
from hethub.search.planner import make_plan
from hethub.spec.cluster import load_cluster
from hethub.spec.model import get_model

CLUSTERS = Path(__file__).resolve().parents[2] / "examples" / "clusters"


def with_recompute(plan: Plan, mode: Recompute) -> Plan:
    """``plan`` with every stage recomputing ``mode``."""
    return replace(plan, pipelines=tuple(replace(p, stages=tuple(replace(s, recompute=mode) for s in p.stages))
                                         for p in plan.pipelines))


def _with_stage(plan: Plan, pi: int, si: int, mode: str) -> Plan:
    p = plan.pipelines[pi]
    stages = tuple(replace(s, recompute=mode) if i == si else s for i, s in enumerate(p.stages))
    return replace(plan, pipelines=tuple(replace(q, stages=stages) if i == pi else q
                                         for i, q in enumerate(plan.pipelines)))


def test_planner_picks_selective_where_it_fits_and_full_would_be_slower():
    # Llama-3-8B at 8k tokens on 16 A100 + 16 V100: the V100s run math attention (pre-Ampere), whose
    # s x s scores selective recomputation drops, so a V100 stage that cannot keep everything fits
    # with selective instead of full. (Batch 128: at 256 the op model fitted on Sailor's profiles
    # lays out a plan whose stages all need full recomputation.)
    r = make_plan(cluster=load_cluster(CLUSTERS / "a100-v100-32.toml"), model=get_model("llama-3-8b"),
                  config=PlannerConfig(global_batch=128, seq_len=8192, schedule="1f1b"))
    plan, pred = r.plan, r.prediction
    assert pred.fits_memory
    chosen = [(pi, si) for pi, p in enumerate(plan.pipelines) for si, s in enumerate(p.stages)
              if s.recompute is Recompute.SELECTIVE]
    assert chosen, [s.recompute for p in plan.pipelines for s in p.stages]
    by_stage = {(sp.pipeline, sp.stage): sp for sp in pred.stages}
    for pi, si in chosen:
        keep_all = _with_stage(plan, pi, si, "none")
        assert not stage_memory_fits(keep_all)[(pi, si)]  # it has to recompute something
        full = predict(_with_stage(plan, pi, si, "full"))
        slower = {(sp.pipeline, sp.stage): sp for sp in full.stages}[(pi, si)]
        assert slower.bwd_s > by_stage[(pi, si)].bwd_s
        assert full.step_time_s >= pred.step_time_s
    # Every stage takes the fastest mode that fits: choosing again changes nothing.
    assert choose_recompute(plan) == plan


def test_choose_recompute_takes_the_fastest_mode_that_fits_each_stage():
    cluster = load_cluster(CLUSTERS / "a100-v100-32.toml")
    r = make_plan(cluster=cluster, model=get_model("llama-3-8b"),
                  config=PlannerConfig(global_batch=256, seq_len=8192, schedule="1f1b"))
    everything_full = with_recompute(r.plan, Recompute.FULL)
    chosen = choose_recompute(everything_full)
    fits = {m: stage_memory_fits(with_recompute(r.plan, m)) for m in Recompute}
    # The override the planner uses instead of building each copy gives the copy's answer.
    assert len({tuple(f.values()) for f in fits.values()}) > 1  # the modes differ somewhere
    for m in Recompute:
        assert stage_memory_fits(everything_full, recompute=m) == fits[m]
    for pi, p in enumerate(chosen.pipelines):
        for si, s in enumerate(p.stages):
            first = next(m for m in (Recompute.NONE, Recompute.SELECTIVE, Recompute.FULL) if fits[m][(pi, si)])
            assert s.recompute is first
    assert predict(chosen).step_time_s <= predict(everything_full).step_time_s
    # Without recomputation allowed only "none" is chosen (where it fits; the others stay as they were).
    plain = choose_recompute(everything_full, allow_recompute=False)
    assert [[s.recompute for s in p.stages] for p in plain.pipelines] == [
        [Recompute.NONE if fits[Recompute.NONE][(pi, si)] else Recompute.FULL for si in range(len(p.stages))]
        for pi, p in enumerate(plain.pipelines)]
