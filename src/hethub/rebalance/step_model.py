"""A small model of one training step from measured times: what another batch split or a moved layer
would cost.

Each pipeline's time for m micro-batches is the schedule's closed form (``hethub.schedules``: the one
home of the pipeline-step formula, T(m) = fill_drain + m x per_micro_batch) over its stages'
measured forward and backward per micro-batch (each stage at its slowest TP rank), plus ``extra_s``,
what the closed form leaves out of the measured span at the current count (transfers, waits): the
measured step at the current split is reproduced exactly, and another count moves along the
schedule's own line. The step is the slowest pipeline plus a tail that does not depend on the split
(gradient sync, optimizer), taken from the measured step.

A moved layer takes its cost with it at the speed of the stage that runs it: a stage's time is
split over its layers in proportion to their FLOPs (the head counted by its own FLOPs, the
embedding as free), so the sender loses one of its layer shares and the receiver gains one of its own.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from hethub.schedules import get_schedule


@dataclass(frozen=True)
class StageSpeed:
    fwd_s: float  # per micro-batch, the stage's slowest TP rank
    bwd_s: float
    layers: int
    head: bool = False


@dataclass(frozen=True)
class PipeModel:
    schedule: str
    chunks: int
    micro_batch_size: int
    stages: tuple[StageSpeed, ...]
    extra_s: float = 0.0  # measured span less the closed form, at the count it was measured

    def affine(self) -> tuple[float, float]:
        """(a, b) with T(m) = a + b m: the schedule's fill and drain (plus ``extra_s``) and its period."""
        sched = get_schedule(self.schedule, chunks=self.chunks)
        fwd = [s.fwd_s for s in self.stages]
        bwd = [s.bwd_s for s in self.stages]
        per = sched.per_micro_batch_s(fwd_s=fwd, bwd_s=bwd)
        fill = sched.fill_drain_s(fwd_s=fwd, bwd_s=bwd, p2p_s=[0.0] * (len(fwd) - 1), per_micro_batch_s=per)
        return fill + self.extra_s, per

    def time_s(self, m: int) -> float:
        a, b = self.affine()
        return a + b * m

    def fitted(self, *, span_s: float, m: int) -> PipeModel:
        """This model with ``extra_s`` set so that T(m) is the measured ``span_s``."""
        a, b = replace(self, extra_s=0.0).affine()
        return replace(self, extra_s=span_s - (a + b * m))

    def with_move(self, *, src: int, dst: int, head_layers: float) -> PipeModel:
        """The pipeline after one layer of stage ``src`` moves to the adjacent stage ``dst``; the head
        weighs ``head_layers`` layers (its FLOPs over a layer's)."""
        def share(s: StageSpeed) -> float:
            return 1.0 / (s.layers + (head_layers if s.head else 0.0))

        a, b = self.stages[src], self.stages[dst]
        out = list(self.stages)
        out[src] = replace(a, fwd_s=a.fwd_s * (1 - share(a)), bwd_s=a.bwd_s * (1 - share(a)), layers=a.layers - 1)
        out[dst] = replace(b, fwd_s=b.fwd_s * (1 + share(b)), bwd_s=b.bwd_s * (1 + share(b)), layers=b.layers + 1)
        return replace(self, stages=tuple(out))


def best_counts(pipes: Sequence[PipeModel], *, total_samples: int, caps: Sequence[int],
                prefer: Sequence[int]) -> tuple[tuple[int, ...], float] | None:
    """Micro-batch counts (each in [1, cap], the samples summing to ``total_samples``) that minimise the
    slowest pipeline's time, and that time; None if no counts fit. Among equal optima the counts
    nearest ``prefer`` (the current ones) win, so a balanced split is left alone."""
    lines = [p.affine() for p in pipes]
    sizes = [p.micro_batch_size for p in pipes]
    levels = sorted({a + b * k for (a, b), cap in zip(lines, caps, strict=True) for k in range(1, cap + 1)})
    lo, hi, found = 0, len(levels) - 1, None
    while lo <= hi:  # the smallest level at which the counts can add up
        mid = (lo + hi) // 2
        counts = _counts_at(levels[mid], lines, sizes, caps, total_samples, prefer)
        if counts is None:
            lo = mid + 1
        else:
            found, hi = counts, mid - 1
    if found is None:
        return None
    return found, max(a + b * k for (a, b), k in zip(lines, found, strict=True))


