"""Colours and the headless figure factory shared by the report's pictures."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

# Okabe-Ito-like, distinguishable for common colour-vision deficiencies.
CATEGORY_COLOURS = {
    "forward": "#0072B2",
    "backward": "#E69F00",
    "recompute": "#F0E442",
    "p2p": "#009E73",
    "allreduce": "#CC79A7",
    "optimizer": "#555555",
    "wait": "#BBBBBB",
    "other": "#999999",
}
IDLE_COLOUR = "#EEEEEE"
MEMORY_COLOURS = {"weights": "#4C72B0", "grads": "#55A868", "optimizer": "#C44E52", "activations": "#8172B2"}
OVER_CAPACITY = "#D62728"


# tab20 pairs dark/light of one hue; dark ones first so neighbouring rows differ most. Red (6, 7)
# is left out: it marks memory over capacity.
_TAB20_ORDER = (0, 2, 4, 8, 10, 12, 14, 16, 18, 1, 3, 5, 9, 11, 13, 15, 17, 19)


# One hue per device kind once rows outnumber tab20 (Okabe-Ito, without its red: red marks memory over
# capacity): 48 shades of a continuous map cannot be told apart, a kind's hue and a stage's shade can.
_KIND_HUES = ("#0072B2", "#E69F00", "#009E73", "#CC79A7", "#56B4E9", "#F0E442", "#000000", "#999999")


def row_colour(row: Any, rows: Sequence[Any]) -> Any:
    """The colour of stage row ``row`` among all ``rows``: a distinct tab20 colour per row while there
    are at most 18; beyond, the row's kind's hue, dark and light on alternate stages of a pipeline."""
    from matplotlib import colormaps
    from matplotlib.colors import to_rgba

    if len(rows) <= len(_TAB20_ORDER):
        return colormaps["tab20"](_TAB20_ORDER[row.index])
    kinds = list(dict.fromkeys(r.kind for r in rows))
    r, g, b, _ = to_rgba(_KIND_HUES[kinds.index(row.kind) % len(_KIND_HUES)])
    mix = 0.0 if row.stage % 2 == 0 else 0.45  # odd stages: mixed with white
    return (r + (1 - r) * mix, g + (1 - g) * mix, b + (1 - b) * mix, 1.0)


def new_figure(width_in: float, height_in: float) -> Any:
    """A Figure on the Agg canvas: no pyplot, so no display and no global backend switch."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width_in, height_in), dpi=110)
    FigureCanvasAgg(fig)
    return fig


def text_colour_on(rgba: Any) -> str:
    r, g, b = rgba[:3]
    return "black" if 0.299 * r + 0.587 * g + 0.114 * b > 0.55 else "white"


def fmt_time(seconds: float) -> str:
    if seconds >= 10:
        return f"{seconds:.1f} s"
    if seconds >= 1:
        return f"{seconds:.2f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.3g} ms"
    return f"{seconds * 1e6:.3g} µs"


def colour_row_labels(ax: Any, rows: Any, *, all_rows: Sequence[Any], texts: list[str], fontsize: float,
                      pad: float) -> None:
    """Y tick labels on a stage row's colour, in a text colour readable on it."""
    ax.set_yticks(range(len(texts)))
    labels = ax.set_yticklabels(texts, fontsize=fontsize)
    for r, lab in zip(rows, labels, strict=True):
        colour = row_colour(r, all_rows)
        lab.set_bbox({"facecolor": colour, "edgecolor": "none", "pad": pad})
        lab.set_color(text_colour_on(colour))
    ax.tick_params(axis="y", length=0)
