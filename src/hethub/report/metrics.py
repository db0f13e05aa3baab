"""Read a training run's metrics JSON lines: step times, and the per-rank timeline of one step.

The runtime's schema is not final, so this reader is deliberately forgiving (docs/report.md has the
assumed schema). It accepts:

* step lines ``{"step": 3, "step_time_s": 1.2, "tokens_per_s": 9e3, ...}``;
* the per-rank timeline inside a step line, ``"ranks": [{"rank": r, "events": [...]}]``;
* or the same per-rank record on its own line, ``{"step": 3, "rank": r, "events": [...]}``.

Each event is ``{"name", "category", "start_s", "end_s", "micro_batch"}`` with times relative to
the step's start. The timeline of the last step that has one is used. Lines or events that do not
parse are skipped and counted in ``warnings`` rather than failing the whole report.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hethub.errors import HethubError, PlanError
from hethub.plan import Plan
from hethub.predict.result import Event

CATEGORIES = ("forward", "backward", "p2p", "allreduce", "optimizer", "wait")
# Short names the runtime might log without a category.
_NAME_CATEGORY = {"F": "forward", "B": "backward", "W": "backward", "OPT": "optimizer", "OPTIM": "optimizer",
                  "AR": "allreduce", "SYNC": "allreduce"}


@dataclass(frozen=True)
class MeasuredRun:
    step_times_s: tuple[float, ...]
    tokens_per_s: tuple[float, ...]
    timeline_step: int | None  # step whose per-rank events are in `events`
    events: dict[int, tuple[Event, ...]]  # rank -> events, times relative to the step start
    timeline_step_time_s: float | None = None  # the logged step time of `timeline_step`
    warnings: tuple[str, ...] = field(default=())
    # Online re-balancing, per step that logged it: (step, the record's "rebalance" object).
    rebalance: tuple[tuple[int, dict[str, Any]], ...] = field(default=())

    @property
    def typical_step_time_s(self) -> float | None:
        """Median step time, leaving out the first step (warm-up, allocator, compilation) when there are others."""
        times = self.step_times_s[1:] if len(self.step_times_s) > 1 else self.step_times_s
        return statistics.median(times) if times else None

    @property
    def typical_tokens_per_s(self) -> float | None:
        tps = self.tokens_per_s[1:] if len(self.tokens_per_s) > 1 else self.tokens_per_s
        return statistics.median(tps) if tps else None

    @property
    def timeline_end_s(self) -> float:
        return max((e.end_s for evs in self.events.values() for e in evs), default=0.0)


def read_metrics(path: str | Path, *, plan: Plan) -> MeasuredRun:
    """Parse ``path``; per-rank events are tagged with the plan's device, pipeline and stage of the rank."""
    p = Path(path)
    if not p.is_file():
        raise HethubError(f"metrics file '{p}' does not exist. Fix: pass the run's metrics .jsonl "
                          "(written by 'hethub train'), or leave --metrics out.")
    warnings: list[str] = []
    step_time: dict[int, float] = {}
    tokens: dict[int, float] = {}
    rank_records: dict[int, dict[int, list[Any]]] = {}  # step -> rank -> raw events
    rebalance: dict[int, dict[str, Any]] = {}
    layout = stage_layout(plan)
    with p.open(encoding="utf-8", errors="replace") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                warnings.append(f"line {lineno}: not JSON, skipped")
                continue
            if not isinstance(rec, dict):
                continue
            step = _as_int(rec.get("step"))
            if step is None:
                step = max(step_time, default=-1) + 1  # an unnumbered line follows the previous one
            if (v := _as_float(rec.get("step_time_s"))) is not None:
                step_time[step] = v
            if (v := _as_float(rec.get("tokens_per_s"))) is not None:
                tokens[step] = v
            _check_belongs(rec, plan, where=f"metrics file '{p}' line {lineno}")
            if isinstance(rec.get("rebalance"), dict):
                rebalance[step] = rec["rebalance"]
            for rr in _rank_records(rec):
                rank = _as_int(rr.get("rank"))
                if rank is None or not isinstance(rr.get("events"), list):
                    warnings.append(f"line {lineno}: rank record without an integer 'rank' and an 'events' list")
                    continue
                _check_rank(rr, rank, plan, where=f"metrics file '{p}' line {lineno}", layout=layout)
                rank_records.setdefault(step, {})[rank] = rr["events"]
    if not step_time and not rank_records:
        raise HethubError(f"metrics file '{p}' holds no step records ({len(warnings)} unreadable line(s)): it is "
                          "empty, truncated before its first step, or not a metrics file. Fix: pass the .jsonl "
                          "that 'hethub train --metrics' wrote, or leave --metrics out.")
    timeline_step = max(rank_records, default=None)
    events = _to_events(rank_records[timeline_step], plan, warnings) if timeline_step is not None else {}
    return MeasuredRun(
        step_times_s=tuple(step_time[s] for s in sorted(step_time)),
        tokens_per_s=tuple(tokens[s] for s in sorted(tokens)),
        timeline_step=timeline_step, events=events, warnings=tuple(warnings),
        timeline_step_time_s=step_time.get(timeline_step) if timeline_step is not None else None,
        rebalance=tuple(sorted(rebalance.items())),
    )


