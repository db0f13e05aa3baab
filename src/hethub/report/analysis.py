"""Numbers the report derives from a plan and a timeline: busy time, bubble, FLOP/s per device kind."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

from hethub.plan import Plan
from hethub.predict.result import Event

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


@dataclass(frozen=True)
class KindUse:
    kind: str
    devices: int  # devices of this kind the plan uses
    model_flops_per_step: float  # forward + backward model FLOPs these devices do (no recomputation)
    peak_flops_per_device: float

    def achieved_flops_per_s(self, step_s: float) -> float:
        return self.model_flops_per_step / step_s if step_s > 0 else 0.0

    def utilisation(self, step_s: float) -> float:
        """Model-FLOPs utilisation of this kind: achieved per device over its dense peak."""
        peak = self.devices * self.peak_flops_per_device
        return self.achieved_flops_per_s(step_s) / peak if peak > 0 else 0.0


def stage_model_flops(plan: Plan, pipeline: int, stage: int) -> float:
    """Forward + backward model FLOPs of one stage (all its TP ranks) for one step."""
    p = plan.pipelines[pipeline]
    s = p.stages[stage]
    tokens = p.num_samples * plan.seq_len
    fwd = s.num_layers * plan.model.layer_fwd_flops(tokens=tokens, seq_len=plan.seq_len)
    if s.head:
        fwd += plan.model.head_fwd_flops(tokens=tokens)
    return 3.0 * fwd  # backward is twice the forward


def kind_use(plan: Plan) -> list[KindUse]:
    flops: dict[str, float] = defaultdict(float)
    devices: dict[str, int] = defaultdict(int)
    for pi, p in enumerate(plan.pipelines):
        for si, s in enumerate(p.stages):
            flops[s.kind] += stage_model_flops(plan, pi, si)
            devices[s.kind] += s.tp
    return [KindUse(kind=k, devices=devices[k], model_flops_per_step=flops[k],
                    peak_flops_per_device=plan.cluster.kinds[k].peak_flops)
            for k in plan.cluster.kind_names if k in devices]
