"""How well predicted step times rank plans: Spearman's rank correlation and the chosen plan's regret.

Pure functions (no torch, no scipy), used by bench/predictor_accuracy.py and tested in
tests/unit/test_ranking.py. A planner needs its predictor to order candidate plans of one job
right, above all to put a plan at the top whose real step time is close to the best real one;
absolute error matters less.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


def average_ranks(values: Sequence[float]) -> list[float]:
    """1-based ranks of `values` (smallest first); tied values share the mean of the ranks they span."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def spearman(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Spearman's rank correlation: the Pearson correlation of the average ranks (ties handled).

    Raises ValueError for fewer than 2 pairs, unequal lengths or a constant side (no ranking to compare)."""
    if len(xs) != len(ys):
        raise ValueError(f"spearman: {len(xs)} predicted against {len(ys)} measured values; give one per plan")
    if len(xs) < 2:
        raise ValueError("spearman: needs at least 2 plans")
    rx, ry = average_ranks(xs), average_ranks(ys)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True))
    vx, vy = sum((a - mx) ** 2 for a in rx), sum((b - my) ** 2 for b in ry)
    if vx == 0 or vy == 0:
        raise ValueError("spearman: all values on one side are equal; there is no ranking to compare")
    return cov / math.sqrt(vx * vy)


def regret(predicted: Sequence[float], measured: Sequence[float]) -> tuple[int, float]:
    """(index of the plan the predictor ranks first, its measured time over the best measured time - 1).

    Where several plans tie for the lowest prediction the planner could pick any, so the worst of them
    (highest measured) counts."""
    if len(predicted) != len(measured) or not predicted:
        raise ValueError("regret: give one predicted and one measured time per plan, at least one plan")
    best_pred = min(predicted)
    chosen = max((i for i, p in enumerate(predicted) if p == best_pred), key=lambda i: measured[i])
    return chosen, measured[chosen] / min(measured) - 1


@dataclass(frozen=True)
class Misordered:
    """Two plans the predictor orders the other way round from the measurement."""

    faster: int  # measured faster ...
    slower: int  # ... but predicted slower than this one
    measured_gap: float  # slower's measured time / faster's - 1


def misordered_pairs(predicted: Sequence[float], measured: Sequence[float]) -> list[Misordered]:
    """Every pair the prediction orders against the measurement (ties on either side are not counted),
    largest measured gap first: a wrong order between plans 2 % apart is noise, one 30 % apart is not."""
    out = []
    for i in range(len(measured)):
        for j in range(len(measured)):
            if measured[i] < measured[j] and predicted[i] > predicted[j]:
                out.append(Misordered(i, j, measured[j] / measured[i] - 1))
    return sorted(out, key=lambda m: -m.measured_gap)


def separated(runs_a: Sequence[float], runs_b: Sequence[float]) -> bool:
    """Whether repeated runs of two plans tell which is faster: every run of one beat every run of the
    other (their ranges do not overlap). With 4 runs each, plans that are really equally fast give
    that by chance 2 times in 70; plans whose runs overlap cannot be ordered by this measurement, so
    ordering them "wrongly" says nothing about the predictor."""
    if not runs_a or not runs_b:
        raise ValueError("separated: give at least one run of each plan")
    return max(runs_a) < min(runs_b) or max(runs_b) < min(runs_a)
