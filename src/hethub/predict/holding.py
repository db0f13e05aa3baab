"""Stages holding a model's whole layers, each in one of its recomputation modes: the floors the
planner prunes with (search/bounds.py, search/mixed.py) read a stage as its modes, each a
(capacity in layers, cost per layer, base) triple, and ask when a group of stages first holds L
layers within a bottleneck, and the least work those layers can cost; `PipeFloor` is the pipeline
time floor they build (search/bounds.pipe_floor)."""

from __future__ import annotations

import functools
import heapq
import itertools
import math
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class PipeFloor:
    """T_floor(m) = base_s + m per_mb_s <= T(m) of every layer split of some stages; it stands in for
    a PipeCost in combine.allocate, whose makespan only grows with base_s and per_mb_s."""

    base_s: float
    per_mb_s: float
    bottleneck_s: float = 0.0  # where known, a B at or just below which the stages' modes hold the layers

    def time_s(self, m: int) -> float:
        return self.base_s + m * self.per_mb_s


def balanced_bottleneck(n_layers: int, p: int, w: float, e: float, h: float) -> float:
    """Smallest B with sum_s floor((B - base_s) / w) >= n_layers over p stages, the first based at e
    (embedding), the last at h (head), the others at 0: the bottleneck when layers are whole and
    memory is ignored. With B = k w + r (0 <= r < w), the count is p k - ke - kh - [r < re] - [r < rh]
    where e = ke w + re and h = kh w + rh, so B is k w plus one of 0, re, rh."""
    if p == 1 or w <= 0:
        return n_layers * w + e + h
    ke, re = divmod(e, w)
    kh, rh = divmod(h, w)
    k = math.ceil((n_layers + ke + kh) / p)  # the first k whose count reaches n_layers for r near w
    for r in sorted((0.0, re, rh)):
        if p * k - ke - kh - (r < re) - (r < rh) >= n_layers:
            return max(k * w + r, e, h)
    return max(k * w + max(re, rh), e, h)


def hull_pieces(caps: list[tuple[int, tuple[tuple[int, float, float], ...]]]) -> list[tuple[float, int]]:
    """`least_layer_work`'s pieces of these stages, sorted: (cost per layer, layers) of each group's
    lower convex hull (`_hull`), its stages' layers (pipe_floor keeps them per segment)."""
    return sorted([(slope, k * n) for k, modes in caps for slope, n in _hull(modes)])


def floor_terms(groups: list[tuple[int, tuple[tuple[int, float, float], ...]]]) -> tuple[list, list]:
    """What the floors keep of a segment's stages grouped by modes: each group with its `undominated`
    modes (`smallest_holding` reads those) and the groups' `hull_pieces` (`least_layer_work` reads those)."""
    return [(k, undominated(modes)) for k, modes in groups], hull_pieces(groups)


def least_layer_work(pieces: list[tuple[float, int]], n_layers: int) -> float:
    """A floor under the layers' share of one micro-batch's work over all stages (bases apart): each
    stage's cost is above its lower convex hull (`_hull`); the hulls' cheapest slopes first (over all
    stages: `pieces`, their `hull_pieces`, any groups' concatenated) then give the least total for L
    layers, summed in sorted order (so the same whatever the groups' order)."""
    total, left = 0.0, n_layers
    for cost, n in sorted(pieces):
        take = min(n, left)
        total += take * cost
        left -= take
        if left <= 0:
            break
    return total


@functools.lru_cache(maxsize=4096)
def undominated(modes: tuple[tuple[int, float, float], ...]) -> tuple[tuple[int, float, float], ...]:
    """The modes `smallest_holding` reads of a stage: none of negative capacity, none another holds as many
    layers of at no more cost per layer and base (of equal ones the first): such a mode never holds more
    layers within a time nor reaches a count sooner (IEEE rounding is monotone), so the answers are equal."""
    return tuple(m for i, m in enumerate(modes) if m[0] >= 0 and not any(
        q[0] >= m[0] and q[1] <= m[1] and q[2] <= m[2] and (j < i or q != m) for j, q in enumerate(modes) if j != i))


@functools.lru_cache(maxsize=4096)
def _hull(modes: tuple[tuple[int, float, float], ...]) -> tuple[tuple[float, int], ...]:
    """(slope, layers) pieces of the lower convex hull of a stage's layer work (bases apart). Holding k
    layers costs k w_m in the cheapest mode m whose capacity cap_m >= k; between two consecutive
    capacities that is a line through the origin above the chord of its end points, so the cost is
    at least the lower convex hull of (0, 0) and each (cap_m, cost at cap_m)."""
    points = sorted({(c, min(w for cm, w, _ in modes if cm >= c) * c) for c, _, _ in modes if c > 0})
    hull = [(0, 0.0)]
    for pt in points:  # lower hull, left to right (slopes increase)
        while len(hull) >= 2 and ((hull[-1][1] - hull[-2][1]) * (pt[0] - hull[-2][0])
                                  >= (pt[1] - hull[-2][1]) * (hull[-1][0] - hull[-2][0])):
            hull.pop()
        hull.append(pt)
    return tuple(((y1 - y0) / (x1 - x0), x1 - x0) for (x0, y0), (x1, y1) in itertools.pairwise(hull))


