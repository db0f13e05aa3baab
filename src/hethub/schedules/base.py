"""What a pipeline schedule defines, once, for everyone who needs it.

A schedule is three things, and nothing else in hethub restates them:

* its **op order**: the sequence of ops each stage runs in one step. An op is a forward ``F``, a
  backward ``B`` (the input gradient; the whole backward where the schedule does not split it) or a
  weight-gradient pass ``W`` (split-backward schedules such as ZB-H1 run it apart from ``B``), of
  one micro-batch, on one model chunk of the stage's device (``chunk`` > 0 only for schedules with
  virtual stages, such as interleaved 1F1B). The runtime executes exactly this order and the
  predictor simulates it (:mod:`hethub.schedules.simulate`);
* its **in-flight rule**: how many micro-batches' activations a stage holds at its peak, which sizes
  activation memory in the predictor, the planner and the profiler;
* its **closed-form step**: T(m) = fill_drain + m x per_micro_batch, the pipeline's time for m
  micro-batches that the planner uses instead of a simulation (it must stay affine in m: the batch
  split solves a water level on it), and when each stage finishes relative to the first.

Pure Python, no torch and no other hethub import, so the plan validator can take the names from
the registry (:mod:`hethub.schedules`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import ClassVar, NamedTuple, TypeVar

# Stands for "as many micro-batches as you like" when asking a schedule for its in-flight bound.
_MANY = 1 << 40
T = TypeVar("T")


class Op(NamedTuple):
    """One op of a stage's schedule."""

    kind: str  # "F" forward, "B" backward (input gradient, or all of it), "W" weight gradient
    micro_batch: int
    chunk: int = 0  # model chunk (virtual stage) on this device; 0 without virtual stages


# Ops are immutable, so every op order shares one Op per (kind, micro-batch): a long pipeline's
# orders hold ~1e5 ops, and building them is then list slicing rather than object creation.
_FWD: list[Op] = []
_BWD: list[Op] = []
_WGT: list[Op] = []


def shared_ops(m: int) -> tuple[list[Op], list[Op], list[Op]]:
    """The forward, backward and weight-gradient (W, a split backward's) ops of micro-batches 0..m-1."""
    for i in range(len(_FWD), m):
        _FWD.append(Op("F", i))
        _BWD.append(Op("B", i))
        _WGT.append(Op("W", i))
    return _FWD[:m], _BWD[:m], _WGT[:m]


def interleaved(*runs: list[T]) -> list[T]:
    """The runs' items taken in turns, a[0], b[0], ..., a[1], b[1], ... (runs of one length): how an op
    order lays out its steady phase by slices (long pipelines' orders hold ~1e5 ops)."""
    out = runs[0] * len(runs)
    for i, run in enumerate(runs):
        out[i::len(runs)] = run
    return out


