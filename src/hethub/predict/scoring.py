"""Predicting many plans of one job for their fastest few (the planner's finalists, each kind's part of
its bound, a baseline's layouts): a plan whose step floor (``predictor.floor_reaches``, tight) cannot
enter what its readers keep is not predicted, and what they keep is exactly what an unscreened
scoring would give them (``Screen``), in whichever order the plans are predicted (``in_floor_order``:
the plans with the least floors first, so that the bar falls soonest)."""

from __future__ import annotations

import bisect
import heapq
import math
from collections.abc import Callable, Hashable, Iterable, Iterator
from dataclasses import dataclass, field

from hethub.memo import reference
from hethub.plan import Plan
from hethub.predict.host import HostModel
from hethub.predict.memory import DEFAULT_MEM_HEADROOM
from hethub.predict.plan_costs import PlanCosts
from hethub.predict.predictor import floor_reaches, floor_steps, predict
from hethub.predict.profiles import ProfileSet
from hethub.predict.result import Prediction


@dataclass
class Firsts:
    """The best plan of each of the first ``n`` distinct keys among the plans scored through it (``key``
    of a plan; None: each plan its own key, so the first ``n`` plans): what a reader of plans past a
    schedule's first few needs exact (the planner's notes read each variant's best, its interleaved
    starts more). One may be shared by several calls, whose plans then count together."""

    n: int
    key: Callable[[Plan], Hashable] | None = None
    best: dict[Hashable, float] = field(default_factory=dict)  # each key's best predicted step

    def bar(self, plan: Plan) -> float:
        """A step at or over which ``plan`` is none of these (a tie sorts the earlier plan first)."""
        bests = sorted(self.best.values())
        out = bests[self.n - 1] if len(bests) >= self.n else math.inf
        if self.key is not None and (k := self.key(plan)) in self.best:
            out = min(out, self.best[k])  # not its key's best
        return out

    def add(self, plan: Plan, step_s: float) -> None:
        k = len(self.best) if self.key is None else self.key(plan)
        self.best[k] = min(step_s, self.best.get(k, math.inf))


def sharding_of(plan: Plan) -> str:
    """A plan's optimizer sharding: the key of a `Firsts` keeping each sharding's best (the planner's notes)."""
    return plan.optimizer_sharding


@dataclass
class Screen:
    """What a scoring keeps exact, and so the step a plan's floor must be below to be predicted.
    ``steps``: the fastest ``keep`` predicted steps of every call sharing the list (their plans compete:
    the first ``keep`` over them all are exact); ``firsts``: more plans kept exact for readers past
    those (a plan is screened only where it is none of them). Nothing is screened with a ``host``
    (its replay has no floor) or before ``keep`` steps are known."""

    keep: int = 0
    host: HostModel | None = None
    steps: list[float] = field(default_factory=list)
    firsts: tuple[Firsts, ...] = ()

    def bar(self, plan: Plan) -> float:
        """The step ``plan``'s floor must be below to be predicted: a plan with a step at or over it is
        not among the first ``keep`` (a tie sorts the earlier plan first) nor any of ``firsts``."""
        if not self.keep or self.host is not None or len(self.steps) < self.keep:
            return math.inf
        return max([self.steps[self.keep - 1], *(f.bar(plan) for f in self.firsts)])

    def add(self, plan: Plan, step_s: float) -> None:
        """A predicted plan that fits (or counts) with its step."""
        if self.keep:
            bisect.insort(self.steps, step_s)
            del self.steps[self.keep:]
        for f in self.firsts:
            f.add(plan, step_s)


def score_plans(plans: Iterable[Plan], profiles: ProfileSet | None, *, headroom: float = DEFAULT_MEM_HEADROOM,
                require_fit: bool = True, host: HostModel | None = None, keep: int = 0,
                steps: list[float] | None = None, screen: Screen | None = None,
                in_floor_order: bool = False) -> list[tuple[Plan, Prediction]]:
    """`plans` predicted, those that fit (all with ``require_fit=False``), fastest first (a tie: the
    earlier in ``plans``). With ``keep``, a plan whose tight step floor is not below its ``screen``'s
    bar is not predicted: it could not be among the first ``keep`` nor the call's own firsts
    (``Screen``), so those are exactly the unscreened ones; the rest of the list may then lack such
    plans. ``steps``: the fastest predicted steps of earlier calls whose plans compete with these
    (updated in place); ``screen``: one built by the caller, who screens its layouts by the same bar
    (finalists.finalist_plans), instead of ``keep``, ``host`` and ``steps``. ``in_floor_order``: all
    of ``plans`` taken first and screened and predicted in the order of their floors (`_floor_order`),
    for a caller whose layouts read no bar before this call predicts (each variant's own firsts are
    unknown till then): its first predictions are then the plans likeliest to be kept, and the bar
    they set screens more of the rest. What is kept exact is the same in any order (off the
    reference path, a shortcut: memo.py; ``tests/unit/test_floor_order.py``)."""
    screen = Screen(keep, host, [] if steps is None else steps) if screen is None else screen
    scored: list[tuple[int, Plan, Prediction]] = []
    costs = None
    ordered = in_floor_order and screen.keep and screen.host is None and not reference()
    for i, plan in _floor_order(list(plans), profiles, screen) if ordered else enumerate(plans):
        if not ordered and (bar_s := screen.bar(plan)) < math.inf:
            costs = PlanCosts(plan, profiles) if costs is None else costs  # one job: stage costs are shared
            if floor_reaches(plan, bar_s, costs=costs, tight=True):
                continue
        pred = predict(plan, profiles=profiles, host=host, mem_headroom=headroom)
        if pred.fits_memory or not require_fit:
            scored.append((i, plan, pred))
            screen.add(plan, pred.step_time_s)
    scored.sort(key=lambda x: (x[2].step_time_s, x[0]))
    return [(plan, pred) for _, plan, pred in scored]


def _floor_order(plans: list[Plan], profiles: ProfileSet | None, screen: Screen) -> Iterator[tuple[int, Plan]]:
    """The ``plans`` (each with its place) that ``floor_reaches`` (tight) does not screen at the bar
    ``screen`` has when each is given, by their tight floors and then their places. A plan's floors
    (``predictor.floor_steps``) are found one at a time as the order reaches it, least first (a heap of
    each plan's most floor so far), and a plan is dropped at the first that reaches the bar, as
    ``floor_reaches`` drops it, so that one the bar screens by a cheap floor is not simulated. The
    caller predicts each as given, which lowers the bar."""
    if not plans:
        return
    costs = PlanCosts(plans[0], profiles)  # one job: stage costs are shared
    steps = [floor_steps(plan, costs=costs, tight=True) for plan in plans]
    heap = [(next(f), i) for i, f in enumerate(steps)]
    heapq.heapify(heap)
    while heap:
        floor_s, i = heapq.heappop(heap)
        if floor_s >= screen.bar(plans[i]):
            continue  # floor_reaches' answer at this bar
        if (after := next(steps[i], None)) is None:
            yield i, plans[i]
        else:  # the most of its floors so far: at the bar as floor_reaches reads them all
            heapq.heappush(heap, (max(floor_s, after), i))
