"""Representative links between stages and replicas, before devices are chosen: the stage cost
model's hop and ring times (``Cluster.link``, ``comm.boundary_time_s``, ``comm.rings_link``) on
the devices a planner's layout would give, kept per cluster.

The search prices a template without knowing which node each stage lands on. The device allocator
(layout_assemble.py) places a pipeline's stages of one kind on consecutive devices, so consecutive stages
whose TP groups fit one node together usually share it; otherwise they cross the kind's NIC, or the
cross-kind path at a kind boundary. Final scoring uses the real devices.
"""

from __future__ import annotations

import itertools
import math
from typing import NamedTuple

from hethub.layout import DEFAULT_BUCKET_ELEMS
from hethub.predict.comm import allreduce_floor_s, boundary_time_s, p2p_time_s, rings_link
from hethub.predict.stage_cost import tp_link
from hethub.predict.sync_overlap import bucket_count
from hethub.predict.sync_rules import islands_allreduce_s, kind_island_labels
from hethub.runtimes import DEFAULT_RUNTIME, runtime_profile
from hethub.spec.cluster import Cluster, Link
from hethub.spec.model import ModelSpec


class Slot(NamedTuple):
    """One stage's device kind and TP degree. A tuple: the floors and caches key on slots ~10^5 times
    per search, and a tuple hashes and compares in C."""

    kind: str
    tp: int


