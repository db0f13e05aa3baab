"""A slow reference search for tests and benchmarks: no truncation, no heuristic pruning.

`make_plan` keeps the top few templates per kind, scans stage counts with patience and spreads
mixed replica counts geometrically. This search enumerates, per micro-batch size, the whole of this
sub-space of the documented plan space (docs/planner.md):

* each kind either unused, or **any** of its kind-pure templates (every TP degree that fits, every
  stage count from 1 to the most that fit, every split variant `Searcher.splits` makes) replicated
  as often as the kind's devices allow (leftovers idle);
* plus at most one group of identical mixed pipelines over the kinds left unused: every subset of
  them (two or more), every order, every TP degree per kind, every stage count per kind and every
  replica count.

Candidates are priced in closed form (`combine.estimate`), the best `finalists` are scored with
`predict()` like the planner's; the only pruning is proven: a candidate whose allocation makespan
(or, for mixed pipelines, `bounds.pipe_floor`'s floor under it) cannot get among the finalists is
not priced (the step only adds syncs and updates to the makespan). It is exponential in the number
of kinds: use it on small instances (tests/unit/test_reference_search.py, bench/planner_reference.py).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from hethub.plan import Plan
from hethub.predict.profiles import ProfileSet
from hethub.predict.result import Prediction
from hethub.search.bounds import pipe_floor
from hethub.search.combine import Group, water_level
from hethub.search.config import PlannerConfig
from hethub.search.hetero import Results
from hethub.search.planner import _plans, _score
from hethub.search.split import PipeCost, Slot
from hethub.search.templates import Searcher
from hethub.spec.cluster import Cluster
from hethub.spec.model import ModelSpec


@dataclass(frozen=True)
class ReferenceResult:
    plan: Plan
    prediction: Prediction
    candidates: int  # closed-form candidates priced


def reference_plan(*, cluster: Cluster, model: ModelSpec, config: PlannerConfig,
                   profiles: ProfileSet | None = None) -> ReferenceResult | None:
    """The best plan of the space above under the predictor (None if nothing fits)."""
    s = Searcher(cluster=cluster, model=model, config=config, profiles=profiles)
    results = Results(config.finalists + config.top_k)
    kinds = list(s.counts)
    for mbs in config.usable_micro_batch_sizes:
        total = s.total_mb(mbs)
        pure = {k: _all_templates(s, k, mbs) for k in kinds}
        combos = []
        for choice in itertools.product(*[[None, *pure[k]] for k in kinds]):
            groups = [Group(p, s.counts[k] // p.num_devices) for k, p in zip(kinds, choice, strict=True)
                      if p is not None]
            unused = [k for k, p in zip(kinds, choice, strict=True) if p is None]
            if groups:
                combos.append((water_level(groups, total), groups))
            for segs, c in _mixed_options(s, unused):
                floor = pipe_floor(s.book, s.links, segs, mbs)
                if floor is not None:
                    combos.append((water_level([*groups, Group(floor, c)], total), (groups, segs, c)))
        combos.sort(key=lambda x: x[0])
        for level, item in combos:
            if not results.may_enter(level):
                break
            if isinstance(item, list):
                results.add(s.estimate(item, mbs))
                continue
            groups, segs, c = item
            for pipe in s.mixed(segs, mbs):
                gs = [*groups, Group(pipe, c)]
                if results.may_enter(water_level(gs, total)):
                    results.add(s.estimate(gs, mbs))
    results.items.sort(key=lambda e: e.step_time_s)
    scored = _score(_plans(s, results.items, config=config, strategy="reference"), profiles)
    if not scored:
        return None
    return ReferenceResult(plan=scored[0][0], prediction=scored[0][1], candidates=len(results.items))


def _all_templates(s: Searcher, kind: str, mbs: int) -> list[PipeCost]:
    out = []
    for tp in s.tps[kind]:
        for p in range(1, min(s.counts[kind] // tp, s.model.num_layers + 2) + 1):
            out += s.splits((Slot(kind, tp),) * p, mbs)
    return out


def _mixed_options(s: Searcher, kinds: list[str]) -> list[tuple[tuple, int]]:
    out = []
    for size in range(2, len(kinds) + 1):
        for subset in itertools.combinations(kinds, size):
            for tps in itertools.product(*[s.tps[k] for k in subset]):
                slots = [s.counts[k] // t for k, t in zip(subset, tps, strict=True)]
                for c in range(1, min(slots) + 1):
                    for ns in itertools.product(*[range(1, n // c + 1) for n in slots]):
                        if sum(ns) > s.model.num_layers + 2:
                            continue
                        for order in itertools.permutations(range(size)):
                            out.append((tuple((subset[i], tps[i], ns[i]) for i in order), c))
    return out
