"""Vendor islands, and the hierarchical reduce-scatter / all-gather across them (pure: no torch).

An *island* is a set of ranks whose native collective library can talk among itself (all NVIDIA
ranks over NCCL, all AMD ranks over RCCL, every host-memory rank over gloo). Between islands, data
is staged through host memory over gloo (``comm/bridge.py``), a slow path.

A sharded gradient sync (ZeRO, ``runtime/zero.py``) reduce-scatters a buffer of ``len(members)``
equal (padded) chunks, member i owning the i-th, then all-gathers the updated chunks. Across islands
that runs in two levels, so that only each owner's chunk crosses the bridge (this module is the one
home of the schedule: ``comm/hierarchical.py`` runs it, ``predict/sync_rules.py`` prices it):

* every member of an island is the island's *proxy* for some foreign owners (owners in other
  islands): the island's foreign owners, in rank order, dealt round-robin to its members. A member's
  *block* is its own chunk then the chunks of the owners it proxies; every block of an island has
  the island's number of *slots* (shorter ones padded with zeros);
* reduce-scatter: (1) inside each island, a native reduce-scatter of the blocks: each member ends
  with the island's partial sums of its block; (2) each proxy sends each proxied chunk's partial sum
  to its owner over the bridge (the chunk's real size: uneven shards pad only the native step);
  each owner adds the partial sums from every other island to its own;
* all-gather, the reverse: (1) each owner sends its updated chunk to its proxy in every other island;
  (2) inside each island, a native all-gather of the blocks gives every member every chunk.

Bytes: a ring reduce-scatter plus a ring all-gather move what a ring all-reduce moves (each a ring
pass of one chunk per step); over the bridge, an owner receives (islands - 1) chunks and a proxy
sends at most its block's foreign chunks, instead of the whole buffer through every island leader
as a leader-based all-reduce would.

An all-reduce across islands is the two-level algorithm of NCCL's and Horovod's hierarchical
all-reduce, generalised to islands of unequal size (:func:`shard_segments`): (1) a native
reduce-scatter inside each island cuts the (padded) buffer into as many equal shards as the island
has members; (2) each *segment* of the buffer (a piece inside one shard of every island) is
all-reduced over the bridge among its owners, one member per island, the segments' exchanges
running in parallel on different members; (3) a native all-gather inside each island. Each member
moves what a flat ring moves (2(n-1)/n of the buffer) while only 1/k of it per member of a k-rank
island crosses the bridge. With equal islands the segments are the shards and the owners of shard j
are the j-th members of every island.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from itertools import pairwise
from math import lcm

from hethub.memo import kept_lru

HOST_BACKENDS = ("gloo", "mpi")  # host memory: any two CPUs interoperate whatever their vendor


def island_of_kind(kind: str, *, backend: str, vendor: str | None, force_bridge: bool) -> str:
    """The island a kind's ranks belong to (kinds with equal names share one native group). With
    ``force_bridge`` every kind is its own island (how CPU tests emulate two vendors); otherwise
    kinds share an island when they share a backend and, for accelerator backends, a vendor (A100
    and V100 share NCCL; an NVIDIA and an AMD GPU both say "nccl" but NCCL and RCCL do not
    interoperate)."""
    if force_bridge:
        return f"kind:{kind}"
    if backend in HOST_BACKENDS or not vendor:
        return backend
    return f"{backend}:{vendor}"


@dataclass(frozen=True)
class Exchange:
    """The hierarchical schedule of one group (module doc). Members are whatever ids the caller uses
    (ranks in the runtime, holder indices in the predictor), ``members`` in the collective's chunk
    order."""

    members: tuple[int, ...]
    islands: tuple[tuple[int, ...], ...]  # members by island, each in member order, ordered by first member
    blocks: Mapping[int, tuple[int, ...]]  # member -> owners of its block's chunks: itself first, then proxied
    slots: Mapping[int, int]  # member -> its island's block length (the island's reduce-scatter chunk count)

    def island_index(self, member: int) -> int:
        return next(i for i, isl in enumerate(self.islands) if member in isl)

    def proxy(self, owner: int, island: int) -> int:
        """The member of island ``island`` that collects (reduce-scatter) or receives (all-gather)
        ``owner``'s chunk for that island; ``owner`` itself in its own island."""
        return next(m for m in self.islands[island] if owner in self.blocks[m])

    def sends(self, member: int) -> int:
        """Chunks ``member`` sends over the bridge in a reduce-scatter (its proxied ones); in an
        all-gather it receives as many."""
        return len(self.blocks[member]) - 1

    def receives(self, member: int) -> int:
        """Chunks ``member`` receives over the bridge in a reduce-scatter (one per other island); in an
        all-gather it sends as many."""
        return len(self.islands) - 1

    def pass_time_s(self, *, island_s: Sequence[float], message_s: Mapping[int, float]) -> float:
        """One hierarchical reduce-scatter (or all-gather: the same steps reversed), given each island's
        native ring pass of its padded blocks (``island_s``, by island) and the transfer of each
        owner's chunk over the bridge (``message_s``: the bridge carries each chunk's real size,
        not the padding). A member's bridge messages go one after another (its link); they start
        once its island's step is done (reduce-scatter: proxies send island sums; all-gather: the
        island gathers once its proxies have received), and owners post their receives first, so a
        proxy alone in its island sends while the others reduce. The critical path: the slowest
        member's island step plus its proxied chunks, or an owner's (islands - 1) receives."""
        if len(self.islands) == 1:
            return island_s[0]
        step = max(island_s[self.island_index(m)] + sum(message_s[o] for o in self.blocks[m][1:])
                   for m in self.members)
        return max(step, max(message_s.values()) * (len(self.islands) - 1), max(island_s))

    def permuted_copy_rows(self, member: int) -> int:
        """Chunk-sized rows of the copy a member's island reduce-scatter permutes its buffer into (0
        when it is alone in its island: it sends its buffer's rows as they are)."""
        island = self.islands[self.island_index(member)]
        return len(island) * self.slots[member] if len(island) > 1 else 0


