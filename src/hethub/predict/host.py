"""The predictor's one hook for a host that runs every rank of a plan itself (local emulation).

A real cluster gives each device its own hardware; the plain predictor models that. A local
emulation host (:mod:`hethub.emulation`) runs every rank as a process of one machine, which adds
effects no real cluster has (ranks sharing cores, work slowed after idle gaps, core speeds that
wander, an all-reduce bound by CPU copies). ``predict(plan, host=...)`` hands such a host the
stage costs it computed; the host prices the collectives and replays the step. This module
defines what crosses the hook, so the predictor never imports the emulation layer.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from hethub.plan import Plan
    from hethub.predict.profiles import ProfileSet
    from hethub.predict.sync_records import SyncGroup

StageId = tuple[int, int]  # (pipeline index, stage index)


@dataclass(frozen=True)
class StageStep:
    """One stage's per-micro-batch costs as the plain predictor computed them."""

    kind: str
    tp: int
    micro_batch_size: int
    fwd_s: float  # compute + TP collectives
    bwd_s: float
    compute_fwd_s: float  # compute only (profile or roofline), emulated slowdown included
    compute_bwd_s: float
    update_s: float  # optimizer step, once per training step
    p2p_s: float  # send to the next stage (and of gradients back from it)
    compute_source: str  # "profile" or "analytic"
    # Virtual stages (interleaved): each chunk's share of the stage's forward and backward, and on
    # the last stage the hop back to the first (chunk c to chunk c + 1).
    chunk_fwd_shares: tuple[float, ...] = (1.0,)
    chunk_bwd_shares: tuple[float, ...] = (1.0,)
    wrap_p2p_s: float = 0.0


@dataclass(frozen=True)
class ReplayEvent:
    """One interval of one stage in a host's replay: ``category`` forward, backward, allreduce or optimizer."""

    stage: StageId
    category: str
    name: str
    start_s: float
    end_s: float
    micro_batch: int | None = None


@dataclass(frozen=True)
class HostStep:
    step_time_s: float
    pipeline_times_s: tuple[float, ...]  # each pipeline's last backward
    events: tuple[ReplayEvent, ...] = ()  # only when recorded


class HostModel(Protocol):
    """What ``predict(..., host=...)`` calls; :class:`hethub.emulation.host.EmulationModel` is one."""

    def price_collectives(self, groups: Sequence[SyncGroup]) -> list[SyncGroup]:
        """The groups with this host's cost of each all-reduce (a measured one where it has it)."""
        ...

    def replay_step(self, plan: Plan, *, profiles: ProfileSet | None, stages: Mapping[StageId, StageStep],
                    groups: Sequence[SyncGroup], world: Sequence[SyncGroup], record: bool) -> HostStep:
        """The step on this host: `groups` are the gradient all-reduces (priced), `world` the two
        world all-reduces of every step (loss, then gradient norm; priced)."""
        ...
