"""Each rank's measured compute per micro-batch, smoothed over steps.

The runtime's rank record (``hethub.runtime.metrics.rank_record``) carries, per step, the rank's
forward and backward time per micro-batch (``mb_fwd_s``, ``mb_bwd_s``: its ops' wall time summed
and divided by its micro-batch count; a split backward's W counted in the backward, an emulated
kind's sleep included) and ``span_s``, when its last op of the step ended. Smoothing is the median
of each rank's last few steps: one descheduled step (a shared host's noise, a collective's hiccup)
does not move it at all, and a lasting change does within half the window.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class RankTimes:
    rank: int
    pipeline: int
    stage: int
    fwd_s: float  # per micro-batch
    bwd_s: float
    span_s: float  # end of the rank's last forward/backward op, from the step's start
    scale: float = 1.0  # these times per wall second (an emulated device's time: module doc)

    @property
    def fb_s(self) -> float:
        return self.fwd_s + self.bwd_s


def rank_times(records: Iterable[Mapping[str, Any]], *, emulated_host: bool = False) -> list[RankTimes]:
    """The measured times of every rank record that has them (records from before these fields: none).

    ``emulated_host``: every rank is a process of one host (a local emulation cluster), where a
    rank's wall time mostly says how the scheduler shared the cores among the ranks that step. Its
    emulated device's time is its compute's CPU time plus its emulated sleep (``compute_cpu_s`` +
    ``emulated_sleep_s``); the wall times are scaled to it, so decisions follow the emulated
    devices' speeds, as the predictor's model of such a host does."""
    out = []
    for r in records:
        if not all(k in r for k in ("mb_fwd_s", "mb_bwd_s", "span_s")):
            continue
        scale = 1.0
        busy = float(r.get("busy_s", 0.0))
        if emulated_host and busy > 0 and "compute_cpu_s" in r:
            scale = (float(r["compute_cpu_s"]) + float(r.get("emulated_sleep_s", 0.0))) / busy
        out.append(RankTimes(rank=int(r["rank"]), pipeline=int(r["pipeline"]), stage=int(r["stage"]),
                             fwd_s=float(r["mb_fwd_s"]) * scale, bwd_s=float(r["mb_bwd_s"]) * scale,
                             span_s=float(r["span_s"]) * scale, scale=scale))
    return out


class Smoothed:
    """The median of each rank's forward and backward per micro-batch over its last ``window`` measured
    steps; ``span_s`` is the newest step's (it depends on the step's micro-batch count)."""

    def __init__(self, *, window: int) -> None:
        self.window = window
        self._recent: dict[int, deque[RankTimes]] = {}
        self.by_rank: dict[int, RankTimes] = {}

    def add(self, times: Iterable[RankTimes]) -> None:
        for t in times:
            recent = self._recent.setdefault(t.rank, deque(maxlen=self.window))
            recent.append(t)
            self.by_rank[t.rank] = RankTimes(rank=t.rank, pipeline=t.pipeline, stage=t.stage,
                                             fwd_s=statistics.median(x.fwd_s for x in recent),
                                             bwd_s=statistics.median(x.bwd_s for x in recent), span_s=t.span_s,
                                             scale=t.scale)

    def forget(self, ranks: Iterable[int]) -> None:
        """Drop these ranks' history (their work changed: a layer moved)."""
        for r in ranks:
            self._recent.pop(r, None)
            self.by_rank.pop(r, None)
