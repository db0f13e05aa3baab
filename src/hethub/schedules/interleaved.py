"""Interleaved 1F1B: virtual pipeline stages (Narayanan et al., "Efficient Large-Scale Language Model
Training on GPU Clusters Using Megatron-LM", SC 2021, section 2.2.2; Megatron-LM's
``forward_backward_pipelining_with_interleaving``).

Each of the p devices of a pipeline holds v model chunks: chunk c of device s is virtual stage
k = c x p + s, so a micro-batch runs through device 0's chunk 0, device 1's chunk 0, ..., device
p-1's chunk 0, then device 0's chunk 1, and so on (the last device's chunk c sends to the first
device's chunk c + 1). Each chunk is 1/v of the device's work, so the fill and drain shrink by v;
the price is v times as many point-to-point transfers and more activations in flight.

Op order, as Megatron-core computes it (``get_schedule_table``, ``microbatch_group_size_per_vp_stage``
= p, its default). The m micro-batches are taken in groups of g = p; within a group a device runs
chunk 0 of each micro-batch, then chunk 1 of each, ... That gives the m x v forward "virtual
micro-batches" in order; backward virtual micro-batch j is forward j's micro-batch on chunk
v - 1 - c. Device s runs w warm-up forwards, w = min(2 (p - s - 1) + (v - 1) g, m v) — or all m v
when m = p, Megatron's special case — then alternates forward w + j with backward j, then the
backwards left.

Where m is no multiple of p, Megatron-core's table makes the m mod p left over a last, smaller
group; with the warm-up above that order has a true dependency cycle (p = 6, v = 2, m = 8: device 5
waits for chunk 1's gradient of micro-batch 0 from device 0, which first runs micro-batch 7's
chunk-1 forward, which waits for device 5's chunk-0 forward of it, queued behind that backward).
Here the left-over micro-batches join the *first* group instead (g = p + m mod p micro-batches,
then groups of p), and the warm-up counts that first group, w = min(2 (p - s - 1) + (v - 1) g, m v):
every order is then causal and free of cycles on every shape the tests simulate, and the closed form
below stays exact for every m >= p; the price is (v - 1)(m mod p) more chunk activations in flight.
Megatron refuses m < p; here the one group holds all m micro-batches (g = m), so a pipeline with
fewer micro-batches than devices still runs, with a longer step than the closed form (the planner
never gives an interleaved pipeline m < p).

With v = 1 the schedule is 1F1B (Megatron runs its non-interleaved schedule then): the same op order,
in-flight rule and closed form.

Activations: a device holds one chunk's activations per (micro-batch, chunk) between its F and its
B; ``in_flight`` counts those at the peak, w + 1 (or m v when there is no steady state). Chunks may
hold unequal layer counts, so the memory at the peak is the largest total of held chunks' sizes:
``peak_held`` walks the op order with each chunk's weight, which the predictor uses.

Closed form (uniform stages, no transfers, m >= p: exact, the tests): T(m) = m (F + B)
+ (p - 1)(F + B) / v, with F and B a device's whole forward and backward over its v chunks — the
paper's bubble shrunk by v. Generalised to unequal devices as 1F1B's: per micro-batch the slowest
device's F + B, plus (sum over devices of F + B, less that) / v; plus the transfers of one
micro-batch's round trip through all v p - 1 hops (each chunk's p - 1 hops within the pipeline and
the v - 1 wraps from the last device back to the first).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

from hethub.schedules.base import Op, Schedule, T
from hethub.schedules.classic import OneFOneB

_ONE_F_ONE_B = OneFOneB()


def group_size(*, num_stages: int, num_micro_batches: int) -> int:
    """Micro-batches of the first group, run back to back on one chunk before the next chunk:
    Megatron's p, plus m mod p where m is no multiple of p, at most m (module docstring)."""
    p, m = num_stages, num_micro_batches
    return m if m <= p else p + m % p