def _other_plan(where: str, problem: str) -> PlanError:
    return PlanError(f"{where}: {problem}: these metrics belong to another plan. Fix: pass the plan the run "
                     "trained (--plan) with its own metrics.")


def _check_belongs(rec: dict[str, Any], plan: Plan, *, where: str) -> None:
    """A step record's tokens per step must be the plan's (global batch x sequence length)."""
    tokens = _as_int(rec.get("tokens"))
    if tokens is not None and tokens != plan.tokens_per_step:
        raise _other_plan(where, f"field 'tokens' is {tokens} per step, the plan trains {plan.global_batch} x "
                                 f"{plan.seq_len} = {plan.tokens_per_step}")


def _check_rank(rr: dict[str, Any], rank: int, plan: Plan, *, where: str,
                layout: dict[int, tuple[int, int, int]]) -> None:
    """A rank record must name a rank of the plan, of the kind, pipeline, stage and TP rank the plan
    gives it: metrics of another plan over the same devices and batch differ there."""
    if not 0 <= rank < plan.world_size:
        raise _other_plan(where, f"field 'rank' is {rank}, the plan has ranks 0..{plan.world_size - 1}")
    device = plan.devices[rank]
    kind = plan.cluster.devices[device].kind
    if "kind" in rr and rr["kind"] != kind:
        raise _other_plan(where, f"rank {rank} ran kind {rr['kind']!r} (field 'kind'), the plan puts it on {kind!r}")
    pi, si, tp_rank = layout[device]
    for key, want in (("pipeline", pi), ("stage", si), ("tp_rank", tp_rank)):
        if key in rr and _as_int(rr[key]) != want:
            raise _other_plan(where, f"rank {rank} ran {key} {rr[key]!r} (field '{key}'), the plan puts it in "
                                     f"pipeline {pi}, stage {si}, TP rank {tp_rank}")


def stage_layout(plan: Plan) -> dict[int, tuple[int, int, int]]:
    """device -> (pipeline, stage, TP rank) in ``plan`` (a stage's TP ranks follow its device order)."""
    return {d: (pi, si, t) for pi, p in enumerate(plan.pipelines) for si, s in enumerate(p.stages)
            for t, d in enumerate(s.devices)}


def _rank_records(rec: dict[str, Any]) -> list[dict[str, Any]]:
    if isinstance(rec.get("ranks"), list):
        return [r for r in rec["ranks"] if isinstance(r, dict)]
    if "rank" in rec and "events" in rec:
        return [rec]
    return []


def _to_events(raw: dict[int, list[Any]], plan: Plan, warnings: list[str]) -> dict[int, tuple[Event, ...]]:
    devices = plan.devices  # rank r is the r-th device in ascending id order
    where = {d: (pi, si) for pi, p in enumerate(plan.pipelines) for si, s in enumerate(p.stages) for d in s.devices}
    out: dict[int, tuple[Event, ...]] = {}
    bad = 0
    for rank, evs in sorted(raw.items()):
        if not 0 <= rank < len(devices):
            warnings.append(f"rank {rank} is not in the plan (world size {len(devices)}); its events are ignored")
            continue
        device = devices[rank]
        pi, si = where[device]
        parsed = []
        for e in evs:
            ev = _event(e, device=device, pipeline=pi, stage=si)
            if ev is None:
                bad += 1
            else:
                parsed.append(ev)
        out[rank] = tuple(sorted(parsed, key=lambda e: e.start_s))
    if bad:
        warnings.append(f"{bad} measured event(s) lacked a numeric start_s <= end_s and were skipped")
    return out


def _event(e: Any, *, device: int, pipeline: int, stage: int) -> Event | None:
    if not isinstance(e, dict):
        return None
    start, end = _as_float(e.get("start_s")), _as_float(e.get("end_s"))
    if start is None or end is None or end < start:
        return None
    # The runtime logs {"op", "mb"}; other producers may write {"name", "micro_batch"}.
    name = str(e.get("name", e.get("op", "?")))
    category = str(e.get("category") or _NAME_CATEGORY.get(name.upper(), "other")).lower()
    if category == "all-reduce":
        category = "allreduce"
    return Event(device=device, category=category, name=name, start_s=start, end_s=end, pipeline=pipeline,
                 stage=stage, micro_batch=_as_int(e.get("micro_batch", e.get("mb"))))


def _as_float(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        return None
    return float(v)


def _as_int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None
