"""The interleaved schedule's virtual stages (v model chunks per stage) on the planner's plans, where they
pay under memory: a 1F1B plan's best v per group of identical pipelines (`interleave_plan`, the planner's
refinement), and plans searched with stages sized for v chunks laid out in them (`chunked_candidates`, its
interleaved variants where that schedule is asked for). Plans and predictions only, so the search
(search/planner.py) imports them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from hethub.plan import Pipeline, Plan
from hethub.plan_parts import chunk_choices, with_chunks
from hethub.predict.host import HostModel
from hethub.predict.plan_costs import PlanCosts
from hethub.predict.predictor import may_fit_below, predict
from hethub.predict.profiles import ProfileSet
from hethub.predict.result import Prediction


def pipeline_signature(p: Pipeline) -> tuple:
    """What identical pipelines share: the micro-batch size and each stage's kind, TP degree, layers and chunks."""
    return (p.micro_batch_size, tuple((s.kind, s.tp, s.layers, s.chunks) for s in p.stages))


def interleave_plan(plan: Plan, pred: Prediction, *, profiles: ProfileSet | None, host: HostModel | None,
                    mem_headroom: float) -> tuple[Plan, Prediction]:
    """``plan`` (made for 1F1B) under the interleaved schedule with the best v per group of identical pipelines
    (greedy, one group after another; trials ``may_fit_below`` refuses are not predicted), and its prediction."""
    best, best_pred, costs = replace(plan, schedule="interleaved"), pred, PlanCosts(plan, profiles)
    groups: dict[tuple, list[int]] = {}
    for pi, p in enumerate(plan.pipelines):
        groups.setdefault((p.num_micro_batches, pipeline_signature(p), *(s.recompute for s in p.stages)), []).append(pi)
    for members in groups.values():
        for v in chunk_choices(plan.pipelines[members[0]]):
            pipes = tuple(with_chunks(q, v) if pi in members else b
                          for pi, (q, b) in enumerate(zip(plan.pipelines, best.pipelines, strict=True)))
            trial = replace(best, pipelines=pipes).validate()
            if not may_fit_below(trial, mem_headroom=mem_headroom, bar_s=best_pred.step_time_s, costs=costs, host=host):
                continue
            tp = predict(trial, profiles=profiles, host=host, mem_headroom=mem_headroom)
            if tp.fits_memory and tp.step_time_s < best_pred.step_time_s:
                best, best_pred = trial, tp
    return best, best_pred


def chunked_candidates(scored: Sequence[tuple[Plan, Prediction]], v: int, *, profiles: ProfileSet | None,
                       host: HostModel | None, mem_headroom: float) -> list[tuple[Plan, Prediction]]:
    """Plans searched with stages sized for v chunks (``PlannerConfig.virtual_stages``), each pipeline
    laid out in v chunks where it can take them, kept where every device fits (checked before predicting)."""
    out = []
    for plan, _ in scored:
        pipes = tuple(with_chunks(p, v) if v in chunk_choices(p) else p for p in plan.pipelines)
        if all(p.virtual_stages == 1 for p in pipes):
            continue  # a 1F1B plan: the 1F1B search's to offer, not interleaving's
        trial = replace(plan, schedule="interleaved", pipelines=pipes).validate()
        if may_fit_below(trial, mem_headroom=mem_headroom) and (
                pred := predict(trial, profiles=profiles, host=host, mem_headroom=mem_headroom)).fits_memory:
            out.append((trial, pred))
    return out
