"""The search's candidates as the modules below the search read them: a priced pipeline
(search/split.PipeCost), a group of identical ones (search/combine.Group) and a candidate
(search/combine.Estimate). Protocols, so that the layout (`hethub.layout_assemble`) and the enumeration's
kept places (`predict/finalist_places`) read them without importing the search, which imports both."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Protocol

from hethub.plan import Recompute
from hethub.predict.stage_links import Slot


class PipeShape(Hashable, Protocol):
    """A priced pipeline: its stages' slots, layers and modes, its micro-batch size; hashable (a memo key)."""

    @property
    def slots(self) -> tuple[Slot, ...]: ...
    @property
    def layers(self) -> tuple[int, ...]: ...
    @property
    def recompute(self) -> tuple[Recompute, ...]: ...
    @property
    def sp(self) -> tuple[bool, ...]: ...
    @property
    def mbs(self) -> int: ...


class GroupShape(Protocol):
    """Identical pipelines: one pipeline and how many replicas run it."""

    @property
    def pipe(self) -> PipeShape: ...
    @property
    def count(self) -> int: ...


class CandidateShape(Protocol):
    """A priced candidate: its groups, each pipeline's micro-batches and its closed-form step."""

    @property
    def groups(self) -> Sequence[GroupShape]: ...
    @property
    def micro_batches(self) -> tuple[tuple[int, ...], ...]: ...
    @property
    def step_time_s(self) -> float: ...