def exchange(members: Sequence[int], island_of: Mapping[int, str]) -> Exchange:
    """The schedule for ``members`` (chunk order) whose islands ``island_of`` names (module doc)."""
    order = tuple(members)
    by_island: dict[str, list[int]] = {}
    for m in order:
        by_island.setdefault(island_of[m], []).append(m)
    islands = tuple(tuple(ms) for ms in by_island.values())
    blocks: dict[int, tuple[int, ...]] = {}
    slots: dict[int, int] = {}
    for isl in islands:
        foreign = [m for m in order if m not in isl]
        dealt: dict[int, list[int]] = {m: [m] for m in isl}
        for t, owner in enumerate(foreign):
            dealt[isl[t % len(isl)]].append(owner)
        width = max(len(v) for v in dealt.values())
        for m in isl:
            blocks[m] = tuple(dealt[m])
            slots[m] = width
    return Exchange(members=order, islands=islands, blocks=blocks, slots=slots)


@dataclass(frozen=True)
class Segment:
    """A piece ``[start, end)`` of an all-reduce's buffer, as fractions of its padded length, and its
    owner in each island (the index, in island order, of the member whose shard holds it)."""

    start: Fraction
    end: Fraction
    owners: tuple[int, ...]

    def bounds(self, padded: int) -> tuple[int, int]:
        """Element range in a buffer of ``padded`` elements (:func:`padded_numel`: exact), the fractions'
        integer parts of start x padded and end x padded in integers (Fraction products are slow)."""
        return (self.start.numerator * padded // self.start.denominator,
                self.end.numerator * padded // self.end.denominator)


def shard_segments(island_sizes: Sequence[int]) -> tuple[Segment, ...]:
    """The two-level all-reduce's segments (module doc): island i cuts the buffer into
    ``island_sizes[i]`` equal shards; every boundary of any island cuts a segment. Independent of
    the buffer's length, so the bridge's groups of owners exist before any tensor does; kept per
    island sizes (the predictor prices each sync group's buckets with the same few)."""
    return _segments(tuple(island_sizes))


@kept_lru(maxsize=4096)
def _segments(island_sizes: tuple[int, ...]) -> tuple[Segment, ...]:
    cuts = sorted({Fraction(j, k) for k in island_sizes for j in range(k + 1)})
    return tuple(Segment(a, b, tuple(int(a * k) for k in island_sizes)) for a, b in pairwise(cuts))


def padded_numel(numel: int, island_sizes: Sequence[int]) -> int:
    """``numel`` rounded up so that every island's shards and every segment are whole elements."""
    step = lcm(*island_sizes)
    return -(-numel // step) * step


def segment_bytes(numel: int, island_sizes: Sequence[int], *, elem_bytes: float) -> list[list[list[float]]]:
    """Per island, per member: the bytes of each segment that member all-reduces over the bridge, in
    segment order (what the predictor prices and the runtime sends, one after another)."""
    padded = padded_numel(numel, island_sizes)
    out: list[list[list[float]]] = [[[] for _ in range(k)] for k in island_sizes]
    for seg in shard_segments(island_sizes):
        s, e = seg.bounds(padded)
        for i, j in enumerate(seg.owners):
            out[i][j].append((e - s) * elem_bytes)
    return out
