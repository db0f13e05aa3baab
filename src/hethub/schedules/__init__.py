"""Pipeline schedules: the one home of each schedule's op order, in-flight rule and closed-form step.

Everyone takes them from here: the predictor's event simulation (:mod:`hethub.schedules.simulate`),
the planner (split, bounds, baselines, combine, diagnose), the runtime's executor, the memory
model, the plan validator and the CLI's choices. Adding a schedule is one :class:`Schedule`
subclass registered below (see :mod:`hethub.schedules.base` for what it defines).
"""

from __future__ import annotations

from hethub.schedules.base import Op, Schedule
from hethub.schedules.classic import GPipe, OneFOneB
from hethub.schedules.interleaved import Interleaved
from hethub.schedules.zero_bubble import ZeroBubbleH1

_REGISTRY: dict[str, Schedule] = {s.name: s for s in (OneFOneB(), GPipe(), ZeroBubbleH1(), Interleaved())}

# Every schedule name, in the order the CLI lists them; the first is the default.
SCHEDULES: tuple[str, ...] = tuple(_REGISTRY)
DEFAULT_SCHEDULE = SCHEDULES[0]
# What the planner may choose among when asked to pick ("auto"): the schedules whose activation
# memory does not grow with the batch (so GPipe is only ever run when forced).
AUTO_SCHEDULE = "auto"
AUTO_CANDIDATES: tuple[str, ...] = tuple(n for n, s in _REGISTRY.items()
                                          if s.auto_candidate and s.max_in_flight(stage=0, num_stages=1) is not None)
# How a pipeline runtime sends activations and gradients between stages, which the event simulation
# models (its rules: hethub.schedules.simulate). "async": the sender posts the send and goes on (hethub's
# runtime, isend); "blocking": the sender stays busy until its message is delivered (Megatron-LM's 1F1B;
# a floor for DeepSpeed's engine); "lockstep": DeepSpeed's pipeline engine, which Sailor trains with, its
# TrainSchedule's instructions in order, each send and its receive one rendezvous (rules:
# hethub.schedules.lockstep; 1F1B only). The first is the default.
LOCKSTEP = "lockstep"
P2P_MODES: tuple[str, ...] = ("async", "blocking", LOCKSTEP)
DEFAULT_P2P = P2P_MODES[0]


def get_schedule(name: str, *, chunks: int = 1) -> Schedule:
    """The registered schedule called ``name`` for a pipeline whose devices hold ``chunks`` model
    chunks each (virtual stages; only ``interleaved`` takes more than 1); a ValueError naming the
    choices otherwise."""
    try:
        sched = _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown schedule {name!r}; use one of {', '.join(SCHEDULES)}") from None
    return sched.with_chunks(chunks)


__all__ = ["AUTO_CANDIDATES", "AUTO_SCHEDULE", "DEFAULT_P2P", "DEFAULT_SCHEDULE", "LOCKSTEP", "P2P_MODES",
           "SCHEDULES", "GPipe", "Interleaved", "OneFOneB", "Op", "Schedule", "ZeroBubbleH1", "get_schedule"]
