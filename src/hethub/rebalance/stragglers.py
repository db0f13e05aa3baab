"""Naming stragglers: ranks whose time per micro-batch is more than ``factor`` times their prediction.

The prediction is the predictor's per-stage forward + backward per micro-batch, which the training
entry point writes into the plan (``meta.rebalance.stage_fb_s``); its absolute scale may be off on an
uncalibrated host, so one scale (the median over ranks of measured / predicted, taken once, on the
first measured step) is fitted and a rank is compared with its prediction times that scale. A rank
that drifts later, or that was out of line from the start, stands out; a uniformly mis-predicted
cluster does not. Without a prediction each rank's first measured step is its reference.
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
        self.scale: float | None = None

    def check(self, measured_s: Mapping[int, float]) -> list[Straggler]:
        """The stragglers among ``measured_s`` (rank -> forward + backward per micro-batch), slowest first."""
        if self.reference is None:
            self.reference = dict(measured_s)
        ref = self.reference
        known = [r for r in measured_s if ref.get(r, 0.0) > 0]
        if self.scale is None:
            if not known:
                return []
            self.scale = statistics.median(measured_s[r] / ref[r] for r in known)
        scale = self.scale or 1.0
        out = [Straggler(rank=r, ratio=measured_s[r] / (ref[r] * scale)) for r in known]
        return sorted((s for s in out if s.ratio > self.factor), key=lambda s: -s.ratio)

    def rescale(self, rank: int, factor: float) -> None:
        """The rank's work changed by ``factor`` (a layer moved): so does its reference."""
        if self.reference is not None and rank in self.reference:
            self.reference[rank] *= factor
