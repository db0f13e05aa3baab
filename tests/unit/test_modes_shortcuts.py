"""The modes' shortcuts change no answer: `modes_floor_s` with one floor per distinct pipeline (replicas
found once) and ``orders`` given equals the plain per-stage walk written out here, and `choose_modes`,
which gives back a pipeline (a plan) whose stages keep their modes as itself, chooses the plan the
reference path (a copy each time) does, on the candidates a search lays out with their stages' own
modes drawn at random."""

from __future__ import annotations

import random
from dataclasses import replace

from conftest import laid_out_layouts
from hethub.memo import reference_path
from hethub.plan import Plan, Recompute
from hethub.predict.plan_costs import PlanCosts
from hethub.predict.predictor import pipeline_floor_s
from hethub.predict.stage_modes import ModeFits, choose_modes, modes_floor_s, stage_modes
from hethub.schedules import get_schedule


def _plain_floor_s(plan: Plan, *, costs: PlanCosts, fits: ModeFits | None, **modes: bool) -> float:
    """`modes_floor_s` as a walk of every stage of every pipeline, each pipeline's floor found anew."""
    orders = stage_modes(plan, **modes)
    drain, best = not get_schedule(plan.schedule).split_backward, 0.0
    for pi, p in enumerate(plan.pipelines):
        if p.virtual_stages > 1:
            continue
        fwd, bwd = [], []
        for si, s in enumerate(p.stages):
            own, order = (s.recompute, s.sequence_parallel), orders[(pi, si)]
            ahead = order[:order.index(own)] if own in order else order
            kept = [own, *(m for m in order if m not in ahead or fits is None or (pi, si) not in fits.refused(m))]
            by_mode = {m: costs.stage_cost(kind=s.kind, layers=s.num_layers, embedding=s.embedding, head=s.head,
                                           tp=s.tp, mbs=p.micro_batch_size, recompute=m[0], sp=m[1], cp=s.cp)
                       for m in kept}
            least = replace(by_mode[own], fwd_s=min(c.fwd_s for c in by_mode.values()),
                            bwd_s=min(c.bwd_s for c in by_mode.values()))
            t = costs.with_ring(s, least, mbs=p.micro_batch_size, layers=s.num_layers)
            fwd.append(t.fwd_s)
            bwd.append(t.bwd_s)
        best = max(best, pipeline_floor_s(fwd, bwd, num_micro_batches=p.num_micro_batches, drain=drain))
    return best


def _drawn(plan: Plan, rng: random.Random, *, replicas_alike: bool) -> Plan:
    """``plan`` with its stages' modes drawn at random (``replicas_alike``: the same draw for each stage
    place of every pipeline, so replicas stay equal)."""
    draw: dict[tuple, tuple[Recompute, bool]] = {}

    def mode(si: int, st) -> tuple[Recompute, bool]:
        key = (si, st.kind, st.tp) if replicas_alike else (object(),)
        return draw.setdefault(key, (rng.choice(list(Recompute)), st.tp > 1 and rng.random() < 0.5))

    return replace(plan, pipelines=tuple(replace(p, stages=tuple(
        replace(st, recompute=mode(si, st)[0], sequence_parallel=mode(si, st)[1]) for si, st in enumerate(p.stages)))
        for p in plan.pipelines))


def test_modes_shortcuts_equal_the_plain_walk(monkeypatch):
    laid = laid_out_layouts(monkeypatch, global_batch=256)
    assert laid
    rng, replicated, kept_whole = random.Random(11), 0, 0
    for plan, k in laid[::2]:
        modes = dict(allow_recompute=k["allow_recompute"], allow_sp=k["allow_sp"])
        replicated += len(plan.pipelines) > 1
        for pre in (plan, _drawn(plan, rng, replicas_alike=True),
                    *(_drawn(plan, rng, replicas_alike=False) for _ in range(3))):
            for tight in (False, True):
                fits = ModeFits(pre, k["mem_headroom"]) if tight else None
                want = _plain_floor_s(pre, costs=PlanCosts(pre, None), fits=fits, **modes)
                fits = ModeFits(pre, k["mem_headroom"]) if tight else None
                got = modes_floor_s(pre, costs=PlanCosts(pre, None), fits=fits, orders=stage_modes(pre, **modes),
                                    **modes)
                assert got == want
            with reference_path():
                plain = choose_modes(pre, **k)
            fits = ModeFits(pre, k["mem_headroom"])
            chosen = choose_modes(pre, fits=fits, orders=stage_modes(pre, **modes), **k)
            assert chosen == plain
            kept_whole += chosen.plan is pre
    assert replicated and kept_whole  # replicas and unchanged plans were met
