"""The enumeration's kept candidates (search/hetero.py): every candidate priced, the best distinct ones the
planner builds and the best of each micro-batch size, each kept one's memory check run only where a decision
reads it (``memo.Later``, ``memo.Places``). Candidates are read as `predict/candidate_shapes` describes."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Generic, TypeVar

from hethub.memo import Later, Places
from hethub.predict.candidate_shapes import CandidateShape

C = TypeVar("C", bound=CandidateShape)


class Results(Generic[C]):
    """Every priced candidate, plus the `keep` best distinct ones (the planner builds only those) and,
    with `per_size`, the `per_size` best distinct ones of each micro-batch size (`size_key`).

    The closed form ranks candidates of different micro-batch sizes with errors of their own (its
    fill/drain and sync terms are not the predictor's event simulation), so the overall best few can
    all be of one size while a slightly lower-ranked size predicts faster; the per-size places let
    the predictor decide between sizes (without them allowing more sizes could give a worse plan
    than allowing one: tests/unit/test_finalists_per_size.py). Pruning (`may_enter`) still reads the
    overall kept ones only: the per-size places hold what the search priced anyway, so they cost
    predictions, not search. The first size searched (the smallest) is priced before any other size
    sets the bar, so its places hold exactly the finalists a search of that size alone would have;
    a later size's hold its best among those priced under the bar the earlier sizes set."""

    def __init__(self, keep: int, fits: Callable[[C], bool] | None = None, *, per_size: int = 0) -> None:
        self.items: list[C] = []
        self.checks: list[Later | None] = []  # per item: whether it fits, where it was kept when priced
        self.keep, self.per_size = keep, per_size
        self.fits = fits  # whether a candidate that would be kept fits memory laid out (Searcher.fits)
        self._best = Places(keep)  # (step, plan_key) of the best distinct so far
        self._by_size: dict[tuple[int, ...], Places] = {}  # the same per size_key

    def may_enter(self, step_lower_bound: float) -> bool:
        """Whether a candidate whose step is at least this could still be among the overall kept ones.
        The per-size places do not widen the pruning: a size's search runs to the overall bar only."""
        return self._best.enters(step_lower_bound, margin=1 + 1e-9)  # it covers allocate's bisection

    def add(self, est: C | None) -> None:
        if est is None or est.step_time_s == math.inf:
            return
        step, fit = est.step_time_s, None
        bucket = self._by_size.setdefault(size_key(est), Places(self.per_size)) if self.per_size else Places(0)
        overall, own = self._best.enters(step), bucket.enters(step)
        # finalists.finalist_plans's identity of a plan: identical candidates take one finalist place.
        if (overall or own) and not self._best.holds(key := plan_key(est)) and not bucket.holds(key):
            # Neither kept nor built: the pruning bar is the overall kept candidates', which fit (one
            # that does not is dropped). A candidate entering its size's places only sets no bar, so it
            # is not laid out here: the predictor drops it if it does not fit (while the smallest size
            # is searched, its places are the overall ones). The check runs when a decision reads it.
            fit = Later(functools.partial(self.fits, est)) if overall and self.fits is not None else None
            for places in [p for p, enters in ((self._best, overall), (bucket, own)) if enters]:
                places.insert(step, key, fit)
        self.items.append(est)
        self.checks.append(fit)

    def ranked(self, first: int | None = None) -> list[C]:
        """The priced candidates but those kept that do not fit, best first; with ``first``, only as
        far as the first ``first`` distinct plans (`plan_key`), whose checks alone are run."""
        out, seen = [], set()
        for est, fit in sorted(zip(self.items, self.checks, strict=True), key=lambda x: x[0].step_time_s):
            if fit is None or fit.value:
                if first is not None and (key := plan_key(est)) not in seen:
                    if len(seen) == first:
                        break
                    seen.add(key)
                out.append(est)
        return out


def size_key(est: CandidateShape) -> tuple[int, ...]:
    """The micro-batch size of a one-size candidate, as a 1-tuple; () for one that mixes sizes
    (per-replica sizes), which share one set of per-size places."""
    sizes = {g.pipe.mbs for g in est.groups}
    return (sizes.pop(),) if len(sizes) == 1 else ()


def plan_key(est: CandidateShape) -> tuple:
    """The identity of the plan a candidate builds (finalists.finalist_plans): its groups and allocation."""
    return (tuple((g.pipe, g.count) for g in est.groups), est.micro_batches)