def _most_at(level: float, a: float, b: float, cap: int) -> int:
    """The most micro-batches a pipeline T(k) = a + b k finishes by ``level`` (0 if not even one)."""
    if b <= 0:
        return cap if a <= level else 0
    return max(0, min(cap, math.floor((level - a) / b * (1 + 1e-12) + 1e-12)))


def _counts_at(level: float, lines: list[tuple[float, float]], sizes: list[int], caps: Sequence[int],
               total: int, prefer: Sequence[int]) -> tuple[int, ...] | None:
    """Counts k_i in [1, most_i(level)] with sum k_i x size_i == total, or None."""
    most = [_most_at(level, a, b, cap) for (a, b), cap in zip(lines, caps, strict=True)]
    if min(most) < 1:
        return None
    if len(set(sizes)) == 1:
        return _equal_sizes(most, lines, size=sizes[0], total=total, prefer=prefer)
    return _subset_sum(most, sizes, total=total, prefer=prefer)


def _equal_sizes(most: list[int], lines: list[tuple[float, float]], *, size: int, total: int,
                 prefer: Sequence[int]) -> tuple[int, ...] | None:
    if total % size:
        return None
    need = total // size
    if sum(most) < need or len(most) > need:
        return None
    counts = list(most)
    # Take back the surplus one micro-batch at a time from the pipeline finishing last (ties: the one
    # holding more than it holds now), which keeps every finish as low as it can be.
    while sum(counts) > need:
        i = max((i for i in range(len(counts)) if counts[i] > 1),
                key=lambda i: (lines[i][0] + lines[i][1] * counts[i], counts[i] - prefer[i], -i))
        counts[i] -= 1
    return tuple(counts)


def _shift_or(x: int, step: int, n: int) -> int:
    """OR of x << (k x step) for k in 0..n-1, in O(log n) big-integer operations."""
    out, acc, offset, span = 0, x, 0, 1
    while n:
        if n & 1:
            out |= acc << offset
            offset += span * step
        acc |= acc << (span * step)
        span *= 2
        n >>= 1
    return out


def _subset_sum(most: list[int], sizes: list[int], *, total: int, prefer: Sequence[int]) -> tuple[int, ...] | None:
    """Unequal micro-batch sizes: which sums each prefix of pipelines reaches (a bit set per prefix),
    then counts read back from the last pipeline, each nearest its preferred count."""
    mask = (1 << (total + 1)) - 1
    reach = [1]
    for k_max, u in zip(most, sizes, strict=True):
        reach.append(_shift_or(reach[-1] << u, u, k_max) & mask)
    if not (reach[-1] >> total) & 1:
        return None
    counts, left = [0] * len(most), total
    for i in range(len(most) - 1, -1, -1):
        u = sizes[i]
        for k in sorted(range(1, most[i] + 1), key=lambda k: (abs(k - prefer[i]), k)):
            if left - k * u >= 0 and (reach[i] >> (left - k * u)) & 1:
                counts[i], left = k, left - k * u
                break
    return tuple(counts)


def count_cap(schedule: str, *, chunks: int, num_stages: int, planned: int, total: int) -> int:
    """The most micro-batches a pipeline may take without holding more activations at any stage than
    at its planned count (the count its memory was checked at): unbounded (``total``) for schedules
    whose in-flight count stops growing (1F1B once m >= p), ``planned`` for GPipe."""
    sched = get_schedule(schedule, chunks=chunks)

    def held(m: int) -> tuple[int, ...]:
        return tuple(sched.in_flight(stage=s, num_stages=num_stages, num_micro_batches=m) for s in range(num_stages))

    base = held(planned)
    m = planned
    while m < total and all(h <= b for h, b in zip(held(m + 1), base, strict=True)):
        m += 1
    return m