def smallest_holding(caps: list[tuple[int, tuple[tuple[int, float, float], ...]]], n_layers: int,
                     lo: float) -> float | None:
    """The smallest B >= lo at which the stages hold L whole layers with every stage's time <= B (just
    below it: a floor). A stage holds j layers within B iff some mode with capacity >= j has
    base + j w <= B, so t(j) = min over those modes of base + j w, nondecreasing in j, is when it
    can first hold j (j = 0: its base; before that it counts -1, as it cannot run at all); walk those
    times in order from lo until the stages hold L. Exact. None: they never hold L. (Every floor of
    the search calls this, thousands of times: `_time_to_hold` is inlined and min/max are comparisons.)"""
    heap, total, floor, inf = [], 0, math.floor, math.inf
    for g, (k, modes) in enumerate(caps):
        x = -1
        for cap, w, base in modes:
            if cap >= 0 and lo >= base:
                y = floor((lo - base) / w)
                if y > cap:
                    y = cap
                if y > x:
                    x = y
        total += k * x
        j, t = x + 1, inf
        for cap, w, base in modes:  # _time_to_hold(modes, j)
            if cap >= j:
                c = base + j * w
                if c < t:
                    t = c
        if t < inf:
            heap.append((t, g, j))
    if total >= n_layers:
        return lo
    heapq.heapify(heap)
    b = lo
    pop, replace = heapq.heappop, heapq.heapreplace
    while heap:
        t, g, j = heap[0]
        k, modes = caps[g]
        total += k
        if t > b:
            b = t
        if total >= n_layers:
            return b * (1 - 1e-12)
        j += 1
        t = inf
        for cap, w, base in modes:
            if cap >= j:
                c = base + j * w
                if c < t:
                    t = c
        if t < inf:
            replace(heap, (t, g, j))
        else:
            pop(heap)
    return None


def most_within(*, held: int, stages: int, per_layer_s: float, time_s: float) -> int:
    """An upper bound on the layers `stages` stages hold with each stage's time <= time_s (inf: their
    capacities, `held` in all), where a layer costs each of them at least per_layer_s in any mode (and
    bases are >= 0)."""
    if time_s == math.inf or per_layer_s <= 0:
        return held
    return min(held, stages * max(0, math.floor(time_s / per_layer_s)))


def sure_spans(layers: list[tuple[int, int]], n_layers: int) -> list[tuple[int, int]] | None:
    """Given each segment's fewest and most layers (pipeline order), the layers [a, b) it holds in every
    split within those bounds (a >= b: none sure); None where no split is within them. Segment i starts
    at most at min(its predecessors' most, L - the rest's fewest) and ends at least at the symmetric bound."""
    before_lo = before_hi = 0
    after_lo, after_hi = sum(lo for lo, _ in layers), sum(hi for _, hi in layers)
    if after_lo > n_layers or after_hi < n_layers:
        return None
    spans = []
    for lo, hi in layers:
        start = min(before_hi, n_layers - after_lo)
        before_lo, before_hi, after_lo, after_hi = before_lo + lo, before_hi + hi, after_lo - lo, after_hi - hi
        spans.append((start, max(before_lo, n_layers - after_hi)))
    return spans


class Runs:
    """Values at the counts f = 1, 2, ... (added in order) kept as runs of equal consecutive values, so
    that how many counts of a range have each value is read in O(runs). A stage's modes by its
    in-flight count change only where a capacity steps down, and under 1F1B a segment's stages hold
    consecutive counts: the floors read their stages this way rather than one by one."""

    def __init__(self) -> None:
        self.runs: list[list] = []  # [first f, last f, value]
        self.run_of = [0]  # run index by f (f = 0 unused)

    @property
    def last(self) -> int:
        """The largest count added (0: none)."""
        return len(self.run_of) - 1

    def add(self, value: Any) -> None:
        """The value at the next count."""
        f = len(self.run_of)
        if self.runs and self.runs[-1][2] == value:
            self.runs[-1][1] = f
        else:
            self.runs.append([f, f, value])
        self.run_of.append(len(self.runs) - 1)

    def value(self, f: int) -> Any:
        return self.runs[self.run_of[f]][2]

    def counts(self, lo: int, hi: int) -> list[tuple[Any, int]]:
        """(value, how many of the counts lo .. hi have it) by run, in count order."""
        return [(v, min(hi, b) - max(lo, a) + 1) for a, b, v in self.runs[self.run_of[lo]:self.run_of[hi] + 1]]
