"""Numbers the report derives from a plan and a timeline: busy time, bubble, FLOP/s per device kind."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

from hethub.predict.result import Event
from hethub.predict.utilisation import KindUse, kind_use, stage_model_flops

__all__ = ["COMPUTE_CATEGORIES", "Bubble", "KindUse", "bubble", "compute_busy_s", "kind_use", "stage_model_flops",
           "union_s"]

COMPUTE_CATEGORIES = frozenset({"forward", "backward", "optimizer", "recompute"})


def union_s(intervals: Iterable[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals (overlaps counted once)."""
    total, cur_start, cur_end = 0.0, None, None
    for a, b in sorted(intervals):
        if cur_end is None or a > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start  # type: ignore[operator]
            cur_start, cur_end = a, b
        else:
            cur_end = max(cur_end, b)
    if cur_end is not None:
        total += cur_end - cur_start  # type: ignore[operator]
    return total


def compute_busy_s(events: Iterable[Event]) -> float:
    return union_s((e.start_s, e.end_s) for e in events if e.category in COMPUTE_CATEGORIES)


@dataclass(frozen=True)
class Bubble:
    mean_fraction: float  # device-weighted mean over all devices with events
    max_fraction: float
    devices: int


def bubble(events: Iterable[Event], *, step_s: float) -> Bubble | None:
    """Share of the step each device spends not computing (pipeline fill/drain, waits, exposed comms).

    Devices are weighted equally, so a large replica group counts by its size. None without events.
    """
    by_dev: dict[int, list[Event]] = defaultdict(list)
    for e in events:
        by_dev[e.device].append(e)
    if not by_dev or step_s <= 0:
        return None
    fractions = [max(0.0, 1.0 - compute_busy_s(evs) / step_s) for evs in by_dev.values()]
    return Bubble(mean_fraction=sum(fractions) / len(fractions), max_fraction=max(fractions), devices=len(fractions))
