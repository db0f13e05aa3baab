"""Many pipelines: split the global batch among them and price the data-parallel synchronisation.

Each pipeline's time is affine in its micro-batch count, T_i(m) = a_i + b_i m, so the integer
min-max allocation is a water level: the smallest T with sum_i floor((T - a_i) / b_i) >= M. That is
what the greedy "give the next micro-batch to the pipeline whose finish grows least" reaches, but in
O(groups x log) instead of O(M log P). Identical pipelines are kept as one group with a count.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable
from dataclasses import dataclass

from hethub.predict.closed_step import step_time_s
from hethub.predict.stage_links import LinkBook
from hethub.predict.water import bisect_time, filled_level, finished_mb, water_level  # noqa: F401 (hetero's)
from hethub.search.split import PipeCost
from hethub.spec.model import ModelSpec


@dataclass(frozen=True)
class Group:
    pipe: PipeCost
    count: int


@dataclass(frozen=True)
class Estimate:
    groups: tuple[Group, ...]
    micro_batches: tuple[tuple[int, ...], ...]  # per group, one count per pipeline (all >= 1)
    step_time_s: float

    @property
    def num_devices(self) -> int:
        return sum(g.pipe.num_devices * g.count for g in self.groups)


def allocate(groups: list[Group], total_mb: int, *, equal: bool = False) -> tuple[list[list[int]], float] | None:
    """Micro-batches per pipeline minimising the latest finish; pipelines left with none are dropped.
    ``equal``: every pipeline the same count (a runtime without unequal shares), None unless it divides."""
    if not groups or total_mb < 1:
        return None
    if equal:
        n = sum(g.count for g in groups)
        return None if total_mb % n else ([[total_mb // n] * g.count for g in groups],
                                          max(g.pipe.time_s(total_mb // n) for g in groups))
    if len(groups) == 1:  # identical pipelines: as even as integers allow
        c = min(groups[0].count, total_mb)
        ms = [total_mb // c + (i < total_mb % c) for i in range(c)]
        return [ms], groups[0].pipe.time_s(ms[0])

    lo = min(g.pipe.time_s(1) for g in groups) * (1 - 1e-12)
    hi = max(g.pipe.time_s(math.ceil(total_mb / sum(g.count for g in groups))) for g in groups) * (1 + 1e-12)
    _, hi = bisect_time(lambda t: finished_mb(groups, t) >= total_mb, lo_s=lo, hi_s=hi, rel_tol=1e-10, max_iter=100)
    # Capped at total_mb: where one pipeline's per_mb_s is tiny next to the finish times (extreme but
    # valid device speeds), the float level can put its floor far above anything it could be given.
    per = [min(total_mb, max(0, math.floor((hi - g.pipe.base_s) / g.pipe.per_mb_s))) for g in groups]
    counts = [[n] * g.count for n, g in zip(per, groups, strict=True)]
    _settle(groups, counts, total_mb)
    makespan = max((g.pipe.time_s(m) for g, cs in zip(groups, counts, strict=True) for m in cs if m > 0),
                   default=math.inf)
    return [[m for m in cs if m > 0] for cs in counts], makespan


def _settle(groups: list[Group], counts: list[list[int]], total_mb: int) -> None:
    """Make ``counts`` sum to exactly ``total_mb``: take surplus micro-batches from the pipelines that
    finish last, give missing ones to those whose finish grows least. The bisection leaves the sum off
    by about one per pipeline; float rounding on extreme speeds can leave it further off, and a plan
    must hold exactly the global batch, so this works in integers until it does."""
    excess = sum(map(sum, counts)) - total_mb
    if excess > 0:  # max-heap of finishes
        heap = [(-groups[i].pipe.time_s(m), i, j) for i, cs in enumerate(counts) for j, m in enumerate(cs) if m > 0]
        heapq.heapify(heap)
        while excess > 0:
            _, i, j = heapq.heappop(heap)
            counts[i][j] -= 1
            excess -= 1
            if counts[i][j] > 0:
                heapq.heappush(heap, (-groups[i].pipe.time_s(counts[i][j]), i, j))
    elif excess < 0:  # min-heap of the finish after one more
        heap = [(groups[i].pipe.time_s(m + 1), i, j) for i, cs in enumerate(counts) for j, m in enumerate(cs)]
        heapq.heapify(heap)
        while excess < 0:
            _, i, j = heapq.heappop(heap)
            counts[i][j] += 1
            excess += 1
            heapq.heappush(heap, (groups[i].pipe.time_s(counts[i][j] + 1), i, j))


def estimate(groups: list[Group], *, total_mb: int, links: LinkBook, model: ModelSpec, precision: str,
             equal: bool = False, after_s: float = 0.0, may_enter: Callable[[float], bool] | None = None,
             whole: bool = False) -> Estimate | None:
    """The groups' best allocation, priced. With `may_enter`: None, unpriced, where every pipeline has
    a share and it rejects the step with `after_s`, a floor under the syncs' span, in their place (asked
    first of the makespan plus `after_s`, below that step: the same answers, mostly without its ends).
    ``whole``: None where a pipeline gets no share (the plan of fewer pipelines)."""
    groups = [g for g in groups if g.count > 0]
    alloc = allocate(groups, total_mb, equal=equal)
    if alloc is not None and whole and any(len(c) != g.count for g, c in zip(groups, alloc[0], strict=True)):
        return None
    if alloc is None or (may_enter is not None and all(len(c) == g.count for g, c in zip(groups, alloc[0], strict=True))
                         and not (may_enter(alloc[1] + after_s) and may_enter(step_time_s(groups, [
                             g.pipe.time_s(max(c)) for g, c in zip(
                             groups, alloc[0], strict=True)], links=links, model=model, precision=precision,
                             sync_floor_s=after_s)))):
        return None
    return _priced(groups, alloc[0], links=links, model=model, precision=precision)


def _priced(groups: list[Group], counts: list[list[int]], *, links: LinkBook, model: ModelSpec,
            precision: str) -> Estimate:
    """The Estimate of an allocation (micro-batches per pipeline; pipelines given none dropped)."""
    kept = [(Group(g.pipe, len(c)), tuple(c)) for g, c in zip(groups, counts, strict=True) if c]
    gs = [g for g, _ in kept]
    step = step_time_s(gs, [g.pipe.time_s(max(c)) for g, c in kept], links=links, model=model, precision=precision)
    return Estimate(groups=tuple(gs), micro_batches=tuple(c for _, c in kept), step_time_s=step)


# Groups of different micro-batch sizes (per-replica micro-batch sizes): the batch is split in samples.
# A group's pipelines finish a_i + k b_i after k micro-batches of u_i = pipe.mbs samples each; every
# function below reduces to its micro-batch counterpart above when all groups share one size.


def water_level_samples(groups: list[Group], total_samples: int) -> float:
    """The smallest T by which the groups' pipelines can finish `total_samples` samples (each finish
    a_i + k b_i adding u_i samples per pipeline): `water_level` weighted by micro-batch size. A floor
    under any allocation's makespan, reached by `allocate_samples` unless sizes force an overshoot."""
    return filled_level(sorted((g.pipe.base_s, g.pipe.per_mb_s, g.count * g.pipe.mbs) for g in groups if g.count > 0),
                         total_samples)


