"""The final local search with the full predictor around the best plans (docs/planner.md,
"Refinement": best improvement over layer, split, merge and micro-batch moves, every stage at the
fastest recomputation mode the predictor's exact memory allows, moves screened by the schedule's
closed form and confirmed by ``predict()``). The interleaved schedule's chunks: predict/interleave.py.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import replace

from hethub.memo import reference
from hethub.plan import Pipeline, Plan, Recompute, Stage
from hethub.predict.host import HostModel
from hethub.predict.interleave import pipeline_signature
from hethub.predict.memory import DEFAULT_MEM_HEADROOM
from hethub.predict.plan_costs import PlanCosts
from hethub.predict.predictor import floor_reaches, pipeline_floor_s, predict
from hethub.predict.profiles import ProfileSet
from hethub.predict.result import Prediction
from hethub.predict.stage_cost import StageStepCost
from hethub.predict.stage_modes import choose_recompute
from hethub.schedules import get_schedule
from hethub.search.config import TP_DEGREES

CONFIRM = 3  # predictions per batch of the screen's best: the best improving one of a batch is taken


def polish(plan: Plan, pred: Prediction, *, profiles: ProfileSet | None, budget: int,
           allow_recompute: bool, allow_sp: bool = True, host: HostModel | None = None,
           mem_headroom: float = DEFAULT_MEM_HEADROOM, tp_degrees: tuple[int, ...] = TP_DEGREES
           ) -> tuple[Plan, Prediction]:
    """Best-improvement local search from ``plan`` until no move improves its prediction or
    ``budget`` predictions (counted: the same plan however busy the machine) are spent. Each round
    screens every move lazily best-first: a moved stage counts without recomputation until its
    candidate's exact memory is checked. Plans whose step floor cannot beat the current step, or
    already predicted, are not predicted. Splits and merges keep to ``tp_degrees`` (the config's)."""
    costs = PlanCosts(plan, profiles)  # stage costs and hops: every move keeps the job
    seen: set[tuple] = {_key(plan)}
    while budget > 0:
        bar, found, tried = pred.step_time_s * (1 - 1e-9), [], 0
        sigs, times = [pipeline_signature(p) for p in plan.pipelines], [costs.closed_form_of(p) for p in plan.pipelines]
        lists = {sig: costs.pipeline_times(plan.pipelines[sigs.index(sig)]) for sig in set(sigs)}
        scored = ((_score(plan, sigs, times, move, costs, bar if host is None else float("inf"), lists), n, move, None)
                  for n, move in enumerate(_moves(plan, sigs, tp_degrees=tp_degrees)))
        heap = [x for x in scored if x[0] is not None]
        heapq.heapify(heap)
        while heap and budget > 0 and not (found and tried % CONFIRM == 0):
            _, n, move, cand = heapq.heappop(heap)
            if cand is None:  # screened optimistically: make it, with its exact modes, and screen it again
                cand = _apply(plan, move, allow_recompute=allow_recompute, allow_sp=allow_sp, headroom=mem_headroom)
                if cand is not None:
                    exact = [costs.closed_form_of(p) for p in cand.pipelines]
                    heapq.heappush(heap, (_score(cand, sigs, exact, None, costs), n, move, cand))
            elif _key(cand) not in seen:
                seen.add(_key(cand))
                if host is None and floor_reaches(cand, bar, costs=costs):
                    continue
                p = predict(cand, profiles=profiles, host=host, mem_headroom=mem_headroom)
                budget, tried = budget - 1, tried + 1
                if p.fits_memory and p.step_time_s < bar:
                    found.append((p.step_time_s, n, cand, p))
        if not found:
            return plan, pred
        _, _, plan, pred = min(found, key=lambda x: x[:2])
    return plan, pred


def _key(plan: Plan) -> tuple:
    return tuple((p.num_micro_batches, p.micro_batch_size, p.stages) for p in plan.pipelines)


def _moves(plan: Plan, sigs: Sequence[tuple] | None = None, *, tp_degrees: tuple[int, ...] = TP_DEGREES
           ) -> list[tuple]:
    """Per kind of pipeline (identical ones at once): a layer from any stage to any other, a stage split,
    two adjacent stages of one kind and TP merged (chunked or CP pipelines: none of these); a
    micro-batch from one kind of pipeline to another. ``sigs``: each pipeline's ``pipeline_signature``."""
    firsts: dict[tuple, int] = {}
    for i, sig in enumerate(sigs or [pipeline_signature(p) for p in plan.pipelines]):
        firsts.setdefault(sig, i)
    out: list[tuple] = [("modes",)]  # the plan as it is, each stage at the exact memory's fastest mode
    for sig, i in firsts.items():
        stages = plan.pipelines[i].stages
        if plan.pipelines[i].virtual_stages > 1 or any(s.cp > 1 for s in stages):
            continue
        n = len(stages)
        out += [("layer", sig, src, dst) for src in range(n) for dst in range(n) if src != dst]
        out += [("split", sig, si) for si in range(n) if stages[si].tp > 1 and stages[si].tp // 2 in tp_degrees]
        out += [("merge", sig, si) for si in range(n - 1)
                if (stages[si].kind, stages[si].tp) == (stages[si + 1].kind, stages[si + 1].tp)
                and 2 * stages[si].tp in tp_degrees]
    idx = list(firsts.values()) if plan.zero_stage < 2 else []  # ZeRO-2/3: equal micro-batch counts
    out += [("batch", a, b) for a in idx for b in idx if a != b]
    return out


def _reshaped(plan: Plan, p: Pipeline, move: tuple) -> Pipeline | None:
    """One pipeline of the moved kind with ``move`` made, the changed stages without recomputation
    (None where the move cannot be made)."""
    kind, si = move[0], move[2]
    rows: list[tuple[tuple[int, ...], int, Stage | None]] = [(s.devices, s.num_layers, s) for s in p.stages]
    if kind == "layer":  # (devices, layers, the stage kept or None)
        for i, d in ((si, -1), (move[3], 1)):
            rows[i] = (rows[i][0], rows[i][1] + d, None)
    elif kind == "split":
        devs, k, half = rows[si][0], rows[si][1], p.stages[si].tp // 2
        rows[si:si + 1] = [(devs[:half], k - k // 2, None), (devs[half:], k // 2, None)]
    else:
        devs, m = rows[si][0] + rows[si + 1][0], plan.model
        if len({plan.cluster.devices[d].node for d in devs}) > 1 or any(
                x % len(devs) for x in (m.num_heads, m.num_kv_heads, m.ffn_hidden_size)):
            return None
        rows[si:si + 2] = [(devs, rows[si][1] + rows[si + 1][1], None)]
    n, stages, start = len(rows), [], 0
    for i, (devs, k, st) in enumerate(rows):
        if k < (0 if i in (0, n - 1) else 1):
            return None
        st = st or Stage(plan.cluster.devices[devs[0]].kind, devs, (start, start + k), embedding=i == 0,
                         head=i == n - 1)
        stages.append(st if st.layers == (start, start + k) else replace(st, layers=(start, start + k)))
        start += k
    return replace(p, stages=tuple(stages))


def _apply(plan: Plan, move: tuple, *, allow_recompute: bool, headroom: float, allow_sp: bool = True) -> Plan | None:
    """``plan`` with ``move`` made and every stage at its fastest mode that fits the exact memory
    (None where the move cannot be made or a stage then fits under no mode)."""
    pipes: list[Pipeline | None] = list(plan.pipelines)
    if move[0] == "batch":
        a, b = move[1:]
        if plan.pipelines[a].num_micro_batches <= 1:
            return None
        for i, d in ((a, -1), (b, 1)):
            pipes[i] = replace(plan.pipelines[i], num_micro_batches=plan.pipelines[i].num_micro_batches + d)
    elif move[0] != "modes":
        pipes = [_reshaped(plan, p, move) if pipeline_signature(p) == move[1] else p for p in plan.pipelines]
    if None in pipes:
        return None
    return choose_recompute(replace(plan, pipelines=tuple(pipes)), allow_recompute=allow_recompute,
                            allow_sp=allow_sp, mem_headroom=headroom, strict=True)


def _moved_cost(costs: PlanCosts, ref: Pipeline, i: int, d: int) -> StageStepCost:
    """Stage ``i`` of ``ref`` with ``d`` layers more, priced without recomputation (`_score`'s layer moves)."""
    s = ref.stages[i]
    return costs.stage_cost(kind=s.kind, layers=s.num_layers + d, embedding=s.embedding, head=s.head, tp=s.tp,
                            mbs=ref.micro_batch_size, recompute=Recompute.NONE)


def _score(plan: Plan, sigs: Sequence[tuple], times: list[tuple[float, float]], move: tuple | None,
           costs: PlanCosts, bar_s: float = float("inf"), lists: dict | None = None) -> tuple | None:
    """The closed form's (slowest pipeline, sum) of ``plan`` with ``move`` made, the moved pipelines
    priced as their first with the moved stages not recomputing (``sigs``: the pipelines'
    ``pipeline_signature``; ``lists``: ``PlanCosts.pipeline_times`` of the first of each). None where the move
    cannot be made or the changed pipelines' step floor (without recomputation: below the floor with
    any mode) reaches ``bar_s``."""
    ts = [b + p.num_micro_batches * per for p, (b, per) in zip(plan.pipelines, times, strict=True)]
    if move is None or move[0] == "modes":
        return (max(ts), sum(ts))
    if move[0] == "batch":
        _, a, b = move
        ts[a], ts[b] = ts[a] - times[a][1], ts[b] + times[b][1]
        (fwd, bwd, _), most = costs.pipeline_times(plan.pipelines[b]), plan.pipelines[b].num_micro_batches + 1
    else:
        ref = plan.pipelines[sigs.index(move[1])]
        most = max(p.num_micro_batches for p, sig in zip(plan.pipelines, sigs, strict=True) if sig == move[1])
        if move[0] == "layer":  # two stages change: priced without new Stage objects
            if ref.stages[move[2]].num_layers - 1 < (0 if move[2] in (0, len(ref.stages) - 1) else 1):
                return None
            # The stage gaining a layer: its own term of the floor below (the fill and drain only add, in
            # monotone rounding) already reaching the bar refuses the move unpriced (a shortcut: memo.py).
            gain = _moved_cost(costs, ref, move[3], 1)
            if most * (gain.fwd_s + gain.bwd_s) * (1 - 1e-12) >= bar_s and not reference():
                return None
            fwd, bwd, hops = (list(x) for x in lists[move[1]])
            for i, c in ((move[2], _moved_cost(costs, ref, move[2], -1)), (move[3], gain)):
                fwd[i], bwd[i] = c.fwd_s, c.bwd_s
        elif (q := _reshaped(plan, ref, move)) is None:
            return None
        else:
            fwd, bwd, hops = costs.pipeline_times(q)
        base, per = costs.closed_form(fwd, bwd, hops)
        ts = [base + p.num_micro_batches * per if sig == move[1] else t
              for p, sig, t in zip(plan.pipelines, sigs, ts, strict=True)]
    drain = not get_schedule(plan.schedule).split_backward
    return None if pipeline_floor_s(fwd, bwd, num_micro_batches=most, drain=drain) >= bar_s else (max(ts), sum(ts))
