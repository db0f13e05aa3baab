"""Local search with the full predictor around the best plan.

The closed form ranks whole plans well but cannot see every detail of the event simulation (with
few micro-batches, which stage holds the last layer matters). Starting from the predictor's best,
we move one layer across each stage boundary, or one micro-batch between pipelines, applying each
move to all identical pipelines at once, and keep any move the predictor likes, within a budget of
predictions. Also the interleaved schedule's chunks per pipeline, chosen the same way.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from hethub.plan import Pipeline, Plan, Recompute, interleave, split_evenly
from hethub.predict.host import HostModel
from hethub.predict.memory import DEFAULT_MEM_HEADROOM, usable_bytes
from hethub.predict.plan_costs import PlanCosts
from hethub.predict.predictor import floor_reaches, predict
from hethub.predict.profiles import ProfileSet
from hethub.predict.result import Prediction
from hethub.predict.stage_cost import StageJob, StageModel
from hethub.schedules import get_schedule
from hethub.search.split import recompute_options


def polish(plan: Plan, pred: Prediction, *, profiles: ProfileSet | None, budget: int,
           allow_recompute: bool, host: HostModel | None = None,
           mem_headroom: float = DEFAULT_MEM_HEADROOM) -> tuple[Plan, Prediction]:
    """First-improvement local search. After a move is taken, the next round starts at that same
    move (moving another layer the same way often helps again) and goes round the others from
    there, instead of re-trying from the first ones, which just failed: fewer predictions per step,
    which matters because the budget, not the local optimum, usually ends the search on large plans.
    A move whose step floor (predictor.floor_reaches: the stage costs' floor without simulation,
    then that plus the exact sync tail) is already not below the current step cannot be taken, so
    it is not predicted. ``budget``: the predictions it may make,
    so the same plan comes out however busy the machine is."""
    costs = PlanCosts(plan, profiles) if host is None else None  # stage costs: every move keeps the job
    # Each stage shape's recomputation choice (_resplit), for every move: a move changes two stages'
    # shapes and keeps the job, so the rest are asked again and again.
    modes: dict[tuple, Recompute | None] = {}
    start, improved = 0, True
    while improved and budget > 0:
        improved = False
        moves = _moves(plan)
        for j in range(len(moves)):
            if budget <= 0:
                break
            i = (start + j) % len(moves)
            cand = _apply(plan, moves[i], allow_recompute=allow_recompute, headroom=mem_headroom, memo=modes)
            if cand is None:
                continue
            if costs is not None and floor_reaches(cand, pred.step_time_s * (1 - 1e-9), costs=costs):
                continue
            p = predict(cand, profiles=profiles, host=host, mem_headroom=mem_headroom)
            budget -= 1
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
        if plan.pipelines[a].num_micro_batches <= 1 or plan.zero_stage >= 2:  # ZeRO-2/3: equal counts
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
        key = (s.kind, s.tp, s.embedding, s.head, k, in_flight, p.micro_batch_size, s.sequence_parallel, s.cp)
        if key not in memo:
            memo[key] = None
            kind = plan.cluster.kinds[s.kind]
            cap = usable_bytes(kind, headroom=headroom)
            for rc in recompute_options(allow_recompute):
                model = StageModel(job, kind, tp=s.tp, mbs=p.micro_batch_size, recompute=rc, capacity_bytes=cap,
                                   sp=s.sequence_parallel, cp=s.cp)
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


# ---- Choosing virtual stages: the interleaved schedule's v per pipeline, where it pays, under memory.
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
