"""Local search with the full predictor around the best plan.

The closed form ranks whole plans well but cannot see every detail of the event simulation (with
few micro-batches, which stage holds the last layer matters). Starting from the predictor's best,
we move one layer across each stage boundary, or one micro-batch between pipelines, applying each
move to all identical pipelines at once, and keep any move the predictor likes, within a budget.
"""

from __future__ import annotations

import time
from dataclasses import replace

from hethub.plan import Pipeline, Plan
from hethub.predict.memory import USABLE_FRACTION, in_flight_micro_batches, stage_memory
from hethub.predict.predictor import predict
from hethub.predict.profiles import ProfileSet
from hethub.predict.result import Prediction


def polish(plan: Plan, pred: Prediction, *, profiles: ProfileSet | None, budget_s: float,
           allow_recompute: bool) -> tuple[Plan, Prediction]:
    deadline = time.perf_counter() + budget_s
    improved = True
    while improved and time.perf_counter() < deadline:
        improved = False
        for cand in _neighbours(plan, allow_recompute=allow_recompute):
            if time.perf_counter() >= deadline:
                break
            p = predict(cand, profiles=profiles)
            if p.fits_memory and p.step_time_s < pred.step_time_s * (1 - 1e-9):
                plan, pred, improved = cand, p, True
                break
    return plan, pred


def _signature(p: Pipeline) -> tuple:
    return (p.micro_batch_size, tuple((s.kind, s.tp, s.layers) for s in p.stages))


def _neighbours(plan: Plan, *, allow_recompute: bool):
    sigs = list(dict.fromkeys(_signature(p) for p in plan.pipelines))
    for sig in sigs:
        ref = next(p for p in plan.pipelines if _signature(p) == sig)
        counts = [s.num_layers for s in ref.stages]
        n = len(counts)
        for b in range(n - 1):
            for src, dst in ((b, b + 1), (b + 1, b)):
                low = 0 if src in (0, n - 1) else 1
                if counts[src] - 1 < low:
                    continue
                new = list(counts)
                new[src] -= 1
                new[dst] += 1
                pipes = []
                for p in plan.pipelines:
                    q = _resplit(plan, p, new, allow_recompute=allow_recompute) if _signature(p) == sig else p
                    if q is None:
                        break
                    pipes.append(q)
                else:
                    yield replace(plan, pipelines=tuple(pipes))
    # One micro-batch from one pipeline to another of a different kind of pipeline.
    firsts = {}
    for i, p in enumerate(plan.pipelines):
        firsts.setdefault(_signature(p), i)
    idx = list(firsts.values())
    for a in idx:
        for b in idx:
            if a != b and plan.pipelines[a].num_micro_batches > 1:
                pipes = list(plan.pipelines)
                pipes[a] = replace(pipes[a], num_micro_batches=pipes[a].num_micro_batches - 1)
                pipes[b] = replace(pipes[b], num_micro_batches=pipes[b].num_micro_batches + 1)
                yield replace(plan, pipelines=tuple(pipes))


def _resplit(plan: Plan, p: Pipeline, counts: list[int], *, allow_recompute: bool) -> Pipeline | None:
    stages, start = [], 0
    for i, (s, k) in enumerate(zip(p.stages, counts, strict=True)):
        in_flight = in_flight_micro_batches(schedule=plan.schedule, stage_index=i, num_stages=len(counts),
                                            num_micro_batches=p.num_micro_batches)
        cap = plan.cluster.kinds[s.kind].mem_bytes * USABLE_FRACTION
        for rc in (False, True) if allow_recompute else (False,):
            mem = stage_memory(plan.model, layers=k, embedding=s.embedding, head=s.head, tp=s.tp,
                               mbs=p.micro_batch_size, seq_len=plan.seq_len, recompute=rc, precision=plan.precision,
                               in_flight=in_flight)
            if mem.total_bytes <= cap:
                stages.append(replace(s, layers=(start, start + k), recompute=rc))
                break
        else:
            return None
        start += k
    return replace(p, stages=tuple(stages))

