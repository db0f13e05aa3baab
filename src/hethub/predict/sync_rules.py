"""The all-reduce rules of the gradient sync: one vendor island's ring, or the bridge's two-level
all-reduce across islands.

A group among holders of one island is a ring all-reduce (:func:`hethub.predict.comm.allreduce_time_s`)
over the group's ring link (:func:`hethub.predict.comm.rings_link`). Where the holders' kinds sit in
several islands (``comm/bridge.py``; ``hethub.islands``, the one home of that schedule and its
critical path), the bridge runs each island's ring reduce-scatter of the padded buffer, every member's
segments all-reduced among one owner per island over the bridge, then each island's ring all-gather.
:func:`islands_allreduce_s` is the rule both the predictor (:func:`group_allreduce_s`, on a plan's
devices) and the planner's closed form (``LinkBook.sync_allreduce_s``, on representative links) price
with, so the two cannot drift apart.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from hethub.islands import Exchange, exchange, island_of_kind, padded_numel, segment_bytes
from hethub.memo import Kept
from hethub.plan import Plan
from hethub.predict.comm import allreduce_time_s, ring_pass_time_s, slowest_link
from hethub.predict.sync_records import StageId
from hethub.spec.cluster import Cluster, Link


def island_labels(plan: Plan, stages: Sequence[StageId]) -> dict[StageId, str]:
    """Each holder stage's vendor island (``hethub.islands.island_of_kind``, as the bridge forms them
    unforced)."""
    kinds = {x: plan.pipelines[x[0]].stages[x[1]].kind for x in stages}
    labels = kind_island_labels(plan.cluster, set(kinds.values()))
    return {x: labels[k] for x, k in kinds.items()}


def holder_exchange(plan: Plan, holders: Sequence[StageId]) -> Exchange:
    """The hierarchical schedule among a group's holders, members (indices into ``holders``) in the
    runtime's chunk order: ascending rank of each holder's first device."""
    first = [plan.rank_of(plan.pipelines[pi].stages[si].devices[0]) for pi, si in holders]
    labels = island_labels(plan, holders)
    order = sorted(range(len(holders)), key=lambda i: first[i])
    return exchange(order, {i: labels[holders[i]] for i in order})


def group_allreduce_s(plan: Plan, holders: Sequence[StageId], *, nbytes: float, link: Link, participants: int,
                      elem_bytes: float) -> float:
    """A sync group's all-reduce: a ring over ``link`` inside one vendor island; across islands the
    bridge's two-level all-reduce (:func:`two_level_allreduce_time_s`) over each island's slowest
    ring link and the slowest cross-island pair of the holders' first devices. Holders with CP ranks
    (``participants`` above the holder count) are priced as the ring."""
    if participants != len(holders):
        return islands_allreduce_s(nbytes=nbytes, elem_bytes=elem_bytes, participants=participants, link=link)
    def islands() -> HolderIslands:  # by all holder_islands reads of the plan, behind the plan's own memo
        stages = [plan.pipelines[pi].stages[si] for pi, si in holders]
        return _ISLANDS_AT.get((id(plan.cluster), tuple((s.devices[0], s.kind) for s in stages)),
                               lambda: holder_islands(plan, holders), pin=(plan.cluster,))
    where = _ISLANDS.get((id(plan), tuple(holders)), islands, pin=(plan,))
    return islands_allreduce_s(nbytes=nbytes, elem_bytes=elem_bytes, participants=participants, link=link,
                               islands=where.islands, bridge=where.bridge)


@dataclass(frozen=True)
class HolderIslands:
    """A group's holders by vendor island (``holder_exchange``): each island's holder count and slowest
    ring link among their first devices, and the slowest cross-island pair of them (one island: none)."""

    islands: tuple[tuple[int, Link], ...] = ()
    bridge: Link | None = None


# holder_islands by plan (id, pinned; plans are frozen) and holders: a group is priced at its size, at
# its buckets' and unoverlapped, in the scoring's floor and again in the prediction.
_ISLANDS = Kept(100_000, shortcut=True)
# holder_islands by all it reads of the plan behind that: the cluster (id, pinned) and each holder's first
# device and kind, in order (the exchange orders holders by rank, and a plan's ranks follow its device
# ids): plans of other modes, shardings and layouts sharing those devices share it.
_ISLANDS_AT = Kept(100_000, shortcut=True)


def holder_islands(plan: Plan, holders: Sequence[StageId]) -> HolderIslands:
    """What ``group_allreduce_s`` reads of the plan beside the group's size and ring link."""
    ex = holder_exchange(plan, holders)
    if len(ex.islands) == 1:
        return HolderIslands()
    first = [plan.pipelines[pi].stages[si].devices[0] for pi, si in holders]
    islands = tuple((len(isl), slowest_link(plan.cluster, [first[m] for m in isl])) for isl in ex.islands)
    pairs = [plan.cluster.link(first[a], first[b]) for i, isl in enumerate(ex.islands) for a in isl
             for other in ex.islands[i + 1:] for b in other]
    return HolderIslands(islands, Link(min(lk.bw_bytes_per_s for lk in pairs), max(lk.latency_s for lk in pairs)))