class Schedule(ABC):
    """One pipeline schedule. Subclass, set ``name``, implement the three abstract methods, and
    register an instance in :mod:`hethub.schedules`; every user picks it up from there."""

    name: ClassVar[str]
    # Model chunks each device runs (virtual stages); ops carry the chunk index.
    chunks_per_stage: ClassVar[int] = 1
    # Whether backward is split into B (input gradient) and W (weight gradient) ops.
    split_backward: ClassVar[bool] = False
    # Whether the planner's "auto" tries it (it must then also bound its in-flight activations).
    auto_candidate: ClassVar[bool] = True

    def with_chunks(self, chunks: int) -> Schedule:
        """This schedule for a pipeline whose devices each hold ``chunks`` model chunks (virtual
        stages). Only schedules with virtual stages accept more than one."""
        if chunks != 1:
            raise ValueError(f"schedule {self.name!r} runs one model chunk per device, not {chunks}; "
                             "virtual stages need the 'interleaved' schedule")
        return self

    # ---- op order ---------------------------------------------------------------------------------
    def ops(self, *, stage: int, num_stages: int, num_micro_batches: int) -> tuple[Op, ...]:
        """The ops stage ``stage`` of ``num_stages`` runs in one step of ``num_micro_batches``: `order` over
        the ops themselves (a schedule with virtual stages writes its own)."""
        return tuple(self.order(stage=stage, num_stages=num_stages, alphabet=shared_ops(num_micro_batches)))

    @abstractmethod
    def order(self, *, stage: int, num_stages: int, alphabet: tuple[list[T], list[T], list[T]]) -> Sequence[T]:
        """Stage ``stage``'s op order with one model chunk per device, written over ``alphabet``: the
        forwards, backwards and weight-gradient passes of micro-batches 0..m-1, as any values (read, never
        changed). `ops` passes the ops; the event simulation passes integers for its inner loop, so it
        runs the very order the runtime executes without building ~1e5 ops per long pipeline."""

    # ---- activation memory ------------------------------------------------------------------------
    @abstractmethod
    def in_flight(self, *, stage: int, num_stages: int, num_micro_batches: int) -> int:
        """Micro-batches whose activations the stage holds at its peak."""

    def max_in_flight(self, *, stage: int, num_stages: int) -> int | None:
        """The most the stage ever holds, whatever the number of micro-batches; None when that grows
        with the number of micro-batches (GPipe). Derived from :meth:`in_flight`."""
        n = self.in_flight(stage=stage, num_stages=num_stages, num_micro_batches=_MANY)
        return n if n < _MANY else None

    def planning_in_flight(self, *, stage: int, num_stages: int, expected_micro_batches: int) -> int:
        """What the planner sizes a stage for before the batch is split among pipelines: the bound
        over any number of micro-batches where there is one, else the count at the expected number."""
        bound = self.max_in_flight(stage=stage, num_stages=num_stages)
        if bound is not None:
            return bound
        return self.in_flight(stage=stage, num_stages=num_stages, num_micro_batches=expected_micro_batches)

    # ---- closed-form step -------------------------------------------------------------------------
    @abstractmethod
    def per_micro_batch_s(self, *, fwd_s: Sequence[float], bwd_s: Sequence[float]) -> float:
        """Steady-state time each further micro-batch adds to the pipeline."""

    def period_s(self, *, fwd_s: Sequence[float], bwd_s: Sequence[float], p2p_s: Sequence[float]) -> float:
        """The steady-state period the planner prices a pipeline with, transfers counted where they
        slow the steady state (1F1B's round trips); here, ``per_micro_batch_s``."""
        return self.per_micro_batch_s(fwd_s=fwd_s, bwd_s=bwd_s)

    def period_floor_s(self, *, bottleneck_s: float, work_s: float, p2p_s: float, max_hop_s: float,
                       max_pair_s: float, stages: int) -> float:
        """A floor under ``period_s`` knowing only floors of its terms: the slowest stage's work, the
        summed work and hops, the slowest hop, the slowest adjacent pair's work and hop averaged over
        the two, and the stage count (the planner's bounds prune with it). Here: the bottleneck."""
        return bottleneck_s

    def fill_drain_s(self, *, fwd_s: Sequence[float], bwd_s: Sequence[float], p2p_s: Sequence[float],
                     per_micro_batch_s: float) -> float:
        """T(m) - m x per_micro_batch_s: one micro-batch's forward and backward through every stage
        and both transfers per hop, less the one steady-state period they overlap."""
        return sum(fwd_s) + sum(bwd_s) + 2 * sum(p2p_s) - per_micro_batch_s

    def fill_work_floor_s(self, *, work_s: float, bottleneck_s: float) -> float:
        """A floor under fill_drain_s + per_micro_batch_s less the transfers, knowing only one
        micro-batch's forward + backward summed over the stages (``work_s``) and the slowest stage's
        (``bottleneck_s``); the planner's bounds prune with it. Here: the whole round trip."""
        return work_s

    def step_time_s(self, *, fwd_s: Sequence[float], bwd_s: Sequence[float], p2p_s: Sequence[float],
                    num_micro_batches: int) -> float:
        """Closed-form T(m): the end of the first stage's last op."""
        per = self.per_micro_batch_s(fwd_s=fwd_s, bwd_s=bwd_s)
        return self.fill_drain_s(fwd_s=fwd_s, bwd_s=bwd_s, p2p_s=p2p_s, per_micro_batch_s=per) \
            + num_micro_batches * per

    def stage_finish_s(self, *, step_s: float, bwd_s: Sequence[float], p2p_s: Sequence[float]) -> list[float]:
        """Each stage's finish when the first finishes at ``step_s``: the last backward ripples up
        from the last stage, so stage s + 1 ends before stage s by stage s's backward and the hop."""
        ends, back = [], step_s
        for s in range(len(bwd_s)):
            ends.append(back)
            back -= bwd_s[s] + (p2p_s[s] if s < len(p2p_s) else 0.0)
        return ends
