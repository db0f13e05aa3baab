"""The summary's account of online re-balancing: batch shares and stage sizes over the run, every
change with its reason and predicted gain, and the stragglers named (metrics field ``rebalance``,
written by the log rank each step: docs/rebalance.md)."""

from __future__ import annotations

from typing import Any

from hethub.report.metrics import MeasuredRun


def rebalance_markdown(measured: MeasuredRun) -> list[str]:
    """Lines of the section; none when the run logged no re-balancing."""
    steps = measured.rebalance
    if not steps:
        return []
    mode = steps[-1][1].get("mode", "?")
    out = ["## Re-balancing (measured)", "",
           f"Mode `{mode}`. Micro-batches per pipeline (shares) and layers per stage over the run; a change "
           "takes effect on the step after the one it was decided at.", "",
           "| steps | shares | layers per stage |", "|---|---|---|"]
    for first, last, rec in _segments(steps):
        span = f"{first}" if first == last else f"{first}-{last}"
        out.append(f"| {span} | {rec.get('shares')} | {rec.get('stage_layers')} |")
    changes = [(s, r["change"]) for s, r in steps if isinstance(r.get("change"), dict)]
    out += ["", f"Changes: {len(changes)}."]
    if changes:
        out += ["", "| after step | change | predicted step | gain | why |", "|---:|---|---:|---:|---|"]
        for s, c in changes:
            mv = c.get("move")
            what = f"shares {c.get('shares')}"
            if isinstance(mv, dict):
                what = f"layer {mv.get('layer')} of pipeline {mv.get('pipeline')}: stage {mv.get('src')} -> " \
                       f"{mv.get('dst')}; {what}"
            pred = f"{_num(c.get('predicted_step_s'))} s -> {_num(c.get('predicted_new_step_s'))} s"
            out.append(f"| {s} | {what} | {pred} | {_pct(c.get('predicted_gain'))} | {c.get('reason', '')} |")
    named = _stragglers(steps)
    listed = "; ".join(f"rank {r} from step {s} (up to {x:.2f}x)" for r, (s, x) in sorted(named.items()))
    out += ["", "Stragglers (time per micro-batch over the factor times the rank's prediction): "
            + (listed or "none.")]
    return out


def _segments(steps: tuple[tuple[int, dict[str, Any]], ...]) -> list[tuple[int, int, dict[str, Any]]]:
    """Runs of consecutive steps with the same shares and layers: (first, last, a record of the run)."""
    out: list[tuple[int, int, dict[str, Any]]] = []
    for s, rec in steps:
        key = (rec.get("shares"), rec.get("stage_layers"))
        if out and (out[-1][2].get("shares"), out[-1][2].get("stage_layers")) == key:
            out[-1] = (out[-1][0], s, out[-1][2])
        else:
            out.append((s, s, rec))
    return out


def _stragglers(steps: tuple[tuple[int, dict[str, Any]], ...]) -> dict[int, tuple[int, float]]:
    """rank -> (first step it was named, its largest ratio)."""
    out: dict[int, tuple[int, float]] = {}
    for s, rec in steps:
        for item in rec.get("stragglers") or ():
            if isinstance(item, dict) and isinstance(item.get("rank"), int):
                first, ratio = out.get(item["rank"], (s, 0.0))
                out[item["rank"]] = (first, max(ratio, float(item.get("ratio", 0.0))))
    return out


def _num(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, int | float) else "?"


def _pct(v: Any) -> str:
    return f"{v:.1%}" if isinstance(v, int | float) else "?"
