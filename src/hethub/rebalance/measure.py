"""Each rank's measured compute per micro-batch, smoothed over steps.

The runtime's rank record (``hethub.runtime.metrics.rank_record``) carries, per step, the rank's
forward and backward time per micro-batch (``mb_fwd_s``, ``mb_bwd_s``: its ops' wall time summed
and divided by its micro-batch count; a split backward's W counted in the backward, an emulated
kind's sleep included) and ``span_s``, when its last op of the step ended. Smoothing is an
exponentially weighted mean per rank, so one descheduled step moves the estimate by a fraction.
"""

from __future__ import annotations

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

    @property
    def fb_s(self) -> float:
        return self.fwd_s + self.bwd_s


def rank_times(records: Iterable[Mapping[str, Any]]) -> list[RankTimes]:
    """The measured times of every rank record that has them (records from before these fields: none)."""
    out = []
    for r in records:
        if all(k in r for k in ("mb_fwd_s", "mb_bwd_s", "span_s")):
            out.append(RankTimes(rank=int(r["rank"]), pipeline=int(r["pipeline"]), stage=int(r["stage"]),
                                 fwd_s=float(r["mb_fwd_s"]), bwd_s=float(r["mb_bwd_s"]), span_s=float(r["span_s"])))
    return out


class Smoothed:
    """Exponentially weighted means of each rank's forward and backward per micro-batch (``weight``: the
    newest step's share); ``span_s`` is the newest step's (it depends on the step's micro-batch count)."""

    def __init__(self, *, weight: float) -> None:
        self.weight = weight
        self.by_rank: dict[int, RankTimes] = {}

    def add(self, times: Iterable[RankTimes]) -> None:
        w = self.weight
        for t in times:
            old = self.by_rank.get(t.rank)
            if old is None:
                self.by_rank[t.rank] = t
                continue
            self.by_rank[t.rank] = RankTimes(rank=t.rank, pipeline=t.pipeline, stage=t.stage,
                                             fwd_s=old.fwd_s + w * (t.fwd_s - old.fwd_s),
                                             bwd_s=old.bwd_s + w * (t.bwd_s - old.bwd_s),
                                             span_s=t.span_s)

    def forget(self, ranks: Iterable[int]) -> None:
        """Drop these ranks' history (their work changed: a layer moved)."""
        for r in ranks:
            self.by_rank.pop(r, None)
