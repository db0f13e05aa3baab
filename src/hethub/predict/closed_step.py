"""The closed form's end of a step (the planner's, search/combine.py): after the last pipeline's
backward, the world all-reduce of the loss, the layers' gradient syncs in layer order, where replicas
whose stage boundaries differ chain them, the world all-reduce of the gradient norm, then the updates.
Priced by the predictor's all-reduce rule on representative links (``LinkBook.sync_allreduce_s``);
the predictor's own sync (predict/sync_overlap.py) also overlaps buckets with the backward."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

from hethub.layout import block_starts
from hethub.memo import Kept
from hethub.predict.comm import small_allreduce_time_s
from hethub.predict.stage_links import LinkBook, Slot
from hethub.spec.model import ModelSpec


class SyncedPipe(Protocol):
    """What the walk reads of a pipeline (search/split.PipeCost)."""

    slots: tuple[Slot, ...]
    layers: tuple[int, ...]
    update_s: tuple[float, ...]

    @property
    def kinds(self) -> frozenset[str]: ...
    @property
    def num_devices(self) -> int: ...
    def stage_finish_s(self, step_s: float) -> list[float]: ...


class SyncedGroup(Protocol):
    """Identical pipelines (search/combine.Group)."""

    @property
    def pipe(self) -> SyncedPipe: ...
    @property
    def count(self) -> int: ...


def step_time_s(groups: Sequence[SyncedGroup], times_s: list[float], *, links: LinkBook, model: ModelSpec,
                precision: str, sync_floor_s: float | None = None) -> float:
    """End of the step: each pipeline's backward, the world all-reduce of the loss, the per-layer
    gradient all-reduces (`_synced_s`: on one representative per group, by the predictor's rule on
    representative links, ``LinkBook.sync_allreduce_s``), the world all-reduce of the gradient norm,
    then the updates. The predictor (predict/sync_overlap.py) also overlaps buckets with the backward; it
    decides between finalists. ``sync_floor_s``: a floor under the syncs' span in their place (a
    floor of the step)."""
    replicas = sum(g.count for g in groups)
    devices = sum(g.count * g.pipe.num_devices for g in groups)
    world_s = small_allreduce_time_s(nbytes=8.0, participants=sum(g.count * len(g.pipe.layers) for g in groups),
                                     link=links.replicas(frozenset().union(*(g.pipe.kinds for g in groups)),
                                                         devices=devices))
    # When each stage finishes relative to stage 0 is the schedule's (its last ops ripple up); all wait for the loss.
    end = max(max(g.pipe.stage_finish_s(t)) for g, t in zip(groups, times_s, strict=True)) + world_s
    if replicas > 1:
        end = end + sync_floor_s if sync_floor_s is not None else _synced_s(
            groups, end, links=links, model=model, precision=precision, replicas=replicas, devices=devices)
    return end + world_s + max(u for g in groups for u in g.pipe.update_s)  # the gradient norm, then the updates


# The walk's sync groups by all they read: the book and model (ids, pinned), the gradients' element
# size, and each group's stages, layers and count. A search prices one set of groups at many
# allocations (start_s): only the replay below depends on it.
_WALKS = Kept(20_000, shortcut=True)
_PREV, _EMB, _START = 0, 1, 2  # what a sync group may wait for: the group before, the embedding's, start_s


class WalkStep(NamedTuple):
    """One sync group of the walk: which ends it waits for (`_PREV`, `_EMB`, `_START`) and its all-reduce
    time. A tuple: replayed ~10^5 times per search."""

    sources: tuple[int, ...]
    ring_s: float


@dataclass(frozen=True)
class SyncWalk:
    """The walk of `_synced_s` with start_s left open: the embedding group's all-reduce, then each
    later group's sources and time, in order."""

    emb_s: float
    steps: tuple[WalkStep, ...]


def _synced_s(groups: Sequence[SyncedGroup], start_s: float, *, links: LinkBook, model: ModelSpec, precision: str,
              replicas: int, devices: int) -> float:
    """When the last parameter group's gradient all-reduce ends, every stage free at start_s: the
    embedding, the layers between any replica's boundaries, the head (fused where holders match,
    sync._buckets), in that order, each sized by its holders' smallest TP once all of them (a stage
    of each replica; the embedding's also the last ones with tied embeddings) are free, so replicas
    whose boundaries differ chain their syncs (`_walk`). Each group starts at the latest of the ends
    it waits for, in the same float operations as a walk over every replica's ends."""
    gb = ModelSpec.state_bytes_per_param(precision)["grads"]
    key = (id(links), id(model), gb, replicas, devices, tuple((g.pipe.slots, g.pipe.layers, g.count) for g in groups))
    walk = _WALKS.get(key, lambda: _walk(groups, links=links, model=model, elem_bytes=gb, devices=devices),
                      pin=(links, model))
    ends = e_emb = start_s + walk.emb_s
    at = [e_emb, e_emb, start_s]  # the group before (none yet: the embedding's), the embedding's, start_s
    for sources, ring in walk.steps:
        e = at[_PREV] = max([at[i] for i in sources]) + ring
        ends = max(ends, e)
    return ends


