"""The two classic schedules: one model chunk per device, one backward op per micro-batch."""

from __future__ import annotations

from collections.abc import Sequence

from hethub.schedules.base import Op, Schedule

# Ops are immutable, so every op order shares one Op per (kind, micro-batch): a long pipeline's
# orders hold ~1e5 ops, and building them is then list slicing rather than object creation.
_FWD: list[Op] = []
_BWD: list[Op] = []


def _fwd_bwd(m: int) -> tuple[list[Op], list[Op]]:
    """The forward and backward ops of micro-batches 0..m-1."""
    for i in range(len(_FWD), m):
        _FWD.append(Op("F", i))
        _BWD.append(Op("B", i))
    return _FWD[:m], _BWD[:m]


class OneFOneB(Schedule):
    """1F1B (PipeDream-Flush, Megatron's default): stage s of p runs w = min(p - s - 1, m) warm-up
    forwards F0..F(w-1); then the remaining m - w forwards alternate with backwards F(w), B0,
    F(w+1), B1, ...; then the last w backwards. This also holds for m < p. Stage s therefore holds
    at most p - s micro-batches (min(m, p - s)); the steady state runs at the slowest stage's
    forward + backward."""

    name = "1f1b"

    def ops(self, *, stage: int, num_stages: int, num_micro_batches: int) -> tuple[Op, ...]:
        m = num_micro_batches
        w = min(num_stages - stage - 1, m)
        fwd, bwd = _fwd_bwd(m)
        steady: list[Op] = [fwd[0]] * (2 * (m - w))
        steady[0::2] = fwd[w:]  # F(w + j), B(j) for j < m - w
        steady[1::2] = bwd[:m - w]
        return (*fwd[:w], *steady, *bwd[m - w:])

    def in_flight(self, *, stage: int, num_stages: int, num_micro_batches: int) -> int:
        return min(num_micro_batches, num_stages - stage)

    def per_micro_batch_s(self, *, fwd_s: Sequence[float], bwd_s: Sequence[float]) -> float:
        return max(f + b for f, b in zip(fwd_s, bwd_s, strict=True))


class GPipe(Schedule):
    """GPipe: every stage runs all forwards F0..F(m-1), then all backwards B0..B(m-1), so it holds
    all m micro-batches; forwards and backwards each stream at their slowest stage."""

    name = "gpipe"

    def ops(self, *, stage: int, num_stages: int, num_micro_batches: int) -> tuple[Op, ...]:
        fwd, bwd = _fwd_bwd(num_micro_batches)
        return (*fwd, *bwd)

    def in_flight(self, *, stage: int, num_stages: int, num_micro_batches: int) -> int:
        return num_micro_batches

    def per_micro_batch_s(self, *, fwd_s: Sequence[float], bwd_s: Sequence[float]) -> float:
        return max(fwd_s) + max(bwd_s)
