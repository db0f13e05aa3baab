"""The two classic schedules: one model chunk per device, one backward op per micro-batch."""

from __future__ import annotations

from collections.abc import Sequence

from hethub.schedules.base import Schedule, T, interleaved


class OneFOneB(Schedule):
    """1F1B (PipeDream-Flush, Megatron's default): stage s of p runs w = min(p - s - 1, m) warm-up
    forwards F0..F(w-1); then the remaining m - w forwards alternate with backwards F(w), B0,
    F(w+1), B1, ...; then the last w backwards. This also holds for m < p. Stage s therefore holds
    at most p - s micro-batches (min(m, p - s)); the steady state runs at the slowest stage's
    forward + backward."""

    name = "1f1b"

    def order(self, *, stage: int, num_stages: int, alphabet: tuple[list[T], list[T], list[T]]) -> Sequence[T]:
        fwd, bwd, _ = alphabet
        m = len(fwd)
        w = min(num_stages - stage - 1, m)
        return [*fwd[:w], *interleaved(fwd[w:], bwd[:m - w]), *bwd[m - w:]]  # F(w + j), B(j) for j < m - w

    def in_flight(self, *, stage: int, num_stages: int, num_micro_batches: int) -> int:
        return min(num_micro_batches, num_stages - stage)

    def per_micro_batch_s(self, *, fwd_s: Sequence[float], bwd_s: Sequence[float]) -> float:
        return max(f + b for f, b in zip(fwd_s, bwd_s, strict=True))

    def period_s(self, *, fwd_s: Sequence[float], bwd_s: Sequence[float], p2p_s: Sequence[float]) -> float:
        per = self.per_micro_batch_s(fwd_s=fwd_s, bwd_s=bwd_s)
        return max(per, round_trip_period_s(fwd_s, bwd_s, p2p_s)) if any(p2p_s) else per

    def period_floor_s(self, *, bottleneck_s: float, work_s: float, p2p_s: float, max_hop_s: float,
                       max_pair_s: float, stages: int) -> float:
        # round_trip_period_s's windows under floors of their terms: the whole pipeline, the slowest
        # adjacent pair, the slowest hop.
        if p2p_s <= 0:
            return bottleneck_s
        return max(bottleneck_s, (work_s + 2 * p2p_s) / stages, max_hop_s, max_pair_s)


def round_trip_period_s(fwd_s: Sequence[float], bwd_s: Sequence[float], p2p_s: Sequence[float]) -> float:
    """A floor under 1F1B's steady-state period with transfers (the event simulation's): for stages
    s..t, B(t, i) -> B(s, i) -> F(s, i + p - s) -> F(t, i + p - s) -> B(t, i + t - s + 1) is a cycle
    of the schedule's dependencies, so the period is at least the window's forwards and backwards plus
    both transfers per hop inside it, over t - s + 1; and a link carries one message at a time. All
    windows are O(p^2); this takes the whole pipeline's prefixes and suffixes and every adjacent pair,
    O(p), which includes the uniform pipeline's 2 c (p - 1) / p and the slow hop between two kinds."""
    p = len(fwd_s)
    work = [f + b for f, b in zip(fwd_s, bwd_s, strict=True)]
    hops = list(p2p_s[:p - 1])
    best = max(hops, default=0.0)
    for s in range(p - 1):
        best = max(best, (work[s] + work[s + 1] + 2 * hops[s]) / 2)
    head = tail = 0.0
    for n in range(1, p + 1):
        head += work[n - 1] + (2 * hops[n - 2] if n > 1 else 0.0)
        tail += work[p - n] + (2 * hops[p - n] if n > 1 else 0.0)
        best = max(best, head / n, tail / n)
    return best


class GPipe(Schedule):
    """GPipe: every stage runs all forwards F0..F(m-1), then all backwards B0..B(m-1), so it holds
    all m micro-batches; forwards and backwards each stream at their slowest stage."""

    name = "gpipe"

    def order(self, *, stage: int, num_stages: int, alphabet: tuple[list[T], list[T], list[T]]) -> Sequence[T]:
        fwd, bwd, _ = alphabet
        return [*fwd, *bwd]

    def in_flight(self, *, stage: int, num_stages: int, num_micro_batches: int) -> int:
        return num_micro_batches

    def per_micro_batch_s(self, *, fwd_s: Sequence[float], bwd_s: Sequence[float]) -> float:
        return max(fwd_s) + max(bwd_s)