def islands_allreduce_s(*, nbytes: float, elem_bytes: float, participants: int, link: Link,
                        islands: Sequence[tuple[int, Link]] = (), bridge: Link | None = None) -> float:
    """The gradient sync's all-reduce rule, shared by the predictor (:func:`group_allreduce_s`, on a
    plan's devices) and the planner's closed form (``LinkBook.sync_allreduce_s``, on representative
    links): the ring over ``link`` among ``participants`` inside one vendor island; across several (``islands``:
    each island's holder count and slowest ring link, ``bridge`` the slowest cross-island pair) the
    bridge's two-level all-reduce (:func:`two_level_allreduce_time_s`)."""
    if len(islands) <= 1 or bridge is None:
        return allreduce_time_s(nbytes=nbytes, participants=participants, link=link)
    return two_level_allreduce_time_s(elems=max(1, round(nbytes / elem_bytes)), elem_bytes=elem_bytes,
                                      island_links=[lk for _, lk in islands],
                                      island_sizes=[n for n, _ in islands], bridge=bridge)


def kind_island_labels(cluster: Cluster, kinds: Iterable[str]) -> dict[str, str]:
    """Each kind's vendor island (``hethub.islands.island_of_kind``, as the bridge forms them unforced)."""
    out = {}
    for kind in kinds:
        k = cluster.kinds[kind]
        out[kind] = island_of_kind(kind, backend=k.backend, vendor=k.vendor, force_bridge=False)
    return out


# two_level_allreduce_time_s by its arguments (pure numbers and frozen links): a plan's groups, their
# buckets and the plans of one search repeat the same island sizes, links and sizes.
_TWO_LEVEL = Kept(100_000, shortcut=True)


def two_level_allreduce_time_s(*, elems: int, elem_bytes: float, island_links: Sequence[Link],
                               island_sizes: Sequence[int], bridge: Link) -> float:
    """The bridge's all-reduce across islands as ``comm/hierarchical.py`` runs it (``hethub.islands``:
    shard_segments): each island's ring reduce-scatter of the padded buffer over its own link, every
    member's segments all-reduced among one owner per island over the bridge (a member's one after
    another, members in parallel), then each island's ring all-gather."""
    links, sizes = tuple(island_links), tuple(island_sizes)
    return _TWO_LEVEL.get((elems, elem_bytes, links, sizes, bridge), lambda: _two_level_allreduce_time_s(
        elems=elems, elem_bytes=elem_bytes, island_links=links, island_sizes=sizes, bridge=bridge))


def _two_level_allreduce_time_s(*, elems: int, elem_bytes: float, island_links: Sequence[Link],
                                island_sizes: Sequence[int], bridge: Link) -> float:
    padded = padded_numel(elems, island_sizes)
    island_s = max(ring_pass_time_s(chunk_bytes=padded // k * elem_bytes, participants=k, link=lk)
                   for k, lk in zip(island_sizes, island_links, strict=True))
    per_member = segment_bytes(elems, island_sizes, elem_bytes=elem_bytes)
    bridge_s = max(sum(allreduce_time_s(nbytes=b, participants=len(island_sizes), link=bridge) for b in segs)
                   for isl in per_member for segs in isl)
    return 2 * island_s + bridge_s
