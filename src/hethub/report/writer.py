"""write_report: plan.png, timeline.png, trace.json and summary.md for one plan and its prediction."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from hethub.plan import Plan
from hethub.predict.result import Prediction
from hethub.report.metrics import MeasuredRun, read_metrics
from hethub.report.plan_fig import draw_plan
from hethub.report.summary import summary_markdown
from hethub.report.timeline_fig import draw_timeline
from hethub.report.trace import write_trace


@dataclass(frozen=True)
class ReportPaths:
    plan_png: Path | None  # None: pictures skipped (matplotlib, the plots extra, is not installed)
    timeline_png: Path | None
    trace_json: Path
    summary_md: Path
    note: str = ""  # why something was skipped

    @property
    def written(self) -> tuple[Path, ...]:
        return tuple(p for p in (self.plan_png, self.timeline_png, self.trace_json, self.summary_md) if p is not None)


def write_report(*, plan: Plan, prediction: Prediction, out_dir: str | Path,
                 metrics_path: str | Path | None = None) -> ReportPaths:
    """Write the report into ``out_dir`` (created if needed) and return the files' paths.

    ``prediction`` should come from ``predict(plan, timeline=True)``; without a timeline the
    pictures still render but the Gantt rows are empty. ``metrics_path`` is the run's metrics
    .jsonl (schema in docs/report.md); when it has per-rank events the measured timeline is drawn
    beside the predicted one.
    """
    try:
        import matplotlib  # noqa: F401  (the pictures only: the trace and the summary need nothing)
        pictures = True
    except ImportError:
        pictures = False
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    measured: MeasuredRun | None = read_metrics(metrics_path, plan=plan) if metrics_path is not None else None
    measured_events = [e for evs in measured.events.values() for e in evs] if measured else []
    paths = ReportPaths(plan_png=out / "plan.png" if pictures else None,
                        timeline_png=out / "timeline.png" if pictures else None, trace_json=out / "trace.json",
                        summary_md=out / "summary.md",
                        note="" if pictures else "pictures skipped: matplotlib is not installed. Fix: pip install "
                                                 "'hethub[plots]'")
    if paths.plan_png is not None and paths.timeline_png is not None:
        draw_plan(paths.plan_png, plan=plan, prediction=prediction)
        draw_timeline(
            paths.timeline_png, plan=plan, predicted=prediction.timeline, predicted_step_s=prediction.step_time_s,
            measured=measured_events or None,
            measured_step_s=measured.timeline_step_time_s if measured else None,
            measured_label=f"measured step {measured.timeline_step}" if measured else "measured",
        )
    write_trace(paths.trace_json, plan, prediction.timeline, measured_events)
    paths.summary_md.write_text(summary_markdown(plan=plan, prediction=prediction, measured=measured),
                                encoding="utf-8")
    return paths
