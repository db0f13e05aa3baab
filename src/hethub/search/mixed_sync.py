"""Floors under what a step adds after the makespan when mixed pipelines run beside a set of pure
groups (combine.step_time_s's embedding sync and per-layer gradient syncs), cached per set of pure
groups: the branch-and-bound of :mod:`hethub.search.mixed` adds them to its makespan floors.
"""

from __future__ import annotations

import bisect
import itertools
import math

from hethub.layout import block_starts
from hethub.predict.comm import allreduce_time_s
from hethub.search.combine import Group, embedding_ring_s, finish_lines
from hethub.search.split import Slot
from hethub.search.templates import Searcher
from hethub.spec.model import ModelSpec


class SyncFloors:
    """One set of pure groups beside which mixed pipelines are placed, with cached floors under
    what the step adds after the makespan (the embedding sync and the layers' gradient syncs)."""

    def __init__(self, s: Searcher, pure: list[Group]) -> None:
        self.s, self.pure = s, pure
        self.lines = finish_lines(pure)  # combine.water_level_with's, for floors beside these groups
        self.devices = sum(g.count * g.pipe.num_devices for g in pure)
        self.firsts = [(g.pipe.slots[0], g.count) for g in pure]
        self.lasts = [(g.pipe.slots[-1], g.count) for g in pure]
        self._sync: dict[tuple, float] = {}
        self.rate_levels: dict[tuple, float] = {}  # mixed._rate_level's, per family beside these groups
        self.replicas = sum(g.count for g in pure)
        # The embedding's holders among the pure groups (combine.embedding_sync_floor's `first` and,
        # with tied embeddings, `last`): their kinds and smallest TP degree.
        ends = self.firsts + (self.lasts if s.model.tied_embeddings else [])
        self.end_kinds = frozenset(sl.kind for sl, _ in ends)
        self.end_tp = min([sl.tp for sl, _ in ends], default=math.inf)
        self._rings = s.sync_rings  # the ring floors depend on their keys only: shared by every SyncFloors
        self._pure_tail: dict[tuple, float] = {}
        self._tails: dict[tuple, float] = {}
        # A mixed stage's layers are also held by a stage of every kind-pure group (each holds all
        # layers), so its layer rings span those kinds too (tail_floor).
        pure_kinds = {k for g in pure if len(g.pipe.kinds) == 1 for k in g.pipe.kinds}
        self._kind_sets = {k: frozenset({k, *pure_kinds}) for k in s.counts}
        # A ring's link depends on its devices only through `devices <= node size` (LinkBook.replicas),
        # so device counts above every node size are one cache key: exact, and the caches hit across boxes.
        self._dev_cap = max(s.links.node_size.values(), default=0) + 1

    def _ring(self, kinds: frozenset[str], tp: int, replicas: int, devices: int) -> float:
        """A floor under one layer's gradient all-reduce (combine.step_time_s's ring) among `replicas`
        holders that include stages of `kinds` with TP degrees down to tp: the holders' smallest TP is
        at most tp, and more kinds only make the ring's slowest link slower. Within a node the ring
        is fastest at the largest degree (the smallest shards); across nodes at degree 1, because the
        shard's rings share the NIC (tp rings of (matrix / tp + norm) bytes: the norm counts tp
        times), so the floor is the smaller of the two."""
        devices = min(devices, self._dev_cap)
        key = ("layer", kinds, tp, replicas, devices)
        hit = self._rings.get(key)
        if hit is None:
            m, s = self.s.model, self.s
            gb = ModelSpec.state_bytes_per_param(s.config.precision)["grads"]
            norm = m.layer_params - m.layer_matmul_params
            hit = self._rings[key] = min(
                allreduce_time_s(nbytes=(m.layer_matmul_params / t + norm) * gb, participants=replicas,
                                 link=s.links.replicas(kinds, devices=devices, rings=t)) for t in {1, tp})
        return hit

    def _chains(self, replicas: int, devices: int) -> float:
        """The longest chain of layer syncs the pure groups force, whatever the mixed pipelines' split:
        two consecutive blocks of layers (between any replica's stage boundaries) run one after the
        other when some replica holds both on one stage (step_time_s runs a stage's blocks in layer
        order), so between two cuts where *every* replica has a stage boundary the blocks form one
        chain; the mixed pipelines can only remove such cuts. Each block is priced with the pure
        holders' kinds and smallest TP (combine's ring with fewer holders known: a floor)."""
        devices = min(devices, self._dev_cap)
        key = (replicas, devices)
        hit = self._pure_tail.get(key)
        if hit is None:
            n_layers = self.s.model.num_layers
            bounds = [set(block_starts(g.pipe.layers)) | {n_layers} for g in self.pure]
            common = set.intersection(*bounds) | {0, n_layers}
            cuts = sorted(set.union(*bounds) | {0})
            stages = [[sl for sl, k in zip(g.pipe.slots, g.pipe.layers, strict=True) if k] for g in self.pure]
            starts = [[a for a, k in zip(block_starts(g.pipe.layers), g.pipe.layers, strict=True) if k]
                      for g in self.pure]
            hit = chain = 0.0
            for a, b in itertools.pairwise(cuts):
                if a in common:
                    chain = 0.0
                holders = [st[bisect.bisect_right(sa, a) - 1] for st, sa in zip(stages, starts, strict=True)]
                chain += (b - a) * self._ring(frozenset(h.kind for h in holders), min(h.tp for h in holders),
                                              replicas, devices)
                hit = max(hit, chain)
            self._pure_tail[key] = hit
        return hit

    def sync_floor(self, pairs: list[tuple[Slot, Slot]], c: int, devices: int) -> float:
        """The embedding sync after the makespan (combine.embedding_sync_floor) for c mixed pipelines
        of at least `devices` devices whose (first, last) stages are one of `pairs`; more replicas and
        more devices only slow a ring down, so a box's smallest are a floor for all of it."""
        key = (tuple(pairs), c, devices)
        hit = self._sync.get(key)
        if hit is None:
            replicas, total = self.replicas + c, min(self.devices + c * devices, self._dev_cap)
            hit = 0.0
            if replicas > 1:  # combine.embedding_sync_floor, its ring cached by (kinds, smallest TP)
                tied = self.s.model.tied_embeddings
                hit = min(self._embedding_ring(frozenset([a.kind, *((b.kind,) if tied else ())]),
                                               min(a.tp, b.tp) if tied else a.tp, replicas, total)
                          for a, b in pairs)
            self._sync[key] = hit
        return hit

    def _embedding_ring(self, kinds: frozenset[str], tp: int, replicas: int, total: int) -> float:
        """combine.embedding_ring_s for the pure groups' first (and, tied, last) stages plus these."""
        kinds, tp = kinds | self.end_kinds, min(tp, self.end_tp)
        key = ("embedding", kinds, tp, replicas, total)
        hit = self._rings.get(key)
        if hit is None:
            s = self.s
            hit = self._rings[key] = embedding_ring_s(kinds, tp, replicas, total_devices=total, links=s.links,
                                                  model=s.model, precision=s.config.precision)
        return hit

    def tail_floor(self, segs: tuple[tuple[str, int, int], ...], c: int, devices: int) -> float:
        """A floor under what combine.step_time_s adds after the makespan for c mixed pipelines of
        these segments (at most n stages of each; at least `devices` devices each) beside the pure
        groups: after the loss barrier every stage syncs its layers block by block, so the step is at
        least the barrier plus the pure groups' longest chain of syncs (`_chains`), and plus one mixed
        stage's layer rings: the mixed stages hold all L layers, so one holds k_s layers with
        k_s r_s >= L / sum_s 1 / r_s (r_s its ring per layer, among holders of its kind and every
        kind-pure group's: more kinds only slow a ring). Fewer replicas or devices only make rings
        faster, so c and `devices` may be a box's smallest."""
        replicas = self.replicas + c
        if replicas <= 1:
            return 0.0
        total = min(self.devices + c * devices, self._dev_cap)
        key = (segs, replicas, total)
        hit = self._tails.get(key)
        if hit is None:
            pure = self._chains(replicas, total) if self.pure else 0.0
            inv = sum(n / r for kind, tp, n in segs
                      if (r := self._ring(self._kind_sets[kind], tp, replicas, total)) > 0)
            hit = self._tails[key] = max(pure, self.s.model.num_layers / inv if inv > 0 else 0.0)
        return hit
