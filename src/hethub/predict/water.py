"""Water levels: when pipelines whose finishes are affine in their micro-batch counts (T_i(m) = a_i + b_i m,
anything with ``base_s`` and ``per_mb_s``) finish a batch together, the rule search/combine.py allocates by
and the mixed search's floors (search/mixed.py, search/sync_floors.py) are built on."""

from __future__ import annotations

import bisect
import heapq
import math
from collections.abc import Callable

from hethub.memo import reference


def finished_mb(groups: list, t_s: float) -> int:
    """Micro-batches the groups' pipelines finish by time t_s (each at its base plus per-batch rate)."""
    return sum(g.count * max(0, math.floor((t_s - g.pipe.base_s) / g.pipe.per_mb_s)) for g in groups)


def bisect_time(ok: Callable[[float], bool], *, lo_s: float, hi_s: float, rel_tol: float,
                max_iter: int) -> tuple[float, float]:
    """Narrow [lo_s, hi_s] around the first time where the monotone `ok` holds (ok(hi_s) assumed),
    until it is within rel_tol of hi_s or max_iter halvings; returns the final (lo_s, hi_s)."""
    for _ in range(max_iter):
        if hi_s - lo_s <= rel_tol * hi_s:
            break
        mid = 0.5 * (lo_s + hi_s)
        if ok(mid):
            hi_s = mid
        else:
            lo_s = mid
    return lo_s, hi_s


def water_level(groups: list, total_mb: int) -> float:
    """The makespan `allocate` reaches (so a lower bound of the step), without its bisection.

    It is the total_mb-th smallest finish a_i + k b_i (k >= 1, counted once per pipeline of the
    group). Where sum_i c_i max(0, T - a_i) / b_i = total_mb, T is at most that (floors only lose),
    and each group is at most about one micro-batch short; walking the next finishes in order from
    one below that point gives the answer in O(groups log groups). `groups` holds `Group`s of
    anything with base_s and per_mb_s (a PipeCost or a bounds.PipeFloor).
    """
    return filled_level(finish_lines(groups), total_mb)


def finish_lines(groups: list) -> list[tuple[float, float, int]]:
    """(base, per micro-batch, pipelines) of the groups that have pipelines, by base: `filled_level`'s input."""
    return sorted((g.pipe.base_s, g.pipe.per_mb_s, g.count) for g in groups if g.count > 0)


def water_level_with(lines: list[tuple[float, float, int]], total_mb: int, *, base_s: float, per_mb_s: float,
                     count: int) -> float:
    """`water_level` of groups whose `finish_lines` are `lines` plus `count` pipelines of (base_s,
    per_mb_s): the mixed search prices thousands of floors beside one set of pure groups."""
    if count > 0:
        lines = lines.copy()
        bisect.insort(lines, (base_s, per_mb_s, count))
    return filled_level(lines, total_mb)


def lines_level_beside(gs: list[tuple[float, float, int]], total_mb: int, *, start_s: float, per_s: float,
                       at_start: int) -> float:
    """`water_level` of groups whose `finish_lines` are `gs` beside a stream that finishes `at_start`
    micro-batches at start_s and one more every per_s after it: the first time T the groups and the
    stream finish total_mb (exact; mixed._rate_level's floor). The groups' level alone (inf: they finish
    none) is found only where it is read: every family of the mixed search asks this beside one set."""
    if at_start >= total_mb:
        return min(start_s, filled_level(gs, total_mb))
    # The (total_mb - at_start)-th finish of the groups and the stream's later ones, which start at start_s.
    rest = filled_level(sorted([*gs, (start_s, per_s, 1)]), total_mb - at_start)
    return rest if rest >= start_s else min(start_s, filled_level(gs, total_mb))


def filled_level(gs: list[tuple[float, float, int]], total: int) -> float:
    """The `total`-th unit finished over pipelines (a, b, w) sorted by a: finish k at a + k b adds w
    units. Shared by `water_level` (w = pipelines) and combine.water_level_samples (w = their samples)."""
    if not gs or total < 1:
        return math.inf
    slope = offset = 0.0
    for i, (a, b, w) in enumerate(gs):  # the continuous level, adding pipelines once it passes their start
        slope += w / b
        offset += w * a / b
        level = (total + offset) / slope
        if i + 1 == len(gs) or level <= gs[i + 1][0]:
            break
    have, heap = 0, []
    for i, (a, b, w) in enumerate(gs):
        k = max(0, math.floor((level - a) / b) - 1)  # one below, in case rounding put the floor one up
        have += w * k
        heap.append((a + (k + 1) * b, i, k + 1))
    heapq.heapify(heap)
    while True:
        t, i, k = heapq.heappop(heap)
        have += gs[i][2]
        if have >= total:
            return t
        heapq.heappush(heap, (gs[i][0] + (k + 1) * gs[i][1], i, k + 1))


def capped_level(pure: list, lines: list[tuple[float, float, int]], floor, *, count: int, rate: float, total: int,
                 lo: float) -> float:
    """A floor under the makespan when `count` pipelines above `floor` (its base_s and per_mb_s) also run at
    most `rate` micro-batches per second together after floor.base_s, beside the `pure` groups (their
    `finish_lines`: ``lines``): bisected from ``lo`` (the water level of the groups beside them; the mixed
    search's box floors). done(t), monotone, reaches `total` at about T* = max(that level, the one with
    a stream of one finish every 1 / rate in the pipelines' place); once done brackets T* within 1e-9
    the bisection asks done only there (the same answers; the reference path asks everywhere:
    tests/unit/test_mixed_box_floors.py)."""
    a, b = floor.base_s, floor.per_mb_s

    def done(t: float) -> float:
        n = finished_mb(pure, t)
        if t > a:
            n += min(count * max(0, math.floor((t - a) / b)), math.floor(rate * (t - a)))
        return n

    hi = a + max(-(-total // count) * b, total / rate) * (1 + 1e-9) + 1e-12
    if pure:
        hi = min(hi, water_level_with(lines, total, base_s=a, per_mb_s=b, count=0) * (1 + 1e-9) + 1e-12)
    near, far = -math.inf, math.inf  # done asked between these
    if not reference():
        star = max(lo, water_level_with(lines, total, base_s=a, per_mb_s=1 / rate, count=1))
        if 0 < star < math.inf and done(star * (1 - 1e-9)) < total <= done(star * (1 + 1e-9)):
            near, far = star * (1 - 1e-9), star * (1 + 1e-9)

    def ok(t: float) -> bool:
        return t >= far or (t > near and done(t) >= total)

    if ok(lo):
        return lo
    lo, _ = bisect_time(ok, lo_s=lo, hi_s=hi, rel_tol=1e-7, max_iter=40)
    return lo
