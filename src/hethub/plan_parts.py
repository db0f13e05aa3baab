"""The parts a plan is made of: recomputation modes, stages, pipelines (`hethub.plan` assembles,
validates and reads and writes them as the versioned plan file, and re-exports these names)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Any, Generic, TypeVar, overload

from hethub.errors import PlanError

T = TypeVar("T")


class kept_field(Generic[T]):
    """A derived value of a frozen record, computed on first read and kept in the instance's
    ``__dict__``, where later reads find it without calling anything (a non-data descriptor).
    ``functools.cached_property`` without its lock: the first read of a fresh record costs no more
    than a ``property``'s, and the planner reads these on hundreds of thousands of fresh stages. Exact:
    the records are frozen, so the value never goes stale (``dataclasses.replace`` makes a new one)."""

    def __init__(self, fn: Callable[[Any], T]) -> None:
        self.fn, self.name = fn, fn.__name__
        self.__doc__ = fn.__doc__

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, obj: None, owner: type) -> kept_field[T]: ...
    @overload
    def __get__(self, obj: object, owner: type) -> T: ...

    def __get__(self, obj: object | None, owner: type) -> T | kept_field[T]:
        if obj is None:
            return self
        value = obj.__dict__[self.name] = self.fn(obj)
        return value


class Recompute(StrEnum):
    """What a stage recomputes in backward instead of keeping from forward.

    ``none`` keeps every activation; ``selective`` recomputes only each layer's attention core
    (scores, softmax, attention over V: Korthikanti et al. 2022, arXiv:2205.05198, Sec. 5), whose
    saved tensors grow with the sequence length; ``full`` keeps only each layer's input and re-runs
    the whole layer. A member is falsy only for ``none``, so ``if stage.recompute`` reads "the stage
    recomputes something"; it compares and serialises as its word.
    """

    NONE = "none"
    SELECTIVE = "selective"
    FULL = "full"

    def __bool__(self) -> bool:
        return self is not Recompute.NONE

    @staticmethod
    def of(value: Recompute | str | bool, *, where: str = "recompute") -> Recompute:
        """``value`` as a mode: a word, or a boolean as plans before version 3 wrote it (true: full)."""
        if isinstance(value, bool):
            return Recompute.FULL if value else Recompute.NONE
        if isinstance(value, str) and value in RECOMPUTE_MODES:
            return Recompute(value)
        raise PlanError(f"plan field '{where}' is {value!r}. Fix: use one of {', '.join(RECOMPUTE_MODES)} "
                        "(true/false from older plans mean full/none).")


RECOMPUTE_MODES = tuple(m.value for m in Recompute)


class LayerChunks:
    """A stage's decoder layers as chunk ranges, for any class with ``layers`` (the first chunk's
    [start, end)) and ``chunks`` (every chunk's range; empty for one chunk): the plan's Stage and the
    rank layout's StagePlace. Both are frozen, so what is derived here is kept on the instance when
    first read (``kept_field``): the predictor reads it per stage of every replica many times."""

    layers: tuple[int, int]
    chunks: tuple[tuple[int, int], ...]

    @kept_field
    def layer_ranges(self) -> tuple[tuple[int, int], ...]:
        """Each chunk's decoder layers [start, end), in chunk order (one range without chunks)."""
        return self.chunks or (self.layers,)

    @kept_field
    def num_chunks(self) -> int:
        return len(self.layer_ranges)

    @kept_field
    def num_layers(self) -> int:
        return sum(b - a for a, b in self.layer_ranges)


class SeqGrid:
    """A stage's grid of TP x CP members (the plan's Stage: device ids; the layout's StagePlace: torch
    ranks), CP-major: CP rank c's TP group is members[c*tp:(c+1)*tp]. The one rule of where a member
    sits, for the plan's validation, the layout's groups and the predictor's rings."""

    cp: int

    def _members(self) -> tuple[int, ...]:
        raise NotImplementedError

    @kept_field
    def tp(self) -> int:
        """Members per CP rank (kept when first read, as ``LayerChunks``' derived fields)."""
        return len(self._members()) // max(1, self.cp)  # an invalid cp is refused by Plan.validate

    def tp_group(self, cp_rank: int) -> tuple[int, ...]:
        """The members of CP rank ``cp_rank``'s TP group, in TP rank order."""
        t = self.tp
        return self._members()[cp_rank * t:(cp_rank + 1) * t]

    def cp_group(self, tp_rank: int) -> tuple[int, ...]:
        """The members holding TP rank ``tp_rank`` of each CP rank (one ring of the stage's context
        parallelism), in CP rank order."""
        return self._members()[tp_rank::self.tp]


@dataclass(frozen=True)
class Stage(LayerChunks, SeqGrid):
    kind: str
    devices: tuple[int, ...]  # cluster device ids; len == tp x cp, CP-major (SeqGrid)
    layers: tuple[int, int]  # decoder layers [start, end); with chunks: the first chunk's
    embedding: bool = False
    head: bool = False
    # A Recompute; a bool (as code before plan version 3 passed it) is converted, True to "full".
    recompute: Recompute = Recompute.NONE

    def __post_init__(self) -> None:
        if not isinstance(self.recompute, Recompute):
            object.__setattr__(self, "recompute", Recompute.of(self.recompute, where="stages[].recompute"))
    # Virtual stages (interleaved schedule): the layer ranges [start, end) of the v model chunks the
    # stage's devices hold, in chunk order; chunk c of stage s is virtual stage c x p + s. Empty: one
    # chunk, ``layers``. The embedding is on chunk 0 of the first stage, the head on the last chunk
    # of the last stage.
    chunks: tuple[tuple[int, int], ...] = ()
    # Context parallelism (runtime/context_parallel.py): the stage's ranks split each sequence cp
    # ways, CP rank c holding the load-balanced chunks c and 2cp-1-c of 2cp (layout.seq_positions).
    cp: int = 1
    # Sequence parallelism (Korthikanti et al. 2022): with TP > 1, norms and the residual stream are
    # held split along the sequence across the TP group (all-gather before and reduce-scatter after
    # the tensor-parallel blocks instead of all-reduces).
    sequence_parallel: bool = False

    def _members(self) -> tuple[int, ...]:
        return self.devices

    @classmethod
    def laid(cls, kind: str, devices: tuple[int, ...], layers: tuple[int, int], *, embedding: bool, head: bool,
             recompute: Recompute, sequence_parallel: bool) -> Stage:
        """``Stage(...)`` of one chunk and no context parallelism from fields already of their types (the
        mode a `Recompute`), its fields set at once rather than by the frozen ``__init__``'s one assignment
        each: the planner lays out ~10^5 stages a search (`layout_assemble.to_pipeline`). Equal to the
        constructor's stage (``tests/unit/test_plan.py``)."""
        stage = object.__new__(cls)
        stage.__dict__.update(kind=kind, devices=devices, layers=layers, embedding=embedding, head=head,
                              recompute=recompute if type(recompute) is Recompute else Recompute.of(recompute),
                              chunks=(), cp=1, sequence_parallel=sequence_parallel)
        return stage


@dataclass(frozen=True)
class Pipeline:
    micro_batch_size: int
    num_micro_batches: int
    stages: tuple[Stage, ...]

    @property
    def num_samples(self) -> int:
        return self.micro_batch_size * self.num_micro_batches

    @functools.cached_property
    def devices(self) -> tuple[int, ...]:
        return tuple(d for s in self.stages for d in s.devices)

    @kept_field
    def virtual_stages(self) -> int:
        """Model chunks per stage (v; 1 without interleaving)."""
        return self.stages[0].num_chunks if self.stages else 1


def interleave(pipe: Pipeline, chunk_layers: list[list[int]] | tuple[tuple[int, ...], ...]) -> Pipeline:
    """``pipe`` with stage s holding ``chunk_layers[s][c]`` layers in its chunk c: the ranges are laid
    out contiguously in virtual-stage order (chunk 0 of every stage, then chunk 1, ...). One chunk
    per stage gives plain ``layers``. Validate the plan afterwards (the counts must cover the model)."""
    n, v = len(pipe.stages), len(chunk_layers[0]) if chunk_layers else 1
    if len(chunk_layers) != n or any(len(c) != v for c in chunk_layers):
        raise ValueError(f"need {n} stages x {v} chunk layer counts, got {chunk_layers!r}")
    ranges: list[list[tuple[int, int]]] = [[] for _ in range(n)]
    start = 0
    for c in range(v):
        for si in range(n):
            ranges[si].append((start, start + chunk_layers[si][c]))
            start += chunk_layers[si][c]
    stages = tuple(replace(st, layers=r[0], chunks=tuple(r) if v > 1 else ())
                   for st, r in zip(pipe.stages, ranges, strict=True))
    return replace(pipe, stages=stages)


def split_evenly(n: int, parts: int) -> list[int]:
    """n layers in ``parts`` chunks as equal as can be, the larger ones first."""
    return [n // parts + (1 if i < n % parts else 0) for i in range(parts)]


# The interleaved schedule's chunks per stage a pipeline may take (the planner tries each).
CHUNK_CHOICES = (2, 3, 4, 6, 8)


def chunk_choices(p: Pipeline) -> tuple[int, ...]:
    """The v a pipeline may take: up to its largest stage's layer count (a stage with fewer layers
    than v has empty chunks, which pass their input on), at least as many micro-batches as stages,
    two or more stages."""
    n = len(p.stages)
    if n < 2 or p.num_micro_batches < n:
        return ()
    most = max(s.num_layers for s in p.stages)
    return tuple(v for v in CHUNK_CHOICES if v <= most)


def with_chunks(p: Pipeline, v: int) -> Pipeline:
    """``p`` with each stage's layers in v chunks as equal as can be, the smaller ones first (the
    warm-up holds mostly early chunks' activations; v = 1: plain layers)."""
    return interleave(p, [split_evenly(s.num_layers, v)[::-1] for s in p.stages])

@dataclass(frozen=True)
class ShardWeights:
    """What a ZeRO-1 plan's optimizer-state split rests on: each rank's weight in its buckets' split
    (``predict/sharding.py``: free device memory in bytes under ``proportional`` shares, 1 under
    ``equal``), computed by the predictor at ``mem_headroom``, the share of device memory the plan
    was scored to leave free. The plan carries them so that the runtime splits exactly as the plan
    was scored, without a memory model of its own."""

    mem_headroom: float
    by_rank: tuple[float, ...]  # rank -> weight; ranks are the plan's devices in ascending id order

    def to_dict(self) -> dict[str, object]:
        return {"mem_headroom": self.mem_headroom, "by_rank": list(self.by_rank)}
