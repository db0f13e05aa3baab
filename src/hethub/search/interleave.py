"""Choosing virtual stages: the interleaved schedule's v per pipeline, where it pays, under memory.

Interleaving splits each stage's layers into v chunks (laid out in virtual-stage order,
``hethub.plan.interleave``) and runs the interleaved schedule. It shrinks the fill and drain by v
(the closed form in ``hethub.schedules.interleaved``) at the price of v times the point-to-point
hops and more activations in flight. The planner (``make_plan`` with schedule ``interleaved``)
weighs two sets of candidates with the full predictor:

* its best plans under 1F1B, where for each group of identical pipelines it tries v = 2, 3, 4, 6, 8
  (each chunk at least one layer, m >= p: the closed form's domain), keeping the v whose whole plan
  is fastest with every device within its memory; v = 1 is 1F1B itself, so this is never slower than
  the 1F1B plan. A 1F1B plan sized to the brim of memory rarely takes more activations, so:
* plans searched with stages sized for v chunks (v = 2, one more search: the split's memory holds the
  interleaved in-flight count and its closed form prices the shorter fill), laid out in v chunks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from hethub.plan import Pipeline, Plan, interleave, split_evenly
from hethub.predict.host import HostModel
from hethub.predict.predictor import predict
from hethub.predict.profiles import ProfileSet
from hethub.predict.result import Prediction

CHUNK_CHOICES = (2, 3, 4, 6, 8)


def _shape(p: Pipeline) -> tuple:
    return (p.micro_batch_size, p.num_micro_batches, tuple((s.kind, s.tp, s.num_layers, s.recompute) for s in p.stages))


def chunk_choices(p: Pipeline) -> tuple[int, ...]:
    """The v a pipeline may take: up to its largest stage's layer count (a stage with fewer layers
    than v has empty chunks, which pass their input on), at least as many micro-batches as stages,
    two or more stages."""
    n = len(p.stages)
    if n < 2 or p.num_micro_batches < n:
        return ()
    most = max(s.num_layers for s in p.stages)
    return tuple(v for v in CHUNK_CHOICES if v <= most)


def with_chunks(p: Pipeline, v: int) -> Pipeline:
    """``p`` with each stage's layers in v chunks as equal as can be, the smaller ones first (the
    warm-up holds mostly early chunks' activations; v = 1: plain layers)."""
    return interleave(p, [split_evenly(s.num_layers, v)[::-1] for s in p.stages])


def fits(pred: Prediction) -> bool:
    return all(sp.fits for sp in pred.stages)


def interleave_plan(plan: Plan, pred: Prediction, *, profiles: ProfileSet | None, host: HostModel | None,
                    mem_headroom: float) -> tuple[Plan, Prediction]:
    """``plan`` (made for 1F1B) under the interleaved schedule with the best v per group of identical
    pipelines (greedy, one group after another), and its prediction."""
    best = replace(plan, schedule="interleaved")
    best_pred = pred
    groups: dict[tuple, list[int]] = {}
    for pi, p in enumerate(plan.pipelines):
        groups.setdefault(_shape(p), []).append(pi)
    for members in groups.values():
        for v in chunk_choices(plan.pipelines[members[0]]):
            pipes = list(best.pipelines)
            for pi in members:
                pipes[pi] = with_chunks(plan.pipelines[pi], v)
            trial = replace(best, pipelines=tuple(pipes)).validate()
            tp = predict(trial, profiles=profiles, host=host, mem_headroom=mem_headroom)
            if fits(tp) and tp.step_time_s < best_pred.step_time_s:
                best, best_pred = trial, tp
    return best, best_pred


def chunks_note(plan: Plan) -> str:
    """'v 2, 2, 1' per pipeline, for notes and tables."""
    return "v " + ", ".join(str(p.virtual_stages) for p in plan.pipelines)


def interleave_all(scored: Sequence[tuple[Plan, Prediction]], *, profiles: ProfileSet | None,
                   host: HostModel | None, mem_headroom: float) -> list[tuple[Plan, Prediction]]:
    """Each candidate interleaved where it pays, best first."""
    out = [interleave_plan(plan, pred, profiles=profiles, host=host, mem_headroom=mem_headroom)
           for plan, pred in scored]
    return sorted(out, key=lambda x: x[1].step_time_s)


def chunked_candidates(scored: Sequence[tuple[Plan, Prediction]], v: int, *, profiles: ProfileSet | None,
                       host: HostModel | None, mem_headroom: float) -> list[tuple[Plan, Prediction]]:
    """Plans searched with stages sized for v chunks (``PlannerConfig.virtual_stages``), each pipeline
    laid out in v chunks where it can take them, kept where every device fits."""
    out = []
    for plan, _ in scored:
        pipes = tuple(with_chunks(p, v) if v in chunk_choices(p) else p for p in plan.pipelines)
        if all(p.virtual_stages == 1 for p in pipes):
            continue  # a 1F1B plan: the 1F1B search's to offer, not interleaving's
        trial = replace(plan, schedule="interleaved", pipelines=pipes).validate()
        pred = predict(trial, profiles=profiles, host=host, mem_headroom=mem_headroom)
        if fits(pred):
            out.append((trial, pred))
    return out