def _walk(groups: Sequence[SyncedGroup], *, links: LinkBook, model: ModelSpec, elem_bytes: float,
          devices: int) -> SyncWalk:
    """The sync groups in order and what each waits for. Walked over the boundaries: a replica's holder
    changes only at its own, and every layer group is held by every replica, so all are free when it
    ends; a replica's new holder was free at start_s, or when the embedding's group ended."""
    gb = elem_bytes
    # All-reduce times by what they read of the device count; the rest of the key below. The holders'
    # order (in which the all-reduce forms its islands) changes no time: the sync rule is symmetric.
    rings = links.ring_cache.setdefault((gb, links.within_node(devices)), {})
    tied = model.tied_embeddings
    matmul = model.layer_matmul_params  # a computed property: once per call, not once per block
    norm = model.layer_params - matmul
    n, lasts = len(groups), [len(g.pipe.layers) - 1 for g in groups]
    slots, counts = [g.pipe.slots for g in groups], [g.count for g in groups]

    def priced(matrix: float, extra: float, kinds: tuple[tuple[str, int], ...], tp: int,
               holders: Iterable[tuple[int, int]]) -> float:
        """The all-reduce among holders of these kinds (count per kind, sorted) and least TP degree."""
        key = (matrix, extra, kinds, tp)
        if (t := rings.get(key)) is None:
            count: dict[str, int] = {}  # holders per kind, in holder order (the all-reduce's islands)
            for gi, si in holders:
                count[slots[gi][si].kind] = count.get(slots[gi][si].kind, 0) + counts[gi]
            t = rings[key] = links.sync_allreduce_s(count, tp=tp, nbytes=(matrix / tp + extra) * gb,
                                                    elem_bytes=gb, devices=devices)
        return t

    def ring_s(matrix: float, extra: float, holders: list[tuple[int, int]]) -> float:
        count: dict[str, int] = {}
        for gi, si in holders:
            count[slots[gi][si].kind] = count.get(slots[gi][si].kind, 0) + counts[gi]
        return priced(matrix, extra, tuple(sorted(count.items())), min(slots[gi][si].tp for gi, si in holders),
                      holders)

    at: dict[int, list[tuple[int, int]]] = {}  # layer -> the replicas' stages holding layers from it on
    for gi, g in enumerate(groups):
        for si, (a, k) in enumerate(zip(block_starts(g.pipe.layers), g.pipe.layers, strict=True)):
            if k:
                at.setdefault(a, []).append((gi, si))
    cuts = [*sorted(at), model.num_layers]
    emb = [(gi, 0) for gi in range(n)] + [(gi, lasts[gi]) for gi in range(n) if lasts[gi] > 0 and tied]
    head = (0 if tied else model.head_params, model.final_norm_params)
    # The embedding's holders are the first layers' (the head's the last layers'): one group.
    first_too = len(emb) == n and all(g.pipe.layers[0] for g in groups)
    last_too = all(g.pipe.layers[-1] for g in groups)
    parts: list[list] = [list(model.embedding_parts)]
    for a, b in itertools.pairwise(cuts):
        if a or not first_too:
            parts.append([0.0, 0.0])
        parts[-1][:] = parts[-1][0] + (b - a) * matmul, parts[-1][1] + (b - a) * norm
    if last_too:
        parts[-1][:] = parts[-1][0] + head[0], parts[-1][1] + head[1]
    emb_s, steps = ring_s(*parts[0], emb), []
    cur = [0] * n  # each replica's holder now; their count per kind and per TP degree, kept as they move
    kinds: dict[str, int] = {}
    degrees: dict[int, int] = {}
    for gi in range(n):
        _count(kinds, slots[gi][0].kind, counts[gi])
        _count(degrees, slots[gi][0].tp, 1)
    for (a, _), (matrix, extra) in zip(itertools.pairwise(cuts[first_too:]), parts[1:], strict=True):
        moved = at[a]  # at most one stage of each replica; the others wait for the group before
        waits = {_PREV} if len(moved) < n else set()
        for gi, si in moved:  # a stage the embedding's group left at start_s, or one it waited for
            if (was := slots[gi][cur[gi]]) != (now := slots[gi][si]):
                _count(kinds, was.kind, -counts[gi])
                _count(kinds, now.kind, counts[gi])
                _count(degrees, was.tp, -1)
                _count(degrees, now.tp, 1)
            cur[gi] = si
            waits.add(_EMB if si == 0 or (tied and si == lasts[gi]) else _START)
        steps.append(WalkStep(tuple(waits), priced(matrix, extra, tuple(sorted(kinds.items())), min(degrees),
                                                    enumerate(cur))))
    if not last_too:  # a last stage without layers: free when the embedding's group ended (tied) or at start_s
        waits = {_PREV if cur[gi] == lasts[gi] else _EMB if tied else _START for gi in range(n)}
        steps.append(WalkStep(tuple(waits), ring_s(0.0 + head[0], 0.0 + head[1],
                                                           [(gi, lasts[gi]) for gi in range(n)])))
    return SyncWalk(emb_s, tuple(steps))


def _count(counts: dict, key: str | int, delta: int) -> None:
    """Add ``delta`` to ``counts[key]``, dropping it at zero (the walk's holders per kind and per degree)."""
    if c := counts.get(key, 0) + delta:
        counts[key] = c
    else:
        del counts[key]