@functools.lru_cache(maxsize=4096)
def _table(m: int, v: int, p: int) -> tuple[tuple[int, int], ...]:
    """(micro-batch, chunk) of each forward virtual micro-batch: Megatron-core's get_schedule_table,
    except that the left-over micro-batches join the first group."""
    first = group_size(num_stages=p, num_micro_batches=m)
    starts = [0, *range(first, m, p)]
    out: list[tuple[int, int]] = []
    for j, lo in enumerate(starts):
        hi = starts[j + 1] if j + 1 < len(starts) else m
        out += [(i, c) for c in range(v) for i in range(lo, hi)]
    return tuple(out)


def warmup_forwards(*, stage: int, num_stages: int, num_micro_batches: int, chunks: int) -> int:
    """Megatron's warm-up count for device ``stage``: forwards before the first backward."""
    p, m, v = num_stages, num_micro_batches, chunks
    total = m * v
    if m == p:  # Megatron: "all warm-up" when the micro-batches just fill the pipeline
        return total
    return min(2 * (p - stage - 1) + (v - 1) * group_size(num_stages=p, num_micro_batches=m), total)


@functools.lru_cache(maxsize=65536)
def _max_in_flight(stage: int, p: int, v: int) -> int:
    """Interleaved.max_in_flight for v > 1: O(p) each, and the planner asks it per stage of every
    template it sizes (O(p^2) per template), so it is kept."""
    sched = Interleaved(v)
    return max(sched.in_flight(stage=stage, num_stages=p, num_micro_batches=m) for m in range(p, 2 * p))


