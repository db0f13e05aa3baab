"""The records of the data-parallel gradient sync: a sync group (one collective among the stages that
hold the same parameters, with its price) and a simulated step's sync result.

One home for what the sync model's parts pass each other (:mod:`hethub.predict.sync` builds the groups,
:mod:`hethub.predict.sync_sharded` reprices them for a sharded optimizer, :mod:`hethub.predict.sync_overlap`
cuts them to what the backward leaves exposed) and what an emulation host replays (``predict/host.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

from hethub.spec.cluster import Link

StageId = tuple[int, int]  # (pipeline index, stage index)


@dataclass(frozen=True)
class SyncGroup:
    name: str  # "embedding", "layer 12", "head"
    holders: tuple[StageId, ...]
    nbytes: float  # per participant
    link: Link
    time_s: float
    members: int = 0  # ranks per reduction line where holders have several CP ranks (0: one per holder)
    # ZeRO-2/3 (exposed_sync_groups): one micro-batch's reduction onto the owners, and under ZeRO-3 a
    # step's per-use gathers of the group's parameters with the units they are cut into.
    round_s: float = 0.0
    gather_s: float = 0.0
    gather_units: int = 0

    @property
    def participants(self) -> int:
        return self.members or len(self.holders)


@dataclass(frozen=True)
class SyncResult:
    step_time_s: float
    stage_end_s: dict[StageId, float]  # sync end + optimizer update
    sync_s: dict[StageId, float]  # summed all-reduce durations of the stage's groups (no waiting; no world ones)
    # (group name, start, end) per stage, in execution order; only when recorded.
    intervals: dict[StageId, list[tuple[str, float, float]]]
