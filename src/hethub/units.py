"""The one way hethub writes quantities for people: layer ranges, memory, compute rates.

- Layer ranges: decoder layers ``start-last``, both included (``0-12``); one layer: ``4``; none:
  ``none``. Plan JSON stores the half-open ``[start, end)`` (``"layers": [0, 13]``), written ``0-12``.
- Memory: GiB (2^30 bytes) everywhere, device capacities included.
- Compute: FLOP/s with the prefix that keeps the number readable (``312 TFLOP/s``, ``100 GFLOP/s``).
"""

from __future__ import annotations

GIB = 1024**3


def fmt_layers(layers: tuple[int, int]) -> str:
    """Half-open ``(start, end)`` -> ``'start-last'`` (``(0, 13)`` -> ``'0-12'``)."""
    start, end = layers
    if end <= start:
        return "none"
    return str(start) if end - start == 1 else f"{start}-{end - 1}"


def fmt_chunks(ranges: tuple[tuple[int, int], ...]) -> str:
    """A stage's layer chunks (virtual stages) joined by '|' (``((0, 2), (8, 10))`` -> ``'0-1|8-9'``);
    one range as :func:`fmt_layers`."""
    return "|".join(fmt_layers(r) for r in ranges)


def fmt_gib(n_bytes: float, *, digits: int = 1) -> str:
    return f"{n_bytes / GIB:.{digits}f} GiB"


def fmt_flops(flops_per_s: float) -> str:
    for div, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M")):
        if flops_per_s >= div:
            v = flops_per_s / div
            return f"{v:.3g} {prefix}FLOP/s" if v < 100 else f"{v:.0f} {prefix}FLOP/s"
    return f"{flops_per_s:.3g} FLOP/s"
