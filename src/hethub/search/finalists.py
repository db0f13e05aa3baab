"""The search's finalists: the plans of its best distinct candidates laid out, then scored with the
predictor (the step floor screening those that could not be among the first few). Used by the
planner's searches and the reference search alike."""

from __future__ import annotations

import bisect
from collections import Counter
from dataclasses import replace

from hethub.plan import Plan
from hethub.predict.host import HostModel
from hethub.predict.memory import DEFAULT_MEM_HEADROOM
from hethub.predict.plan_costs import PlanCosts
from hethub.predict.predictor import floor_reaches, predict
from hethub.predict.profiles import ProfileSet
from hethub.predict.result import Prediction
from hethub.search.assemble import build_plan
from hethub.search.config import PlannerConfig
from hethub.search.hetero import plan_key, size_key
from hethub.search.recompute import choose_recompute
from hethub.search.templates import Searcher


def finalist_plans(s: Searcher, ests: list, *, config: PlannerConfig, strategy: str, per_size: int = 0) -> list[Plan]:
    """The plans of the best `finalists + top_k` distinct candidates of `ests` (best first) and, with
    `per_size`, of the best `per_size` of each micro-batch size (hetero.Results says why)."""
    out, seen, taken = [], set(), Counter()
    keep = config.finalists + config.top_k
    for est in ests:
        key = plan_key(est)
        if key in seen:
            continue
        sizes = size_key(est) if per_size else ()
        if len(seen) >= keep and taken[sizes] >= per_size:
            continue
        seen.add(key)
        taken[sizes] += 1
        plan = build_plan(cluster=s.cluster, model=s.model, est=est, global_batch=config.global_batch,
                          seq_len=config.seq_len, schedule=config.schedule, precision=config.precision,
                          strategy=strategy)
        if config.optimizer_sharding == "zero1":  # before the recomputation choice, which it frees memory for
            plan = replace(plan, optimizer_sharding="zero1", optimizer_shares=config.optimizer_shares)
        out.append(choose_recompute(plan, allow_recompute=config.allow_recompute, mem_headroom=config.mem_headroom))
        if len(seen) >= keep and not per_size:
            break
    return out


def score_plans(plans: list[Plan], profiles: ProfileSet | None, *, headroom: float = DEFAULT_MEM_HEADROOM,
           require_fit: bool = True, host: HostModel | None = None, keep: int = 0) -> list[tuple[Plan, Prediction]]:
    """`plans` predicted, those that fit (all with ``require_fit=False``), fastest first. With ``keep``,
    a plan whose step floor (predictor.floor_reaches) is not below the keep-th fastest so far is not
    predicted: it could not be among the first ``keep`` (on a tie the earlier plan sorts first), so
    those are exactly the unscreened ones; the rest of the list may then lack such plans."""
    scored: list[tuple[Plan, Prediction]] = []
    steps: list[float] = []  # the fastest `keep` predicted steps so far, sorted
    costs = None
    for plan in plans:
        if keep and host is None and len(steps) >= keep:
            costs = PlanCosts(plan, profiles) if costs is None else costs  # one job: stage costs are shared
            if floor_reaches(plan, steps[keep - 1], costs=costs):
                continue
        pred = predict(plan, profiles=profiles, host=host, mem_headroom=headroom)
        if pred.fits_memory or not require_fit:
            scored.append((plan, pred))
            if keep:
                bisect.insort(steps, pred.step_time_s)
                del steps[keep:]
    scored.sort(key=lambda x: x[1].step_time_s)
    return scored
