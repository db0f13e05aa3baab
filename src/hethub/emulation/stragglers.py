"""Stragglers on a shared host: each core's speed wanders, independently of the others'.

Measured by :mod:`hethub.emulation.measure.spread`: over windows of ``window_s`` a core's speed relative to
another core's has a log-normal spread ``sigma``, independently between cores and lasting a step
and longer. For one rank that spread is no bias, and along a
pipeline little, as hand-offs pass time from stage to stage. It does not cancel where ranks meet:
data-parallel replicas at their all-reduce and the ranks of a TP stage at every collective wait
for the slowest, so the typical step is slower than one at mean speed (for two ranks about
0.56 sigma: the expected maximum of two).

The shared-core replay (:mod:`hethub.emulation.contention`) is run ``draws`` times, each with its own
speeds: per window, a median-1 log-normal factor per rank (per core when ranks outnumber cores),
with the measured window nearest the step (the predictor picks it). The prediction is the median
step over the draws, as the runtime reports the median step. Draw ``d``'s factor for (rank,
window) is a pure function of the three, so predictions are reproducible and two plans meet the
same luck (common random numbers, a fair comparison for the planner).
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Callable, Hashable
from dataclasses import dataclass

DRAWS = 24


@dataclass(frozen=True)
class SpeedSpread:
    sigma: float  # log-normal sigma of one core's speed against another's, per window
    window_s: float

    def __post_init__(self) -> None:
        if not (self.sigma >= 0 and math.isfinite(self.sigma)):
            raise ValueError(f"speed spread sigma must be a finite number >= 0, got {self.sigma}")
        if not (self.window_s > 0 and math.isfinite(self.window_s)):
            raise ValueError(f"speed spread window_s must be a finite number > 0, got {self.window_s}")


class SpeedDraws:
    """One draw: the speed factor of any (rank or core, window)."""

    def __init__(self, spread: SpeedSpread, *, draw: int) -> None:
        self.spread, self.draw = spread, draw
        self._cache: dict[tuple[Hashable, int], float] = {}

    def window(self, t_s: float) -> int:
        return int(t_s / self.spread.window_s + 1e-9)

    def window_end(self, k: int) -> float:
        return (k + 1) * self.spread.window_s

    def speed(self, key: Hashable, k: int) -> float:
        f = self._cache.get((key, k))
        if f is None:
            # A string seed: Random hashes it with SHA-512, stable across processes (hash() is salted).
            f = math.exp(random.Random(f"{self.draw}/{key}/{k}").gauss(0.0, self.spread.sigma))
            self._cache[(key, k)] = f
        return f


def median_over_draws(replay: Callable[[SpeedDraws | None], tuple[float, list[float]]], *,
                      spread: SpeedSpread | None, draws: int = DRAWS,
                      ) -> tuple[float, list[float], SpeedDraws | None]:
    """(median step time, per-pipeline times of the median draw, that draw) over the draws; one plain
    replay (and None) without a spread. With an even number of draws the median draw is the lower of
    the middle two, whose step is at most the median."""
    if spread is None or spread.sigma == 0.0:
        return (*replay(None), None)
    runs = sorted(((replay(SpeedDraws(spread, draw=d)), d) for d in range(draws)), key=lambda r: r[0][0])
    step = statistics.median(r[0][0] for r in runs)
    (_, pipes), d = runs[(len(runs) - 1) // 2]
    return step, pipes, SpeedDraws(spread, draw=d)
