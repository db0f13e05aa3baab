"""ZB-H1: zero-bubble pipelining at 1F1B's activation memory (Qi et al., "Zero Bubble Pipeline
Parallelism", ICLR 2024, section 2.1 and Figure 3 top).

The backward of each micro-batch is split into ``B`` (the input gradient, which the previous stage
waits for) and ``W`` (the weight gradients, which nobody waits for). Stage s of p runs 1F1B's
warm-up forwards, w = min(p - s - 1, m), and 1F1B's F/B alternation, but defers each W by s
micro-batches (W(j - s) follows B(j)), flushing the last s at the end: the later stages, whose
warm-up is shortest, send their input gradients upstream sooner, the first stage's wait for its
first gradient shrinks from (p - 1) full backwards to (p - 1) B's, and the deferred W's fill the
later stages' tails. Every stage then holds min(m, p) micro-batches from F until W, the first
stage's 1F1B peak (the later stages hold more than under 1F1B: our memory model counts a
micro-batch as fully held until its W).

How the backward splits: a transformer layer's backward runs, for each of its weight GEMMs Y = X A,
one GEMM for dX = dY A^T (B) and one of the same FLOPs for dA = X^T dY (W); the attention-score
backward and the elementwise ops have no weights and go to B. So W's share of the backward is
linear / (2 x linear + 2 x attention) of the forward's FLOPs, just under one half at the sequence
lengths we train; the predictor and the planner assume one half (``DEFAULT_WEIGHT_GRAD_SHARE``).
A local emulation host measures its own B and W shares (small CPU layers: W ~0.26 of a backward;
``hethub.emulation.effects.HostEffects.split_backward``), which its replay uses instead.
"""

from __future__ import annotations

from collections.abc import Sequence

from hethub.schedules.base import Schedule, T, interleaved

# Assumed where no model shape is at hand: W is half of the backward (the weight GEMMs' FLOPs equal
# the input-gradient GEMMs', and the weightless attention backward is small at short sequences).
DEFAULT_WEIGHT_GRAD_SHARE = 0.5


class ZeroBubbleH1(Schedule):
    """ZB-H1, see the module docstring. Op order of stage s of p with m micro-batches, w = min(p - s - 1, m):
    F0..F(w-1); then for j < m - w: F(w + j), B(j), W(j - s) when j >= s; then for the remaining
    j: B(j), W(j - s) when j >= s; then the W's still deferred, in order."""

    name = "zb-h1"
    split_backward = True

    def order(self, *, stage: int, num_stages: int, alphabet: tuple[list[T], list[T], list[T]]) -> Sequence[T]:
        fwd, bwd, wgt = alphabet
        m, d = len(fwd), stage
        w = min(num_stages - stage - 1, m)
        # Micro-batch j's group is F(w + j) while j < m - w, then B(j), then W(j - d) once j >= d: the
        # groups keep one shape between the two thresholds, so each run of them is laid out by slices
        # (long pipelines' orders hold ~1e5 ops).
        lo, hi = min(m - w, d), min(max(m - w, d), m)
        out = fwd[:w]
        out += interleaved(fwd[w:w + lo], bwd[:lo])  # F, B
        if m - w <= d:
            out += bwd[lo:hi]  # B alone
        else:
            out += interleaved(fwd[w + lo:w + hi], bwd[lo:hi], wgt[lo - d:hi - d])  # F, B, W
        out += interleaved(bwd[hi:m], wgt[hi - d:m - d])  # B, W
        out += wgt[max(0, m - d):m]
        return out

    def in_flight(self, *, stage: int, num_stages: int, num_micro_batches: int) -> int:
        return min(num_micro_batches, num_stages)

    def per_micro_batch_s(self, *, fwd_s: Sequence[float], bwd_s: Sequence[float]) -> float:
        # The steady state still runs one F, B and W per micro-batch on the slowest stage.
        return max(f + b for f, b in zip(fwd_s, bwd_s, strict=True))

    def fill_drain_s(self, *, fwd_s: Sequence[float], bwd_s: Sequence[float], p2p_s: Sequence[float],
                     per_micro_batch_s: float) -> float:
        """The paper's bubble, (p - 1)(F + B - W) for equal stages with F = B = W, generalised: the
        first stage idles while its first gradient comes back through the later stages' B's, and the
        last stage starts after the earlier stages' F's; whichever is longer, plus both transfers per
        hop. Exact on equal stages with m >= p (the tests); a few percent from the event simulation on
        random unequal pipelines, as 1F1B's closed form."""
        share = DEFAULT_WEIGHT_GRAD_SHARE
        return max(sum(fwd_s[1:]), sum(b * (1.0 - share) for b in bwd_s[1:])) + 2 * sum(p2p_s[:len(fwd_s) - 1])

    def fill_work_floor_s(self, *, work_s: float, bottleneck_s: float) -> float:
        # With q = 1 - share: max(sum F, q sum B) over the later stages is at least their mix
        # (q sum F + q sum B) / (1 + q) = lam x (their work), lam = q / (1 + q), whatever F's share of
        # each stage's F + B; their work is the whole less stage 0's (at most the period), so
        # fill_drain + per >= lam work + (1 - lam) per, which grows with per >= the bottleneck.
        q = 1.0 - DEFAULT_WEIGHT_GRAD_SHARE
        lam = q / (1.0 + q)
        return lam * work_s + (1.0 - lam) * bottleneck_s

    def stage_finish_s(self, *, step_s: float, bwd_s: Sequence[float], p2p_s: Sequence[float]) -> list[float]:
        # The later stages fill their tails with deferred W's; they finish at most when the first does.
        return [step_s] * len(bwd_s)
