"""Naming stragglers: ranks whose time per micro-batch is more than ``factor`` times their prediction.

The prediction is the predictor's per-stage forward + backward per micro-batch, which the training
entry point writes into the plan (``meta.rebalance.stage_fb_s``); its absolute scale may be off on an
uncalibrated host, and load can slow every rank at once, so each check fits one scale, the median
over ranks of measured / predicted, and compares every rank with its prediction times that scale. A
rank out of line with the others stands out; a uniformly mis-predicted or uniformly loaded cluster
names nobody. Without a prediction each rank's first measured time is its reference.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Straggler:
    rank: int
    ratio: float  # measured / (predicted x the cluster's scale)


class StragglerWatch:
    def __init__(self, *, factor: float, predicted_s: Mapping[int, float] | None) -> None:
        self.factor = factor
        self.reference: dict[int, float] | None = dict(predicted_s) if predicted_s else None
        self.basis = "its predicted time" if predicted_s else "its first measured step"
        self.scale = 1.0  # the last check's

    def check(self, measured_s: Mapping[int, float]) -> list[Straggler]:
        """The stragglers among ``measured_s`` (rank -> forward + backward per micro-batch), slowest first."""
        if self.reference is None:
            self.reference = dict(measured_s)
        ref = self.reference
        known = [r for r in measured_s if ref.get(r, 0.0) > 0]
        if not known:
            return []
        self.scale = scale = statistics.median(measured_s[r] / ref[r] for r in known)
        out = [Straggler(rank=r, ratio=measured_s[r] / (ref[r] * scale)) for r in known]
        return sorted((s for s in out if s.ratio > self.factor), key=lambda s: -s.ratio)

    def rescale(self, rank: int, factor: float) -> None:
        """The rank's work changed by ``factor`` (a layer moved): so does its reference."""
        if self.reference is not None and rank in self.reference:
            self.reference[rank] *= factor
