"""The step timeline as a Chrome trace (Perfetto, chrome://tracing): complete events ("ph": "X").

One process per pipeline (predicted, and measured ones after them), one thread per device *lane*.
Trace viewers draw overlapping events on one thread as a broken stack, and the predictor lets p2p
sends overlap compute, so every device gets a compute lane and a communication lane, and any
further overlap inside a lane spills into an extra lane. Events of one (pid, tid) never overlap.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from hethub.plan import Plan
from hethub.predict.result import Event
from hethub.report.groups import stage_rows, timeline_devices

COMM_CATEGORIES = frozenset({"p2p", "allreduce", "wait"})
MEASURED_PID_OFFSET = 1000  # measured pipelines follow the predicted ones in the viewer
_LANES_PER_DEVICE = 1000  # tid = device * this + lane; far more lanes than any device needs


def trace_events(plan: Plan, events: Iterable[Event], *, pid_offset: int = 0, label: str = "predicted",
                 device_labels: dict[int, str] | None = None, pipeline_labels: dict[int, str] | None = None
                 ) -> list[dict[str, Any]]:
    """Metadata + X events for one timeline (predicted or measured). ``device_labels`` and
    ``pipeline_labels`` name a traced device / pipeline that stands for several identical ones."""
    rank = plan.rank_of_device()
    by_device: dict[int, list[Event]] = defaultdict(list)
    for e in events:
        by_device[e.device].append(e)
    out: list[dict[str, Any]] = []
    pids: set[int] = set()
    for device in sorted(by_device):
        evs = sorted(by_device[device], key=lambda e: (e.start_s, e.end_s))
        pid = pid_offset + evs[0].pipeline
        if pid not in pids:
            pids.add(pid)
            what = (pipeline_labels or {}).get(evs[0].pipeline, f"pipeline {evs[0].pipeline}")
            out.append(_meta("process_name", pid, 0, {"name": f"{label}: {what}"}))
            out.append(_meta("process_sort_index", pid, 0, {"sort_index": pid}))
        lanes: list[tuple[str, float]] = []  # (class, end_us of last event) per lane
        for e in evs:
            cls = "comm" if e.category in COMM_CATEGORIES else "compute"
            ts, dur = _us(e.start_s), max(_us(e.end_s) - _us(e.start_s), 0.0)
            lane = next((i for i, (c, end) in enumerate(lanes) if c == cls and end <= ts), None)
            if lane is None:
                lane = len(lanes)
                lanes.append((cls, 0.0))
                tid = device * _LANES_PER_DEVICE + lane
                name = f"dev {device} (rank {rank.get(device, '?')}) s{e.stage} {cls}"
                if device_labels and device in device_labels:
                    name = f"{device_labels[device]} {cls}"
                out.append(_meta("thread_name", pid, tid, {"name": name + (f" #{lane}" if lane > 1 else "")}))
                # Compute above communication for each device, devices in id order.
                sort = tid + (0 if cls == "compute" else _LANES_PER_DEVICE // 2)
                out.append(_meta("thread_sort_index", pid, tid, {"sort_index": sort}))
            lanes[lane] = (cls, ts + dur)
            out.append({
                "name": e.name, "cat": e.category, "ph": "X", "ts": ts, "dur": dur, "pid": pid,
                "tid": device * _LANES_PER_DEVICE + lane,
                # The category is "cat" and the pipeline the process: not repeated in args (a 768-device
                # trace has ~10^5 events, and every repeated key is a megabyte).
                "args": {"micro_batch": e.micro_batch, "stage": e.stage, "device": device},
            })
    return out


def write_trace(path: Path, plan: Plan, predicted: Iterable[Event], measured: Iterable[Event] = ()) -> Path:
    """Every device of a small plan; for a large one (groups.timeline_devices) one device per stage row,
    named with how many devices it stands for: identical data-parallel replicas and TP peers do the
    same work, and tracing each of 768 devices made a 144 MB file no viewer opens comfortably."""
    keep = timeline_devices(plan)
    dev_labels: dict[int, str] | None = None
    pipe_labels: dict[int, str] | None = None
    if keep is not None:
        rows = stage_rows(plan)
        dev_labels = {plan.pipelines[r.pipeline].stages[r.stage].devices[0]:
                      f"s{r.stage} {r.kind} (traced once for {r.num_devices} devices: TP {r.tp} x "
                      f"{len(r.replicas)} replica{'s' if len(r.replicas) > 1 else ''})" for r in rows}
        pipe_labels = {r.pipeline: r.label.split(" · ")[0] for r in rows}
        predicted = [e for e in predicted if e.device in keep]
        measured = [e for e in measured if e.device in keep]
    evs = trace_events(plan, predicted, label="predicted", device_labels=dev_labels, pipeline_labels=pipe_labels)
    evs += trace_events(plan, measured, pid_offset=MEASURED_PID_OFFSET, label="measured", device_labels=dev_labels,
                        pipeline_labels=pipe_labels)
    doc = {"traceEvents": evs, "displayTimeUnit": "ms",
           "otherData": {"generator": "hethub report", "plan_strategy": plan.strategy}}
    # Compact separators: a 768-device step has ~10^5 events and indenting would triple the size.
    path.write_text(json.dumps(doc, separators=(",", ":")), encoding="utf-8")
    return path


def _us(seconds: float) -> float:
    # Round to nanoseconds so float noise cannot make back-to-back events overlap by 1e-12 µs.
    return round(seconds * 1e6, 3)


def _meta(name: str, pid: int, tid: int, args: dict[str, Any]) -> dict[str, Any]:
    return {"name": name, "ph": "M", "pid": pid, "tid": tid, "args": args}