def allocate_samples(groups: list[Group], total_samples: int) -> tuple[list[list[int]], float] | None:
    """Micro-batches per pipeline whose samples sum to exactly `total_samples`, minimising the latest
    finish as far as the sizes allow: every pipeline filled to the water level, then the overshoot
    settled in whole micro-batches (`_settle_samples`). None where the sizes cannot sum to it."""
    groups = [g for g in groups if g.count > 0]
    if not groups or total_samples < 1:
        return None
    level = water_level_samples(groups, total_samples) * (1 + 1e-12)
    counts = [[min(-(-total_samples // g.pipe.mbs), max(0, math.floor((level - g.pipe.base_s) / g.pipe.per_mb_s)))]
              * g.count for g in groups]
    if not _settle_samples(groups, counts, total_samples):
        return None
    makespan = max((g.pipe.time_s(m) for g, cs in zip(groups, counts, strict=True) for m in cs if m > 0),
                   default=math.inf)
    return [[m for m in cs if m > 0] for cs in counts], makespan


def _settle_samples(groups: list[Group], counts: list[list[int]], total_samples: int) -> bool:
    """`_settle` in samples: take micro-batches (of at most the surplus) from the pipelines finishing
    last; where only larger ones remain, take the smallest of those and give the difference back in
    micro-batches of at most the deficit to those whose finish grows least. False where no size fits
    the deficit (sizes that do not divide each other)."""
    units = [g.pipe.mbs for g in groups]
    excess = sum(u * sum(cs) for u, cs in zip(units, counts, strict=True)) - total_samples
    if excess > 0:
        heap = [(-groups[i].pipe.time_s(m), i, j) for i, cs in enumerate(counts) for j, m in enumerate(cs) if m > 0]
        heapq.heapify(heap)
        larger = []
        while excess > 0 and heap:
            t, i, j = heapq.heappop(heap)
            if units[i] > excess:
                larger.append((units[i], t, i, j))
                continue
            counts[i][j] -= 1
            excess -= units[i]
            if counts[i][j] > 0:
                heapq.heappush(heap, (-groups[i].pipe.time_s(counts[i][j]), i, j))
        if excess > 0:  # only micro-batches larger than the surplus are left: the smallest, latest first
            _, _, i, j = min(larger)
            counts[i][j] -= 1
            excess -= units[i]
    if excess < 0:
        heap = [(groups[i].pipe.time_s(m + 1), i, j) for i, cs in enumerate(counts) for j, m in enumerate(cs)]
        heapq.heapify(heap)
        while excess < 0:
            if not heap:
                return False
            _, i, j = heapq.heappop(heap)
            if units[i] > -excess:
                continue  # the deficit only shrinks: this pipeline can take nothing more
            counts[i][j] += 1
            excess += units[i]
            heapq.heappush(heap, (groups[i].pipe.time_s(counts[i][j] + 1), i, j))
    return True


def estimate_samples(groups: list[Group], *, total_samples: int, links: LinkBook, model: ModelSpec,
                     precision: str, equal: bool = False) -> Estimate | None:
    """`estimate` for groups that may differ in micro-batch size (the global batch in samples)."""
    groups = [g for g in groups if g.count > 0]
    sizes = {g.pipe.mbs for g in groups}
    if len(sizes) <= 1:
        if not groups or total_samples % groups[0].pipe.mbs:
            return None
        return estimate(groups, total_mb=total_samples // groups[0].pipe.mbs, links=links, model=model,
                        precision=precision, equal=equal)
    if equal:  # one size and count for every pipeline
        return None
    alloc = allocate_samples(groups, total_samples)
    if alloc is None:
        return None
    return _priced(groups, alloc[0], links=links, model=model, precision=precision)