class Interleaved(Schedule):
    """Interleaved 1F1B with ``chunks`` (v) model chunks per device; see the module docstring.
    The registry holds v = 1; ``with_chunks(v)`` gives the schedule a pipeline with v chunks runs."""

    name = "interleaved"

    def __init__(self, chunks: int = 1) -> None:
        if chunks < 1:
            raise ValueError(f"virtual stages per device must be >= 1, got {chunks}")
        self.chunks_per_stage = chunks  # type: ignore[misc]  # per instance: v differs between pipelines

    def with_chunks(self, chunks: int) -> Schedule:
        return self if chunks == self.chunks_per_stage else Interleaved(chunks)

    # ---- op order ---------------------------------------------------------------------------------
    def order(self, *, stage: int, num_stages: int, alphabet: tuple[list[T], list[T], list[T]]) -> Sequence[T]:
        """1F1B's at v 1; with virtual stages an op names its chunk too, so only `ops` gives the order."""
        if self.chunks_per_stage != 1:
            raise ValueError(f"the interleaved schedule at v {self.chunks_per_stage} has its ops' chunks: read ops()")
        return _ONE_F_ONE_B.order(stage=stage, num_stages=num_stages, alphabet=alphabet)

    def ops(self, *, stage: int, num_stages: int, num_micro_batches: int) -> tuple[Op, ...]:
        v = self.chunks_per_stage
        if v == 1:
            return _ONE_F_ONE_B.ops(stage=stage, num_stages=num_stages, num_micro_batches=num_micro_batches)
        return _ops(stage, num_stages, num_micro_batches, v)

    # ---- activation memory ------------------------------------------------------------------------
    def in_flight(self, *, stage: int, num_stages: int, num_micro_batches: int) -> int:
        """(micro-batch, chunk) activations the device holds at its peak (micro-batches when v = 1)."""
        v, m = self.chunks_per_stage, num_micro_batches
        if v == 1:
            return _ONE_F_ONE_B.in_flight(stage=stage, num_stages=num_stages, num_micro_batches=m)
        w = warmup_forwards(stage=stage, num_stages=num_stages, num_micro_batches=m, chunks=v)
        return min(w + 1, m * v)

    def max_in_flight(self, *, stage: int, num_stages: int) -> int | None:
        # The first group grows with m up to p, then repeats with m mod p (largest at m = 2p - 1);
        # m = p's all-warm-up holds p v: the bound is the largest over m = p .. 2p - 1.
        v, p = self.chunks_per_stage, num_stages
        if v == 1:
            return _ONE_F_ONE_B.max_in_flight(stage=stage, num_stages=p)
        return _max_in_flight(stage, p, v)

    def planning_in_flight(self, *, stage: int, num_stages: int, expected_micro_batches: int) -> int:
        """What the planner sizes a stage for, in micro-batches of the whole stage (its memory model's
        unit): the most chunk activations held at any m (``max_in_flight``) over v, rounded up (equal
        chunks). The predictor then checks the plan's own m and chunks exactly."""
        v, p = self.chunks_per_stage, num_stages
        if v == 1:
            return _ONE_F_ONE_B.planning_in_flight(stage=stage, num_stages=p,
                                                   expected_micro_batches=expected_micro_batches)
        held = self.max_in_flight(stage=stage, num_stages=p)
        return -(-held // v) if held is not None else expected_micro_batches

    def peak_held(self, *, stage: int, num_stages: int, num_micro_batches: int,
                  chunk_weights: Sequence[float]) -> float:
        """The most the device holds at once when a held (micro-batch, chunk c) weighs
        ``chunk_weights[c]`` (e.g. its activation bytes): exact for unequal chunks."""
        if len(chunk_weights) != self.chunks_per_stage:
            raise ValueError(f"need {self.chunks_per_stage} chunk weights, got {len(chunk_weights)}")
        live = peak = 0.0
        for kind, _, c in self.ops(stage=stage, num_stages=num_stages, num_micro_batches=num_micro_batches):
            live += chunk_weights[c] if kind == "F" else -chunk_weights[c]
            peak = max(peak, live)
        return peak

    # ---- closed-form step -------------------------------------------------------------------------
    def per_micro_batch_s(self, *, fwd_s: Sequence[float], bwd_s: Sequence[float]) -> float:
        return max(f + b for f, b in zip(fwd_s, bwd_s, strict=True))

    def fill_drain_s(self, *, fwd_s: Sequence[float], bwd_s: Sequence[float], p2p_s: Sequence[float],
                     per_micro_batch_s: float) -> float:
        """``fwd_s``/``bwd_s``: each device's whole forward/backward (all its chunks); ``p2p_s``: the
        hop from device s to s + 1, and (a p-th entry, optional) from the last device to the first,
        which the v - 1 wraps take (the largest hop when it is absent)."""
        v, p = self.chunks_per_stage, len(fwd_s)
        inner = list(p2p_s[:p - 1])
        wrap = p2p_s[p - 1] if len(p2p_s) >= p else max(inner, default=0.0)
        transfers = 2 * (v * sum(inner) + (v - 1) * wrap) if p > 1 else 0.0
        return (sum(fwd_s) + sum(bwd_s) - per_micro_batch_s) / v + transfers

    def fill_work_floor_s(self, *, work_s: float, bottleneck_s: float) -> float:
        # fill_drain + per = (work - per) / v + per >= work / v + bottleneck (1 - 1/v).
        v = self.chunks_per_stage
        return work_s / v + bottleneck_s * (1.0 - 1.0 / v)

    def stage_finish_s(self, *, step_s: float, bwd_s: Sequence[float], p2p_s: Sequence[float]) -> list[float]:
        # The last backward on each device is its chunk 0's; they ripple up chunk 0's p stages, each
        # a v-th of the device's backward.
        v = self.chunks_per_stage
        return super().stage_finish_s(step_s=step_s, bwd_s=[b / v for b in bwd_s], p2p_s=p2p_s)


@functools.lru_cache(maxsize=4096)
def _ops(s: int, p: int, m: int, v: int) -> tuple[Op, ...]:
    table = _table(m, v, p)
    total = m * v
    w = warmup_forwards(stage=s, num_stages=p, num_micro_batches=m, chunks=v)
    fwd = [Op("F", i, c) for i, c in table]
    bwd = [Op("B", i, v - 1 - c) for i, c in table]
    out = fwd[:w]
    for j in range(total - w):
        out += (fwd[w + j], bwd[j])
    out += bwd[total - w:]
    return tuple(out)