class LinkBook:
    """The planner's caches over the predictor's link rules (``Cluster.link``, and the NIC-sharing
    rule of ``predict.comm.shared_links`` through ``boundary_time_s`` and ``rings_link``), read on
    representative devices: each kind's first nodes, from their first device."""

    def __init__(self, cluster: Cluster, *, runtime: str = DEFAULT_RUNTIME) -> None:
        self.cluster = cluster
        # Whether the runtime reduces gradients in buckets (runtimes: dp_overlap), each its own all-reduce.
        self.buckets = runtime_profile(runtime).dp_overlap
        # All-reduce times by gradient element size and `within_node` of the device count (all they read
        # of it), shared by a search's estimates.
        self.ring_cache: dict[tuple, dict] = {}
        self.node_size: dict[str, int] = {}
        self._hops: dict[tuple, float] = {}
        self._pipes: dict[tuple, tuple[float, ...]] = {}
        self._rings: dict[tuple, Link] = {}
        self._between: dict[tuple[str, str], Link] = {}
        self._within: dict[int, frozenset[str]] = {}
        self._nodes: dict[str, list[list[int]]] = {}  # device ids of each node, by kind
        for d in cluster.devices:
            nodes = self._nodes.setdefault(d.kind, [])
            if not nodes or cluster.devices[nodes[-1][0]].node != d.node:
                nodes.append([])
            nodes[-1].append(d.id)
        for g in cluster.groups:
            self.node_size[g.kind] = min(self.node_size.get(g.kind, g.devices_per_node), g.devices_per_node)

    def intra(self, kind: str) -> Link:
        return tp_link(self.cluster.kinds[kind])

    def between(self, a: str, b: str) -> Link:
        """The link from a device of kind a to one of kind b on another node (``Cluster.link``)."""
        if (a, b) not in self._between:  # the book's own (a method cache would keep every book alive)
            na, nb = self._nodes[a], self._nodes[b]
            other = [n for n in nb if n is not na[0]]
            self._between[a, b] = self.cluster.link(na[0][0], other[0][0]) if other else self.intra(a)
        return self._between[a, b]

    def p2p(self, a: Slot, b: Slot) -> Link:
        """The link between consecutive stages where no representative devices place them."""
        if a.kind == b.kind and a.tp + b.tp <= self.node_size[a.kind]:
            return self.intra(a.kind)
        return self.between(a.kind, b.kind)

    def pipe_hops(self, slots: tuple[Slot, ...], *, numel: int, nbytes: float) -> tuple[float, ...]:
        """Each hop of a pipeline of these stages (`hop_s`), its kinds' segments laid out from a node's
        first device as the allocator does at best: consecutive stages of a kind share a node until
        it is full, then the next stage starts on the next node (ceil(devices / node) - 1 crossings)."""
        key = (slots, numel, nbytes)
        out = self._pipes.get(key)
        if out is None:
            hops, used = [], 0
            for a, b in itertools.pairwise(slots):
                across = None
                if a.kind == b.kind:
                    used += a.tp
                    across = used % self.node_size[a.kind] == 0 or used % self.node_size[a.kind] + b.tp > \
                        self.node_size[a.kind]
                    if across:
                        used = 0
                else:
                    used = 0
                hops.append(self.hop_s(a, b, numel=numel, nbytes=nbytes, across=across))
            out = self._pipes[key] = tuple(hops)
        return out

    def hop_s(self, a: Slot, b: Slot, *, numel: int, nbytes: float, across: bool | None = None) -> float:
        """One micro-batch's activations (``numel`` elements, ``nbytes``) from a stage of `a` to the next
        of `b` and the gradient back, by the predictor's rule (predict.comm.boundary_time_s: the
        executor's rank pairs, a node's NIC shared by its cross-node messages, flat pieces) on
        representative devices: consecutive stages of one kind share a node where both fit in it
        (as `p2p` assumes) unless `across`, else they sit on two nodes (the cheapest, as the floors in
        bounds.py need)."""
        key = (a, b, numel, nbytes, across)
        t = self._hops.get(key)
        if t is None:
            place = self._place(a, b, across=bool(across))
            if place is None:
                link = self.p2p(a, b)
                t = p2p_time_s(link, nbytes)
            else:
                t = boundary_time_s(self.cluster, senders=place[0], receivers=place[1], numel=numel,
                                    nbytes=nbytes)
            self._hops[key] = t
        return t

    def _place(self, a: Slot, b: Slot, *, across: bool) -> tuple[list[int], list[int]] | None:
        src = [n for n in self._nodes.get(a.kind, []) if len(n) >= a.tp]
        dst = [n for n in self._nodes.get(b.kind, []) if len(n) >= b.tp]
        if a.kind == b.kind and a.tp + b.tp <= self.node_size[a.kind] and not across:
            both = [n for n in src if len(n) >= a.tp + b.tp]
            return (both[0][:a.tp], both[0][a.tp:a.tp + b.tp]) if both else None
        if not src or not dst:
            return None
        other = [n for n in dst if n is not src[0]]
        if not other:
            return None
        return src[0][:a.tp], other[0][:b.tp]

    def replicas(self, kinds: frozenset[str], *, devices: int, rings: int = 1) -> Link:
        """Slowest link of a data-parallel ring over pipelines made of these kinds, one of `rings` that
        run at once (one per TP rank of the holders' smallest degree): the rings laid on two nodes of
        each kind (one where it has one), ring q through each node's q-th device, priced by
        ``predict.comm.rings_link`` (the rings' hops through one NIC share it)."""
        ks = sorted(kinds)
        if len(ks) == 1 and (devices <= self.node_size[ks[0]] or len(self._nodes[ks[0]]) < 2):
            return self.intra(ks[0])  # the holders share a node
        key = (tuple(ks), rings)
        link = self._rings.get(key)
        if link is None:
            nodes = [n for k in ks for n in self._nodes[k][:2]]
            width = min([rings, *(len(n) for n in nodes)])
            link = self._rings[key] = rings_link(self.cluster, [[n[q] for n in nodes] for q in range(width)])
        return link

    def within_node(self, devices: int) -> frozenset[str]:
        """The kinds whose node could hold ``devices`` devices: all that `replicas` (and so
        `sync_allreduce_s`) reads of a device count, so that their results can be kept per answer."""
        if (out := self._within.get(devices)) is None:
            out = self._within[devices] = frozenset(k for k, size in self.node_size.items() if devices <= size)
        return out

    def sync_allreduce_s(self, kinds: dict[str, int], *, tp: int, nbytes: float, elem_bytes: float,
                         devices: int) -> float:
        """One gradient-sync group's all-reduce among holders of these kinds (holder count per kind),
        their smallest TP degree `tp`, by the predictor's rule (``predict.sync_rules.islands_allreduce_s``) on
        representative links (`replicas`): one ring over the holders' slowest link inside a vendor
        island; across islands each island's ring over its own kinds' link, and the slowest
        cross-island pair of kinds (`between`) as the bridge. Where the runtime reduces in buckets,
        each bucket is its own all-reduce (``predict.sync_overlap.bucket_count``; their overlap with the
        backward is the predictor's alone)."""
        n = bucket_count(nbytes, elem_bytes=elem_bytes) if self.buckets else 1
        return n * self._group_allreduce_s(kinds, tp=tp, nbytes=nbytes / n, elem_bytes=elem_bytes, devices=devices)

    def _group_allreduce_s(self, kinds: dict[str, int], *, tp: int, nbytes: float, elem_bytes: float,
                           devices: int) -> float:
        labels = kind_island_labels(self.cluster, kinds)
        link = self.replicas(frozenset(kinds), devices=devices, rings=tp)
        participants = sum(kinds.values())
        by_island: dict[str, list[str]] = {}
        for k in kinds:
            by_island.setdefault(labels[k], []).append(k)
        if len(by_island) == 1:
            return islands_allreduce_s(nbytes=nbytes, elem_bytes=elem_bytes, participants=participants, link=link)
        islands = [(sum(kinds[k] for k in ks), self.replicas(frozenset(ks), devices=devices, rings=tp))
                   for ks in by_island.values()]
        pairs = [self.between(a, b) for a in kinds for b in kinds if labels[a] != labels[b]]
        bridge = Link(min(lk.bw_bytes_per_s for lk in pairs), max(lk.latency_s for lk in pairs))
        return islands_allreduce_s(nbytes=nbytes, elem_bytes=elem_bytes, participants=participants, link=link,
                                   islands=islands, bridge=bridge)

    def embedding_sync_floor_s(self, kinds: frozenset[str], tp: int, replicas: int, *, devices: int,
                               model: ModelSpec, precision: str) -> float:
        """A floor under what the search's closed form (predict/closed_step.step_time_s) adds after the
        makespan: the last pipeline to finish ends with its first stage, whose embedding gradients are
        then all-reduced among `replicas` holders of these kinds (first stages; with tied embeddings,
        last ones too), smallest TP degree `tp`, before it can update."""
        gb = ModelSpec.state_bytes_per_param(precision)["grads"]
        link, nbytes = self.replicas(kinds, devices=devices, rings=tp), model.embedding_elems(tp) * gb
        return min(islands_allreduce_s(nbytes=nbytes, elem_bytes=gb, participants=replicas, link=link),
                   self.bridge_floor_s(kinds, nbytes=nbytes, replicas=replicas))  # across islands: two-level

    def layer_sync_floor_s(self, kinds: frozenset[str], *, tp: int, replicas: int, devices: int, matrix: float,
                           extra: float, elem_bytes: float, counts: dict[str, int] | None = None) -> float:
        """A floor under `sync_allreduce_s` of (matrix / t + extra) elements among `replicas` holders of
        these kinds whose smallest TP degree t is at most tp. Within a node the ring is fastest at the
        largest degree (the smallest shards); across nodes at degree 1, because the shard's rings share
        the NIC (the extra counts t times), so the floor is the smaller of the two. Each at the line
        rate (``allreduce_floor_s``), and more kinds only slow a ring; across vendor islands the
        two-level exchange may beat the slowest link's ring: `islands_floor_s` where ``counts`` (the
        holders per kind) are known, else `bridge_floor_s`.

        A floor per layer of what is synced fused: a block of k layers is k x this or more. Its
        all-reduce runs in n >= k E / bucket_elems buckets where the runtime reduces in buckets (E: a
        layer's elements at the holders' least degree, at least at tp), once per block where not, and
        each pays the latencies; so a layer counts min(1, E / bucket_elems) of them, none without buckets."""
        across = counts is not None and len(set(kind_island_labels(self.cluster, kinds).values())) > 1
        share = min(1.0, (matrix / tp + extra) / DEFAULT_BUCKET_ELEMS) if self.buckets else 0.0

        def one(t: int) -> float:
            nb = (matrix / t + extra) * elem_bytes
            if across:
                return self.islands_floor_s(counts, nbytes=nb, devices=devices, rings=t, latency_share=share)
            link = self.replicas(kinds, devices=devices, rings=t)
            return min(allreduce_floor_s(nbytes=nb, participants=replicas, link=_latency_share(link, share)),
                       self.bridge_floor_s(kinds, nbytes=nb, replicas=replicas, latency_share=share))
        return min(one(t) for t in {1, tp})

    def islands_floor_s(self, kinds: dict[str, int], *, nbytes: float, devices: int, rings: int,
                        latency_share: float = 1.0) -> float:
        """A floor under `sync_allreduce_s` of ``nbytes`` among exactly these holders (count per kind)
        spanning several vendor islands, their smallest TP degree ``rings``. The two-level exchange
        (predict.sync_rules.two_level_allreduce_time_s) runs a reduce-scatter and an all-gather of the whole
        buffer in each island, at least that island's ring all-reduce at the line rate; and each
        island's members together own the whole buffer on the bridge, so one member of the smallest
        island all-reduces at least nbytes / its size over it. Elements round to whole ones per
        bucket: the bytes are taken a hair low. Buckets only add latencies (``latency_share``: the share
        of each latency counted, `layer_sync_floor_s`)."""
        labels = kind_island_labels(self.cluster, kinds)
        islands: dict[str, list[str]] = {}
        for k in kinds:
            islands.setdefault(labels[k], []).append(k)
        pairs = [self.between(a, b) for a in kinds for b in kinds if labels[a] != labels[b]]
        if not pairs:
            return 0.0
        bridge = Link(min(lk.bw_bytes_per_s for lk in pairs), max(lk.latency_s for lk in pairs) * latency_share)
        sizes = [sum(kinds[k] for k in ks) for ks in islands.values()]
        nbytes = nbytes * (1 - 1e-6) - 4.0
        return max(allreduce_floor_s(nbytes=nbytes, participants=n, link=_latency_share(
            self.replicas(frozenset(ks), devices=devices, rings=rings), latency_share))
                   for n, ks in zip(sizes, islands.values(), strict=True)) \
            + allreduce_floor_s(nbytes=nbytes / min(sizes), participants=len(sizes), link=bridge)

    def bridge_floor_s(self, kinds: frozenset[str], *, nbytes: float, replicas: int,
                       latency_share: float = 1.0) -> float:
        """A floor under `sync_allreduce_s` of ``nbytes`` among ``replicas`` holders of these kinds,
        however many each kind has, where they span several vendor islands (inf inside one: the ring
        is the floor there): the two-level exchange moves at least one member's segments, at least
        nbytes / (replicas - 1), as an all-reduce over the bridge at line rate."""
        labels = kind_island_labels(self.cluster, kinds)
        pairs = [self.between(a, b) for a in kinds for b in kinds if labels[a] != labels[b]]
        if not pairs or replicas < 2:
            return math.inf
        bridge = Link(min(lk.bw_bytes_per_s for lk in pairs), max(lk.latency_s for lk in pairs) * latency_share)
        return allreduce_floor_s(nbytes=nbytes / (replicas - 1), participants=2, link=bridge)


def _latency_share(link: Link, share: float) -> Link:
    """The link with only ``share`` of its latency (a floor's count of the latencies it may take)."""
    return link if share == 1.0 else Link(link.bw_bytes_per_s, link.latency_s * share, link.fabric)
