"""Representative links between stages and replicas, before devices are chosen.

The search prices a template without knowing which node each stage lands on. The device allocator
(assemble.py) places a pipeline's stages of one kind on consecutive devices, so consecutive stages
whose TP groups fit one node together usually share it; otherwise they cross the kind's NIC, or the
cross-kind path at a kind boundary. Final scoring uses the real devices.
"""

from __future__ import annotations

import functools
import itertools

from hethub.layout import split_hop
from hethub.predict.comm import stage_hop_time_s
from hethub.search.split import Slot
from hethub.spec.cluster import Cluster, Link


class LinkBook:
    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.ring_cache: dict[tuple, dict] = {}  # all-reduce times by ring size, shared by a search's estimates
        self.node_size: dict[str, int] = {}
        self.nic_size: dict[str, int] = {}  # devices behind one NIC (the fewest over the kind's groups)
        self._p2p: dict[tuple[str, int, str, int], Link] = {}
        self._nic: dict[str, float] = {}
        self._hops: dict[tuple, float] = {}
        self._pipes: dict[tuple, tuple[float, ...]] = {}
        self._nodes: dict[str, list[list[int]]] = {}  # device ids of each node, by kind
        for d in cluster.devices:
            nodes = self._nodes.setdefault(d.kind, [])
            if not nodes or cluster.devices[nodes[-1][0]].node != d.node:
                nodes.append([])
            nodes[-1].append(d.id)
        for g in cluster.groups:
            nic = g.inter_node_bw_bytes_per_s or cluster.inter_node.bw_bytes_per_s
            self.node_size[g.kind] = min(self.node_size.get(g.kind, g.devices_per_node), g.devices_per_node)
            self.nic_size[g.kind] = min(self.nic_size.get(g.kind, g.nic_size), g.nic_size)
            self._nic[g.kind] = min(self._nic.get(g.kind, nic), nic)

    def intra(self, kind: str) -> Link:
        k = self.cluster.kinds[kind]
        return Link(k.intra_node_bw_bytes_per_s, k.intra_node_latency_s)

    @functools.cache  # noqa: B019 - one LinkBook per search, a handful of kinds
    def between(self, a: str, b: str) -> Link:
        """Inter-node link from kind a to kind b (the cluster's rule in Cluster.link)."""
        c = self.cluster
        bw, lat = min(self._nic[a], self._nic[b]), c.inter_node.latency_s
        if a != b:
            bw, lat = min(bw, c.cross_kind.bw_bytes_per_s), max(lat, c.cross_kind.latency_s)
        return Link(bw, lat)

    def p2p(self, a: Slot, b: Slot) -> Link:
        key = (a.kind, a.tp, b.kind, b.tp)  # cached: every layer split prices its stage boundaries
        link = self._p2p.get(key)
        if link is None:
            if a.kind == b.kind and a.tp + b.tp <= self.node_size[a.kind]:
                link = self._p2p[key] = self.intra(a.kind)
            else:
                link = self._p2p[key] = self.between(a.kind, b.kind)
        return link

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
        of `b`, by the predictor's rule (predict.comm.stage_hop_time_s: the executor's rank pairs, a
        node's NIC shared by its cross-node messages, TP-split hops between equal degrees) on
        representative devices: consecutive stages of one kind share a node where both fit in it
        (as `p2p` assumes) unless `across`, else they sit on two nodes (the cheapest, as the floors in
        bounds.py need)."""
        key = (a, b, numel, nbytes, across)
        t = self._hops.get(key)
        if t is None:
            place = self._place(a, b, across=bool(across))
            if place is None:
                link = self.p2p(a, b)
                t = link.latency_s + nbytes / link.bw_bytes_per_s
            else:
                t = stage_hop_time_s(self.cluster, senders=place[0], receivers=place[1], nbytes=nbytes,
                                     split=split_hop(a=a.tp, b=b.tp, numel=numel))
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

    def nic_share(self, kind: str, rings: int) -> int:
        """How many of `rings` concurrent rings (one per TP rank of a stage) cross one NIC of `kind`'s
        nodes: a TP group starts a node or a NIC's share of one, so min(rings, devices per NIC)."""
        return min(rings, self.nic_size[kind])

    def replicas(self, kinds: frozenset[str], *, devices: int, rings: int = 1) -> Link:
        """Slowest link of a data-parallel ring over pipelines made of these kinds, one of `rings` that
        run at once (one per TP rank of the holders' smallest degree): across nodes, the rings of a
        stage's ranks behind one NIC share it (predict.comm.rings_link; `nic_share` of them)."""
        ks = sorted(kinds)
        if len(ks) == 1 and devices <= self.node_size[ks[0]]:
            return self.intra(ks[0])
        share = {k: self.nic_share(k, rings) for k in ks}
        links = [(self.between(a, b), max(share[a], share[b])) for a in ks for b in ks]
        return Link(min(lk.bw_bytes_per_s / n for lk, n in links), max(lk.latency_s for lk, _ in links))
