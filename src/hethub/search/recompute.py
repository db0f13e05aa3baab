"""Per-stage recomputation of a laid-out plan: the cheapest mode that fits each stage's memory.

The closed-form search (split.py) prices a stage with and without full recomputation, as its layer
splits and bounds were built for. Selective recomputation (only the attention core, Korthikanti et
al. 2022) sits between the two in memory and time, so once a plan's layout is fixed every stage
takes the first of none, selective, full whose predicted peak fits (``predict``'s memory model with
the plan's real gradient-sync shape, which the search does not know: replicas of different TP
degrees add full-size gradient copies). Backward time only grows from none to selective to full,
and a stage's memory depends on no other stage's mode, so this is the per-stage optimum for the
layout. A stage that fits under no mode keeps its mode (the predictor then reports it).
"""

from __future__ import annotations

from dataclasses import replace

from hethub.plan import Plan, Recompute
from hethub.predict.memory import DEFAULT_MEM_HEADROOM
from hethub.predict.predictor import StageFits
from hethub.search.costs import RECOMPUTE_ORDER


def with_recompute(plan: Plan, mode: Recompute) -> Plan:
    """``plan`` with every stage recomputing ``mode``."""
    return replace(plan, pipelines=tuple(replace(p, stages=tuple(replace(s, recompute=mode) for s in p.stages))
                                         for p in plan.pipelines))


def choose_recompute(plan: Plan, *, allow_recompute: bool = True,
                     mem_headroom: float = DEFAULT_MEM_HEADROOM) -> Plan:
    """Each stage's fastest recomputation mode that fits its memory; without ``allow_recompute`` only
    ``none`` is tried. A stage that fits under no mode tried keeps its own."""
    modes = RECOMPUTE_ORDER if allow_recompute else (Recompute.NONE,)
    under = StageFits(plan, mem_headroom=mem_headroom).under
    fits = {m: under(m) for m in modes}
    pipes = []
    for pi, p in enumerate(plan.pipelines):
        stages = tuple(replace(s, recompute=next((m for m in modes if fits[m][(pi, si)]), s.recompute))
                       for si, s in enumerate(p.stages))
        pipes.append(replace(p, stages=stages))
    return replace(plan, pipelines=tuple(pipes))


def fits_some_mode(plan: Plan, *, allow_recompute: bool = True, mem_headroom: float = DEFAULT_MEM_HEADROOM) -> bool:
    """Whether every stage of ``plan`` fits its memory under some recomputation mode (what
    ``choose_recompute`` then picks), with the plan's real gradient-sync shape."""
    # Full recomputation first: it holds the fewest activations, so it alone usually settles it.
    modes = tuple(reversed(RECOMPUTE_ORDER)) if allow_recompute else (Recompute.NONE,)
    ok: dict[tuple[int, int], bool] = {}
    under = StageFits(plan, mem_headroom=mem_headroom).under
    for m in modes:
        for key, fits in under(m).items():
            ok[key] = ok.get(key, False) or fits
        if all(ok.values()):
            return True
    return False
