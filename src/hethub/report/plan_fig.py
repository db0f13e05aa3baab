"""plan.png: the cluster by device kind and node, coloured by the stage each device serves.

Top: a map of every device, grouped by kind and node (outlined). Up to ``DETAILED_MAX_DEVICES``
devices each box carries its pipeline, stage, layers, TP and a memory gauge; beyond that boxes
are small unlabelled squares (768 labelled boxes are unreadable) and the details move to the
table below, whose row colours match the map.
Bottom: one row per stage (identical replicas merged), with memory use against usable capacity.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hethub.plan import Plan
from hethub.predict.result import Prediction, StagePrediction
from hethub.report._style import (
    MEMORY_COLOURS,
    OVER_CAPACITY,
    colour_row_labels,
    new_figure,
    row_colour,
    text_colour_on,
)
from hethub.report.groups import StageRow, row_of_stage, stage_predictions, stage_rows
from hethub.units import fmt_flops, fmt_gib

DETAILED_MAX_DEVICES = 64
MAX_TABLE_ROWS = 48
GIB = 1024**3
_MAP_WIDTH_IN = 13.0
_LEFT_IN = 0.9  # room for node-range labels left of the map


@dataclass(frozen=True)
class _Layout:
    detailed: bool
    box_in: float
    per_row: dict[str, int]  # kind -> nodes per grid row
    width_in: float  # of the widest grid row


def draw_plan(path: Path, *, plan: Plan, prediction: Prediction | None) -> Path:
    from matplotlib.patches import Patch

    rows = stage_rows(plan)
    by_stage = row_of_stage(rows)
    preds = stage_predictions(prediction)
    nodes = _nodes_by_kind(plan)
    lay = _layout(plan, nodes)
    map_h = _map_height_in(nodes, lay)
    shown = rows[:MAX_TABLE_ROWS]
    table_h = 0.3 * len(shown) + 0.9
    # Small clusters get a narrower figure; 11 in keeps room for the stage table's labels and bars.
    fig = new_figure(max(11.0, _LEFT_IN + lay.width_in + 0.4), 0.55 + map_h + 0.5 + table_h)
    fig_h = fig.get_figheight()
    title = (f"Plan '{plan.strategy}': {plan.model.name} on {plan.cluster.name} — {plan.world_size}/"
             f"{plan.cluster.num_devices} devices, {len(plan.pipelines)} pipeline(s), global batch "
             f"{plan.global_batch} × {plan.seq_len} tokens, {plan.schedule}")
    fig.suptitle(title, fontsize=11, fontweight="bold", y=1 - 0.15 / fig_h, va="top")

    ax = fig.add_axes((0, (table_h + 0.5) / fig_h, 1, map_h / fig_h))
    ax.set_xlim(0, fig.get_figwidth())
    ax.set_ylim(map_h, 0)
    ax.axis("off")
    _draw_map(ax, plan=plan, nodes=nodes, lay=lay, by_stage=by_stage, preds=preds, rows=rows)

    tax = fig.add_axes((4.9 / fig.get_figwidth(), 0.55 / fig_h, 1 - 5.6 / fig.get_figwidth(),
                        (table_h - 0.9) / fig_h))
    _draw_table(tax, shown, preds=preds, all_rows=rows)
    handles = [Patch(color=c, label=n) for n, c in MEMORY_COLOURS.items()]
    if lay.detailed:  # the compact map has no room for edges; the table's red text says it instead
        handles.append(Patch(facecolor="white", edgecolor=OVER_CAPACITY, linewidth=2, label="over capacity"))
    handles.append(Patch(facecolor="white", edgecolor="#999999", label="idle device"))
    # Anchored at the figure's left edge (not the table's) so it fits the narrow small-cluster figure.
    fig.legend(handles=handles, loc="lower left", ncol=len(handles), fontsize=8, frameon=False,
               bbox_to_anchor=(0.1 / fig.get_figwidth(), (table_h - 0.3) / fig_h))
    fig.savefig(path)
    return path


def _nodes_by_kind(plan: Plan) -> dict[str, list[list[int]]]:
    """kind -> its nodes in order, each the list of its device ids."""
    per_node: dict[int, list[int]] = defaultdict(list)
    for d in plan.cluster.devices:
        per_node[d.node].append(d.id)
    out: dict[str, list[list[int]]] = defaultdict(list)
    for node in sorted(per_node):
        out[plan.cluster.devices[per_node[node][0]].kind].append(per_node[node])
    return {k: out[k] for k in plan.cluster.kind_names if k in out}


def _layout(plan: Plan, nodes: dict[str, list[list[int]]]) -> _Layout:
    detailed = plan.cluster.num_devices <= DETAILED_MAX_DEVICES
    target = 16 if detailed else 64  # boxes per grid row
    per_row, widest = {}, 1.0
    for kind, ns in nodes.items():
        dpn = max(len(n) for n in ns)
        per_row[kind] = max(1, min(len(ns), target // dpn))
        widest = max(widest, per_row[kind] * (dpn + 0.5))  # half a box of gap between nodes
    box = min(0.9 if detailed else 0.3, (_MAP_WIDTH_IN - 0.2) / widest)
    return _Layout(detailed=detailed, box_in=box, per_row=per_row, width_in=widest * box)


def _grid_row_h(lay: _Layout) -> float:
    return lay.box_in + (0.22 if lay.detailed else 0.06)


def _map_height_in(nodes: dict[str, list[list[int]]], lay: _Layout) -> float:
    h = 0.0
    for kind, ns in nodes.items():
        grid_rows = -(-len(ns) // lay.per_row[kind])
        h += 0.4 + grid_rows * _grid_row_h(lay)
    return h + 0.3


def _draw_map(ax: Any, *, plan: Plan, nodes: dict[str, list[list[int]]], lay: _Layout,
              by_stage: dict[tuple[int, int], StageRow], preds: dict[tuple[int, int], StagePrediction],
              rows: list[StageRow]) -> None:
    from matplotlib.collections import PatchCollection
    from matplotlib.patches import Rectangle

    where = {d: (pi, si) for pi, p in enumerate(plan.pipelines) for si, s in enumerate(p.stages) for d in s.devices}
    b, y = lay.box_in, 0.15
    squares: list[Any] = []  # compact mode: one collection draws hundreds of squares ~10x faster than patches
    for kind, ns in nodes.items():
        k = plan.cluster.kinds[kind]
        used = sum(1 for n in ns for d in n if d in where)
        ax.text(0.1, y + 0.2, f"{kind}  —  {len(ns)} node(s), {sum(map(len, ns))} devices ({used} used), "
                f"{fmt_gib(k.mem_bytes)}, {fmt_flops(k.peak_flops)} peak", fontsize=9.5,
                fontweight="bold", va="center")
        y += 0.4
        per = lay.per_row[kind]
        for start in range(0, len(ns), per):
            gy = y + (0.2 if lay.detailed else 0.0)
            node0 = plan.cluster.devices[ns[start][0]].node
            node1 = plan.cluster.devices[ns[min(start + per, len(ns)) - 1][0]].node
            if not lay.detailed:
                label = f"node {node0}" if node0 == node1 else f"nodes {node0}–{node1}"
                ax.text(_LEFT_IN - 0.08, gy + b / 2, label, fontsize=7, ha="right", va="center")
            x = _LEFT_IN
            for node in ns[start:start + per]:
                if lay.detailed:
                    ax.text(x, gy - 0.04, f"node {plan.cluster.devices[node[0]].node}", fontsize=7, va="bottom")
                ax.add_patch(Rectangle((x - 0.03, gy - 0.03), len(node) * b + 0.06 - b * 0.06, b + 0.0,
                                       fill=False, edgecolor="#444444", linewidth=0.8))
                for i, d in enumerate(node):
                    if lay.detailed:
                        _draw_device(ax, x + i * b, gy, b, d=d, stage=where.get(d), by_stage=by_stage, preds=preds,
                                     rows=rows)
                    else:
                        st = where.get(d)
                        squares.append(Rectangle(
                            (x + i * b, gy), b * 0.94, b * 0.94, linewidth=0.5, edgecolor="#999999" if st is None
                            else "white", facecolor="white" if st is None else row_colour(by_stage[st], rows)))
                x += (len(node) + 0.5) * b
            y += _grid_row_h(lay)
    if squares:
        ax.add_collection(PatchCollection(squares, match_original=True))
    if not lay.detailed:
        ax.text(0.1, y + 0.05, "Each square is one device, outlined by node; colours match the stage rows below, "
                "which list layers, TP degree and memory.", fontsize=8, style="italic", va="top")


def _draw_device(ax: Any, x: float, y: float, b: float, *, d: int, stage: tuple[int, int] | None,
                 by_stage: dict[tuple[int, int], StageRow], preds: dict[tuple[int, int], StagePrediction],
                 rows: list[StageRow]) -> None:
    from matplotlib.patches import Rectangle

    s = b * 0.94
    if stage is None:
        ax.add_patch(Rectangle((x, y), s, s, facecolor="white", edgecolor="#999999", linewidth=0.5))
        ax.text(x + s / 2, y + s / 2, f"d{d}\nidle", fontsize=6.5, ha="center", va="center", color="#777777")
        return
    row = by_stage[stage]
    colour = row_colour(row, rows)
    sp = preds.get(stage)
    over = sp is not None and not sp.fits
    ax.add_patch(Rectangle((x, y), s, s, facecolor=colour, edgecolor=OVER_CAPACITY if over else "white",
                           linewidth=2 if over else 0.3))
    tc = text_colour_on(colour)
    lines = [f"d{d} · p{stage[0]} s{stage[1]}", f"L{row.layers_text} · TP{row.tp}"]
    if sp is not None:
        lines.append(f"{sp.peak_mem_bytes / GIB:.1f}/{sp.capacity_bytes / GIB:.0f} GiB")
    ax.text(x + s / 2, y + s * 0.42, "\n".join(lines), fontsize=6.5, ha="center", va="center", color=tc,
            linespacing=1.25)
    if sp is not None and sp.capacity_bytes > 0:
        frac = sp.peak_mem_bytes / sp.capacity_bytes
        ax.add_patch(Rectangle((x + s * 0.08, y + s * 0.8), s * 0.84, s * 0.1, facecolor="white", edgecolor=tc,
                               linewidth=0.4))
        ax.add_patch(Rectangle((x + s * 0.08, y + s * 0.8), s * 0.84 * min(frac, 1.0), s * 0.1,
                               facecolor=OVER_CAPACITY if frac > 1 else "#333333", linewidth=0))


def _draw_table(ax: Any, rows: list[StageRow], *, preds: dict[tuple[int, int], StagePrediction],
                all_rows: list[StageRow]) -> None:
    n = len(rows)
    max_frac = 1.0
    for r in rows:
        sp = preds.get((r.pipeline, r.stage))
        if sp is None or sp.capacity_bytes <= 0:
            ax.text(0.01, r.index, "no memory prediction", fontsize=7.5, va="center", color="#777777")
            continue
        left = 0.0
        for name, nbytes in (("weights", sp.weights_bytes), ("grads", sp.grads_bytes),
                             ("optimizer", sp.optimizer_bytes), ("activations", sp.activations_bytes)):
            w = nbytes / sp.capacity_bytes
            ax.barh(r.index, w, left=left, height=0.62, color=MEMORY_COLOURS[name], linewidth=0)
            left += w
        max_frac = max(max_frac, left)
        ax.text(left + 0.01, r.index, f"{sp.peak_mem_bytes / GIB:.1f} / {sp.capacity_bytes / GIB:.1f} GiB "
                f"({left:.0%})", fontsize=7.5, va="center", color=OVER_CAPACITY if left > 1 else "black")
    ax.axvline(1.0, color="black", linestyle="--", linewidth=0.8)
    ax.set_xlim(0, max_frac * 1.25)
    ax.set_ylim(n - 0.5, -0.5)
    colour_row_labels(ax, rows, all_rows=all_rows, texts=[f"{r.label}  |  {r.detail}" for r in rows], fontsize=7.5,
                      pad=1.2)
    ax.xaxis.set_major_formatter(_percent())
    more = f" (first {n} of {len(all_rows)} stage rows)" if len(all_rows) > n else ""
    ax.set_xlabel(f"peak memory per device, share of usable capacity (dashed line){more}", fontsize=8.5)
    ax.tick_params(axis="x", labelsize=8)
    ax.spines[["top", "right"]].set_visible(False)


def _percent() -> Any:
    from matplotlib.ticker import PercentFormatter

    return PercentFormatter(xmax=1.0)
