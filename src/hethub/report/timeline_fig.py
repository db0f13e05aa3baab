"""timeline.png: a Gantt chart of one training step, one row per stage, predicted and measured side by side.

Each row is one device of a stage (its TP peers do the same work); identical data-parallel replicas
share a row (see groups.py). Compute (forward, backward, optimizer) fills the upper band of a row;
communication (p2p sends, all-reduce) is a thin band beneath it because it may overlap compute;
the hatched grey background is the step's idle time, i.e. the pipeline bubble and exposed waits.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from hethub.plan import Plan
from hethub.predict.result import Event
from hethub.report._style import (
    CATEGORY_COLOURS,
    IDLE_COLOUR,
    colour_row_labels,
    fmt_time,
    new_figure,
    text_colour_on,
)
from hethub.report.analysis import COMPUTE_CATEGORIES, compute_busy_s
from hethub.report.groups import StageRow, representative_events, stage_rows

MAX_ROWS = 64
_ROW_IN = 0.42
_PANEL_IN = 7.5
_LABEL_IN = 3.6
_MIN_LABEL_PX = 14  # micro-batch numbers only on bars at least this wide
# Beyond this many micro-batches in a row, per-micro-batch boxes with borders become a barcode:
# forward and backward get half a band each and spans closer than a few pixels are drawn as one.
DENSE_MICRO_BATCHES = 24
_MERGE_PX = 3.5


def draw_timeline(path: Path, *, plan: Plan, predicted: Iterable[Event], predicted_step_s: float,
                  measured: Iterable[Event] | None = None, measured_step_s: float | None = None,
                  measured_label: str = "measured") -> Path:
    from matplotlib.patches import Patch

    all_rows = stage_rows(plan)
    rows = all_rows[:MAX_ROWS]
    pred = representative_events(predicted, rows)
    meas = representative_events(measured, rows) if measured is not None else {}
    panels: list[tuple[str, dict[int, list[Event]], float]] = [
        (f"predicted step: {fmt_time(predicted_step_s)}", pred, predicted_step_s)]
    if meas:
        m_end = max(e.end_s for evs in meas.values() for e in evs)
        # The logged step time can be shorter than the events (clocks, async ends): never cut events off.
        m_step = max(measured_step_s or 0.0, m_end)
        panels.append((f"{measured_label}: {fmt_time(m_step)}", meas, m_step))
    # One time axis for both panels so equal lengths mean equal times.
    x_max = max(max(step, _end(evs)) for _, evs, step in panels) * 1.02 or 1.0
    notes = _notes(plan, all_rows, rows)
    height = 1.3 + _ROW_IN * len(rows) + 0.2 * len(notes) + 0.5
    width = _LABEL_IN + _PANEL_IN * len(panels) + 0.3
    fig = new_figure(width, height)
    fig.suptitle(f"One training step of '{plan.strategy}' ({plan.model.name} on {plan.cluster.name}, "
                 f"{plan.schedule})", fontsize=11, fontweight="bold", y=1 - 0.12 / height, va="top")
    bottom_in = 0.55 + 0.2 * len(notes)
    ax0 = None
    for i, (title, evs, step_s) in enumerate(panels):
        ax = fig.add_axes(((_LABEL_IN + i * _PANEL_IN) / width, bottom_in / height, (_PANEL_IN - 0.3) / width,
                           _ROW_IN * len(rows) / height), sharey=ax0)
        ax0 = ax0 or ax
        _draw_panel(ax, rows, evs, step_s=step_s, x_max=x_max, all_rows=all_rows,
                    px_per_s=(_PANEL_IN - 0.3) * fig.dpi / x_max)
        ax.set_title(title, fontsize=10, loc="left")
        if i > 0:
            ax.tick_params(axis="y", labelleft=False)
    cats = sorted({e.category for _, evs, _ in panels for es in evs.values() for e in es},
                  key=lambda c: list(CATEGORY_COLOURS).index(c) if c in CATEGORY_COLOURS else 99)
    handles = [Patch(color=CATEGORY_COLOURS.get(c, CATEGORY_COLOURS["other"]), label=c) for c in cats]
    handles.append(Patch(facecolor=IDLE_COLOUR, edgecolor="#BBBBBB", hatch="///", label="idle / bubble"))
    fig.legend(handles=handles, loc="upper right", ncol=len(handles), fontsize=8, frameon=False,
               bbox_to_anchor=(1 - 0.2 / width, 1 - 0.45 / height))
    for j, note in enumerate(notes):
        fig.text(0.15 / width, (0.1 + 0.2 * (len(notes) - 1 - j)) / height, note, fontsize=7.5, style="italic")
    fig.savefig(path)
    return path


def _end(evs: dict[int, list[Event]]) -> float:
    return max((e.end_s for es in evs.values() for e in es), default=0.0)


def _draw_panel(ax: Any, rows: list[StageRow], events: dict[int, list[Event]], *, step_s: float, x_max: float,
                all_rows: list[StageRow], px_per_s: float) -> None:
    scale, unit = (1.0, "s") if x_max >= 2 else (1e3, "ms")
    for r in rows:
        y = r.index
        ax.barh(y, step_s * scale, left=0, height=0.8, color=IDLE_COLOUR, edgecolor="#CCCCCC", hatch="///",
                linewidth=0)
        evs = events.get(r.index, [])
        if not evs:
            ax.text(0.01 * x_max * scale, y, "no events", fontsize=7, va="center", color="#777777")
            continue
        by_cat: dict[str, list[tuple[float, float]]] = defaultdict(list)
        for e in evs:
            by_cat[e.category].append((e.start_s * scale, max(e.dur_s, 0.0) * scale))
        dense = len(by_cat.get("forward", ())) > DENSE_MICRO_BATCHES
        for cat, spans in by_cat.items():
            colour = CATEGORY_COLOURS.get(cat, CATEGORY_COLOURS["other"])
            if dense:
                spans = merge_spans(spans, gap=_MERGE_PX / px_per_s * scale)
            if dense and cat in ("forward", "backward"):
                ax.broken_barh(spans, (y - 0.4 + (0.28 if cat == "backward" else 0.0), 0.28), facecolors=colour,
                               linewidth=0)
            elif cat in COMPUTE_CATEGORIES:
                ax.broken_barh(spans, (y - 0.4, 0.56), facecolors=colour, edgecolor="white", linewidth=0.3)
            elif cat != "wait":  # waits are idle time: the background already shows them
                ax.broken_barh(spans, (y + 0.2, 0.2), facecolors=colour, linewidth=0)
        for e in () if dense else evs:  # micro-batch numbers where they fit
            if e.category in ("forward", "backward") and e.micro_batch is not None and e.dur_s * px_per_s >= \
                    _MIN_LABEL_PX:
                ax.text((e.start_s + e.dur_s / 2) * scale, y - 0.12, str(e.micro_batch), fontsize=6, ha="center",
                        va="center", color=text_colour_on(_rgb(CATEGORY_COLOURS[e.category])))
        idle = max(0.0, 1 - compute_busy_s(evs) / step_s) if step_s > 0 else 0.0
        ax.text(step_s * scale, y, f" idle {idle:.0%}", fontsize=7, va="center", ha="left")
    ax.set_xlim(0, x_max * scale * 1.08)
    ax.set_ylim(len(rows) - 0.5, -0.5)
    colour_row_labels(ax, rows, all_rows=all_rows, texts=[f"{r.label}\n{r.detail}" for r in rows], fontsize=7,
                      pad=1.0)
    ax.tick_params(axis="x", labelsize=8)
    ax.set_xlabel(f"time since step start ({unit})", fontsize=8.5)
    ax.grid(axis="x", color="#DDDDDD", linewidth=0.5)
    ax.set_axisbelow(True)
    ax.spines[["top", "right"]].set_visible(False)


def merge_spans(spans: list[tuple[float, float]], *, gap: float) -> list[tuple[float, float]]:
    """(start, width) spans, sorted, with neighbours less than ``gap`` apart joined into one."""
    out: list[tuple[float, float]] = []
    for start, width in sorted(spans):
        if out and start - (out[-1][0] + out[-1][1]) < gap:
            s0, w0 = out[-1]
            out[-1] = (s0, max(w0, start + width - s0))
        else:
            out.append((start, width))
    return out


def _notes(plan: Plan, all_rows: list[StageRow], rows: list[StageRow]) -> list[str]:
    notes = ["Each row shows one device of the stage; its TP peers do the same work. 'idle' = share of the "
             "step without compute (pipeline bubble, waits, exposed communication)."]
    most = max((p.num_micro_batches for p in plan.pipelines), default=0)
    if most > DENSE_MICRO_BATCHES:
        notes.append(f"Rows with more than {DENSE_MICRO_BATCHES} micro-batches (up to {most} here): forward in the "
                     "upper, backward in the lower half of the bar, neighbouring micro-batches merged; "
                     "trace.json has each one.")
    merged = [r for r in rows if len(r.replicas) > 1 and r.stage == 0]
    if merged:
        n_pipes = len(plan.pipelines)
        notes.append(f"{n_pipes} pipelines drawn as {len({r.pipeline for r in all_rows})} distinct shape(s): "
                     "identical data-parallel replicas share one row (the first replica's timeline).")
    if len(all_rows) > len(rows):
        notes.append(f"Only the first {len(rows)} of {len(all_rows)} stage rows are drawn.")
    return notes


def _rgb(hex_colour: str) -> tuple[float, float, float]:
    h = hex_colour.lstrip("#")
    return (int(h[0:2], 16) / 255, int(h[2:4], 16) / 255, int(h[4:6], 16) / 255)
