"""Local search with the full predictor around the best plan.

The closed form ranks whole plans well but cannot see every detail of the event simulation (with
few micro-batches, which stage holds the last layer matters). Starting from the predictor's best,
we move one layer across each stage boundary, or one micro-batch between pipelines, applying each
move to all identical pipelines at once, and keep any move the predictor likes, within a budget.
"""

from __future__ import annotations

import time
from dataclasses import replace

from hethub.plan import Pipeline, Plan, Recompute
from hethub.predict.host import HostModel
from hethub.predict.memory import DEFAULT_MEM_HEADROOM, usable_bytes
from hethub.predict.plan_costs import PlanCosts
from hethub.predict.predictor import floor_reaches, predict
from hethub.predict.profiles import ProfileSet
from hethub.predict.result import Prediction
from hethub.predict.stage_cost import StageJob, StageModel
from hethub.schedules import get_schedule
from hethub.search.costs import recompute_options


def polish(plan: Plan, pred: Prediction, *, profiles: ProfileSet | None, budget_s: float,
           allow_recompute: bool, host: HostModel | None = None,
           mem_headroom: float = DEFAULT_MEM_HEADROOM) -> tuple[Plan, Prediction]:
    """First-improvement local search. After a move is taken, the next round starts at that same
    move (moving another layer the same way often helps again) and goes round the others from
    there, instead of re-trying from the first ones, which just failed: fewer predictions per step,
    which matters because the budget, not the local optimum, usually ends the search on large plans.
    A move whose step floor (predictor.floor_reaches: the stage costs' floor, no simulation, ~1/20 of
    a prediction on 512 devices, then that plus the exact sync tail) is already not below the
    current step cannot be taken, so it is not predicted."""
    deadline = time.perf_counter() + budget_s
    costs = PlanCosts(plan, profiles) if host is None else None  # stage costs: every move keeps the job
    # Each stage shape's recomputation choice (_resplit), for every move: a move changes two stages'
    # shapes and keeps the job, so the rest are asked again and again.
    modes: dict[tuple, Recompute | None] = {}
    start, improved = 0, True
    while improved and time.perf_counter() < deadline:
        improved = False
        moves = _moves(plan)
        for j in range(len(moves)):
            if time.perf_counter() >= deadline:
                break
            i = (start + j) % len(moves)
            cand = _apply(plan, moves[i], allow_recompute=allow_recompute, headroom=mem_headroom, memo=modes)
            if cand is None:
                continue
            if costs is not None and floor_reaches(cand, pred.step_time_s * (1 - 1e-9), costs=costs):
                continue
            p = predict(cand, profiles=profiles, host=host, mem_headroom=mem_headroom)
            if p.fits_memory and p.step_time_s < pred.step_time_s * (1 - 1e-9):
                plan, pred, improved, start = cand, p, True, i
                break
    return plan, pred


def _signature(p: Pipeline) -> tuple:
    return (p.micro_batch_size, tuple((s.kind, s.tp, s.layers) for s in p.stages))


def _moves(plan: Plan) -> list[tuple]:
    """One layer across a stage boundary of one kind of pipeline (all identical ones at once), then
    one micro-batch from one kind of pipeline to another."""
    firsts: dict[tuple, int] = {}
    for i, p in enumerate(plan.pipelines):
        firsts.setdefault(_signature(p), i)
    out: list[tuple] = []
    for sig, i in firsts.items():
        n = len(plan.pipelines[i].stages)
        out += [("layer", sig, i, src, dst) for b in range(n - 1) for src, dst in ((b, b + 1), (b + 1, b))]
    idx = list(firsts.values())
    out += [("batch", a, b) for a in idx for b in idx if a != b]
    return out


def _apply(plan: Plan, move: tuple, *, allow_recompute: bool, headroom: float,
           memo: dict[tuple, Recompute | None] | None = None) -> Plan | None:
    """``plan`` with ``move`` made (None where it cannot be); ``memo``: as for :func:`_resplit`, shared
    by the moves of one plan's job."""
    if move[0] == "batch":
        _, a, b = move
        if plan.pipelines[a].num_micro_batches <= 1:
            return None
        pipes = list(plan.pipelines)
        pipes[a] = replace(pipes[a], num_micro_batches=pipes[a].num_micro_batches - 1)
        pipes[b] = replace(pipes[b], num_micro_batches=pipes[b].num_micro_batches + 1)
        return replace(plan, pipelines=tuple(pipes))
    _, sig, ref, src, dst = move
    counts = [s.num_layers for s in plan.pipelines[ref].stages]
    low = 0 if src in (0, len(counts) - 1) else 1
    if counts[src] - 1 < low:
        return None
    counts[src] -= 1
    counts[dst] += 1
    pipes, memo = [], {} if memo is None else memo
    for p in plan.pipelines:
        q = (_resplit(plan, p, counts, allow_recompute=allow_recompute, memo=memo, headroom=headroom)
             if _signature(p) == sig else p)
        if q is None:
            return None
        pipes.append(q)
    return replace(plan, pipelines=tuple(pipes))


def _resplit(plan: Plan, p: Pipeline, counts: list[int], *, allow_recompute: bool,
             memo: dict | None = None, headroom: float = DEFAULT_MEM_HEADROOM) -> Pipeline | None:
    """p with these layer counts, recomputing exactly where a stage does not fit otherwise. `memo`
    shares that decision among the identical pipelines a move changes together (and among the moves of
    one job: it depends on the stage's shape and the job only). Memory is judged as the planner does
    (predict.stage_cost.StageModel: synced, two neighbours); the predictor then checks the plan."""
    memo = {} if memo is None else memo
    schedule = get_schedule(plan.schedule)
    job = StageJob.of_plan(plan, None)
    stages, start = [], 0
    for i, (s, k) in enumerate(zip(p.stages, counts, strict=True)):
        in_flight = schedule.in_flight(stage=i, num_stages=len(counts), num_micro_batches=p.num_micro_batches)
        key = (s.kind, s.tp, s.embedding, s.head, k, in_flight, p.micro_batch_size)
        if key not in memo:
            memo[key] = None
            kind = plan.cluster.kinds[s.kind]
            cap = usable_bytes(kind, headroom=headroom)
            for rc in recompute_options(allow_recompute):
                model = StageModel(job, kind, tp=s.tp, mbs=p.micro_batch_size, recompute=rc, capacity_bytes=cap)
                if model.memory(k, emb=s.embedding, head=s.head, in_flight=in_flight).total_bytes <= cap:
                    memo[key] = rc
                    break
        mode = memo[key]
        if mode is None:
            return None
        # A move changes two stages; the others are kept as they are (replace() is slow).
        layers = (start, start + k)
        stages.append(s if s.layers == layers and s.recompute == mode else replace(s, layers=layers, recompute=mode))
        start += k
    return replace(p, stages=tuple(stages))
