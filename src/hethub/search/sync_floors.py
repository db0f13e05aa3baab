"""Floors under what a step adds after the makespan (the embedding's and the layers' gradient syncs,
closed_step.step_time_s's tail) for mixed pipelines placed beside a set of pure groups (search/mixed.py)."""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Iterator
from typing import NamedTuple

from hethub.layout import block_starts
from hethub.predict.holding import most_within, sure_spans
from hethub.predict.water import finish_lines
from hethub.schedules import get_schedule
from hethub.search.bounds import ALL_MODES, pipe_floor, segment_memory, segment_terms, stage_modes
from hethub.search.combine import Group
from hethub.search.split import Cache, Slot, in_flights
from hethub.search.templates import Searcher
from hethub.spec.model import ModelSpec

_LAYER_RINGS: Cache[float] = Cache("layer-sync-floors", shared=True)  # by SyncFloors._ring's arguments
_HELD: Cache[_Held | None] = Cache("segment-held", shared=True)  # held_floor's, by segment position
_MIDDLE_BASES: Cache[float] = Cache("middle-bases", shared=True)  # by (kind, tp, micro-batch size)
_EMBEDDING_RINGS: Cache[float] = Cache("embedding-sync-floors", shared=True)  # (kinds, least TP, replicas, devices)


class _Held(NamedTuple):
    """What held_floor reads of a segment's stages at their positions (bounds.segment_memory): the most
    layers they hold in any mode and without recomputation, and the least cost per layer of any mode."""

    most: int
    plain: int
    per_layer_s: float


class SyncFloors:
    """One set of pure groups beside which mixed pipelines are placed, with cached floors under
    what the step adds after the makespan (the embedding sync and the layers' gradient syncs)."""

    def __init__(self, s: Searcher, pure: list[Group]) -> None:
        self.s, self.pure = s, pure
        self.lines = finish_lines(pure)  # water.water_level_with's, for floors beside these groups
        self.devices = sum(g.count * g.pipe.num_devices for g in pure)
        self._sync: dict[tuple, float] = {}
        self.rate_levels: dict[tuple, float] = {}  # mixed._rate_level's, per family beside these groups
        self.replicas = sum(g.count for g in pure)
        # The embedding's holders among the pure groups (LinkBook.embedding_sync_floor_s's first stages and,
        # with tied embeddings, last ones): their kinds and smallest TP degree.
        ends = [sl for g in pure for sl in (g.pipe.slots[0], g.pipe.slots[-1])[:1 + s.model.tied_embeddings]]
        self.end_kinds, self.end_tp = frozenset(sl.kind for sl in ends), min([sl.tp for sl in ends], default=math.inf)
        # The ring floors depend on their keys and the job only: shared by every SyncFloors of the book.
        self._layer_rings, self._embedding_rings = s.book.cache(_LAYER_RINGS), s.book.cache(_EMBEDDING_RINGS)
        self._pure_tail: dict[tuple, float] = {}
        self._blocks: tuple | None = None  # _pure_blocks'
        self._prefixes: dict[tuple, list[float]] = {}  # _layer_floors'
        self._tails: dict[tuple, float] = {}
        self._cut_sums: dict[tuple, list[float]] = {}  # held_floor's, by (slot, replicas, devices)
        self._cuts: list[int] | None = None  # _pure_blocks' common cuts, sorted (held_floor's)
        self._segments, self._bases = s.book.cache(_HELD), s.book.cache(_MIDDLE_BASES)
        # A mixed stage's layers are also held by a stage of every kind-pure group (each holds all
        # layers), so its layer rings span those kinds too (tail_floor).
        pure_kinds = {k for g in pure if len(g.pipe.kinds) == 1 for k in g.pipe.kinds}
        self._kind_sets = {k: frozenset({k, *pure_kinds}) for k in s.counts}
        counts = {k: sum(g.count for g in pure if g.pipe.kinds == {k}) for k in pure_kinds}  # each layer's holders
        self._counts = tuple(sorted(counts.items())) if all(len(g.pipe.kinds) == 1 for g in pure) else None
        # A ring's link depends on its devices only through `devices <= node size` (LinkBook.replicas),
        # so device counts above every node size are one cache key: exact, and the caches hit across boxes.
        self._dev_cap = max(s.links.node_size.values(), default=0) + 1

    def _ring(self, kinds: frozenset[str], tp: int, replicas: int, devices: int,
              pure: tuple[tuple[str, int], ...] | None = None, rest: str = "") -> float:
        """A floor under one layer's gradient all-reduce (closed_step.step_time_s's ring) among `replicas`
        holders of `kinds` with TP degrees down to tp (``LinkBook.layer_sync_floor_s``; ``pure``, where
        known: how many of each kind the pure groups hold, the rest being of kind ``rest``). Layers are
        synced fused, which achieves more than one by one."""
        devices = min(devices, self._dev_cap)
        key = (kinds, tp, replicas, devices, pure, rest)
        if (hit := self._layer_rings.get(key)) is None:
            m, counts = self.s.model, None if pure is None else dict(pure)
            if counts is not None:
                counts[rest] = counts.get(rest, 0) + replicas - sum(counts.values())
            hit = self._layer_rings[key] = self.s.links.layer_sync_floor_s(
                kinds, tp=tp, replicas=replicas, devices=devices, matrix=m.layer_matmul_params,
                extra=m.layer_params - m.layer_matmul_params, counts=counts,
                elem_bytes=ModelSpec.state_bytes_per_param(self.s.config.precision)["grads"])
        return hit

    def _pure_blocks(self) -> tuple[set[int], list[tuple[int, int, frozenset[str], int, tuple]]]:
        """The cuts where every pure replica has a stage boundary, and each block of layers between
        any pure replica's boundaries: (start, end, its holders' kinds, their least TP, holders per kind)."""
        if self._blocks is None:
            n_layers = self.s.model.num_layers
            bounds = [set(block_starts(g.pipe.layers)) | {n_layers} for g in self.pure]
            stages = [[sl for sl, k in zip(g.pipe.slots, g.pipe.layers, strict=True) if k] for g in self.pure]
            starts = [[a for a, k in zip(block_starts(g.pipe.layers), g.pipe.layers, strict=True) if k]
                      for g in self.pure]
            blocks = []
            for a, b in itertools.pairwise(sorted(set.union(*bounds) | {0})):
                holders = [st[bisect.bisect_right(sa, a) - 1] for st, sa in zip(stages, starts, strict=True)]
                kinds = frozenset(h.kind for h in holders)
                have = tuple((k, sum(g.count for g, h in zip(self.pure, holders, strict=True) if h.kind == k))
                             for k in sorted(kinds))  # the pure holders per kind
                blocks.append((a, b, kinds, min(h.tp for h in holders), have))
            self._blocks = (set.intersection(*bounds) | {0, n_layers}, blocks)
        return self._blocks

    def _chains(self, replicas: int, devices: int, mixed: frozenset[str]) -> float:
        """The longest chain of layer syncs the pure groups force, whatever the mixed pipelines' split:
        two consecutive blocks of layers (between any replica's stage boundaries) run one after the
        other when some replica holds both on one stage (step_time_s runs a stage's blocks in layer
        order), so between two cuts where *every* replica has a stage boundary the blocks form one
        chain; the mixed pipelines can only remove such cuts. Each block is priced with the pure
        holders and any one mixed stage of the kinds `mixed` (a floor: the least of those rings)."""
        devices = min(devices, self._dev_cap)
        key = (replicas, devices, mixed)
        if (hit := self._pure_tail.get(key)) is None:
            common, blocks = self._pure_blocks()
            hit = chain = 0.0
            for a, b, kinds, tp, have in blocks:
                if a in common:
                    chain = 0.0
                chain += (b - a) * min(self._ring(kinds | {m}, tp, replicas, devices, have, m)
                                       for m in {*mixed, *kinds})
                hit = max(hit, chain)
            self._pure_tail[key] = hit
        return hit

    def split_floor(self, slots: tuple[Slot, ...], layers: tuple[int, ...], c: int) -> float:
        """A floor under what closed_step.step_time_s adds after the makespan for c mixed pipelines of this
        split (stages `slots` holding `layers`) beside the pure groups, its boundaries known (priced or not):
        `_chains` with the mixed stages in place. A chain breaks only at a mixed boundary where every pure
        replica has one too, so each chain is whole mixed stages, its blocks priced with the pure holders
        and that stage's (`_layer_floors`)."""
        replicas = self.replicas + c
        if replicas <= 1:
            return 0.0
        devices = min(self.devices + c * sum(sl.tp for sl in slots), self._dev_cap)
        common = self._pure_blocks()[0] if self.pure else None  # None: every mixed boundary is common
        hit = chain = 0.0
        floors_of: dict[Slot, list[float]] = {}  # a mixed pipeline has few distinct stage shapes
        for a, k, sl in zip(block_starts(layers), layers, slots, strict=True):
            if k:
                if common is None or a in common:
                    chain = 0.0
                if (floors := floors_of.get(sl)) is None:
                    floors = floors_of[sl] = self._layer_floors(sl, replicas, devices)
                chain += floors[a + k] - floors[a]
                if chain > hit:
                    hit = chain
        return hit

    def held_floor(self, segs: tuple[tuple[str, int, int], ...], c: int, mbs: int) -> float:
        """A floor under `split_floor` of every split the mixed search may price of c pipelines of these
        segments (both halves of Searcher.splits), found before splitting: the layers between two adjacent
        cuts where every pure replica has a boundary are in one chain of syncs whatever the split, and
        where every split gives them to stages of one segment (`_sure_spans`) their rings are its stages'."""
        replicas = self.replicas + c
        if not self.pure or replicas <= 1 or (halves := self._sure_spans(segs, mbs)) is None:
            return 0.0
        devices = min(self.devices + c * sum(t * n for _, t, n in segs), self._dev_cap)
        if self._cuts is None:
            self._cuts = sorted(self._pure_blocks()[0])
        cuts, best = self._cuts, math.inf
        for spans in halves:  # None: no split of that half fits
            held = 0.0
            for (kind, tp, _), (a, b) in zip(segs, spans or (), strict=False):
                i, j = bisect.bisect_left(cuts, a), bisect.bisect_right(cuts, b) - 1
                if i < j:
                    held = max(held, max(self._cut_sums_of(Slot(kind, tp), replicas, devices)[i:j]))
            if spans is not None and (best := min(best, held)) == 0.0:
                break
        return best * (1 - 1e-9)  # a chain sums stage differences, which may round below one difference

    def _sure_spans(self, segs: tuple[tuple[str, int, int], ...],
                    mbs: int) -> Iterator[list[tuple[int, int]] | None] | None:
        """Layers each segment holds in every split of each half, without recomputation first
        (holding.sure_spans; None where no split of it fits): middle stages hold at least one, every stage
        at most its capacity and, with recomputation, what its modes hold within a bound on the bottleneck
        (the min-max split's B* is at most the floor's B plus the largest base a middle stage pays that the
        floor leaves out, and at least every stage's base; every split stays within B* times a slack).
        None: not known."""
        s = self.s
        book, p, n_layers = s.book, sum(n for _, _, n in segs), s.model.num_layers
        hint = s.in_flight_hint(sum(t * n for _, t, n in segs), mbs)
        flights = in_flights(book, get_schedule(book.job.schedule, chunks=book.job.chunks), p, hint)
        pos, reach = 0, []
        for kind, tp, n in segs:
            key = (kind, tp, mbs, flights[pos:pos + n], pos == 0, pos + n == p)
            if (hit := self._segments.get(key, ())) == ():
                terms = segment_terms(book, kind, tp, n, mbs, pos == 0, pos + n == p, ALL_MODES)
                seg = segment_memory(book, kind, tp, mbs, key[3], pos == 0, pos + n == p, ALL_MODES, terms[4])
                hit = self._segments[key] = None if seg is None else _Held(seg[5], seg[1], terms[3])
            if hit is None:
                return None
            reach.append((n, n - (pos == 0) - (pos + n == p), hit))
            pos += n
        floor = pipe_floor(book, s.links, segs, mbs, in_flight_hint=hint) if s.config.allow_recompute else None
        if s.config.allow_recompute and floor is None:
            return None

        def halves() -> Iterator[list[tuple[int, int]] | None]:  # the second only where the first is read
            yield sure_spans([(low, held.plain) for _, low, held in reach], n_layers)
            if floor is not None:
                ends = (stage_modes(book, *segs[0][:2], mbs, True, p == 1, flights[0]),
                        stage_modes(book, *segs[-1][:2], mbs, p == 1, True, flights[-1]))
                bound = max(floor.bottleneck_s * (1 + 1e-9) + max(self._middle_base(k, t, mbs) for k, t, _ in segs),
                            *(min(b for c, _, b in modes if c >= 0) for modes in ends)) * max(s.slacks()) * (1 + 1e-9)
                yield sure_spans([(low, most_within(held=held.most, stages=n, per_layer_s=held.per_layer_s,
                                                    time_s=bound)) for n, low, held in reach], n_layers)
        return halves()

    def _middle_base(self, kind: str, tp: int, mbs: int) -> float:
        """The largest time a middle stage of this shape takes without layers, over its modes."""
        key = (kind, tp, mbs)
        if (hit := self._bases.get(key)) is None:
            hit = self._bases[key] = max(v.work(emb=False, head=False).base
                                         for v in self.s.book.modes(kind, tp=tp, mbs=mbs))
        return hit

    def _cut_sums_of(self, sl: Slot, replicas: int, devices: int) -> list[float]:
        """`_layer_floors`' sums between each two adjacent cuts where every pure replica has a boundary."""
        key = (sl, replicas, devices)
        if (hit := self._cut_sums.get(key)) is None:
            floors = self._layer_floors(sl, replicas, devices)
            hit = self._cut_sums[key] = [floors[b] - floors[a] for a, b in itertools.pairwise(self._cuts or ())]
        return hit

    def _layer_floors(self, sl: Slot, replicas: int, devices: int) -> list[float]:
        """Prefix sums over the layers of `_ring` for each layer's holders: the pure groups' and c
        stages of sl's kind and TP degree (the rest of the replicas)."""
        key = (sl, replicas, devices)
        if (hit := self._prefixes.get(key)) is None:
            m, per = sl.kind, []
            # Without pure groups every layer's holders are the mixed stages alone: one block.
            blocks = self._pure_blocks()[1] if self.pure else [(0, self.s.model.num_layers, frozenset(), sl.tp, ())]
            for a, b, kinds, tp, have in blocks:
                per += [self._ring(kinds | {m}, min(tp, sl.tp), replicas, devices, have, m)] * (b - a)
            hit = self._prefixes[key] = [0.0, *itertools.accumulate(per)]
        return hit

    def sync_floor(self, pairs: list[tuple[Slot, Slot]], c: int, devices: int) -> float:
        """The embedding sync after the makespan (LinkBook.embedding_sync_floor_s) for c mixed pipelines
        of at least `devices` devices whose (first, last) stages are one of `pairs`; more replicas and
        more devices only slow a ring down, so a box's smallest are a floor for all of it."""
        key = (tuple(pairs), c, devices)
        if (hit := self._sync.get(key)) is None:
            replicas, total = self.replicas + c, min(self.devices + c * devices, self._dev_cap)
            hit = math.inf if replicas > 1 else 0.0
            s, tied = self.s, self.s.model.tied_embeddings
            for a, b in pairs if replicas > 1 else ():  # beside the pure groups' first (and, tied, last) stages
                kinds = self.end_kinds | {a.kind, *((b.kind,) if tied else ())}
                tp = min(a.tp, b.tp, self.end_tp) if tied else min(a.tp, self.end_tp)
                if (t := self._embedding_rings.get((kinds, tp, replicas, total))) is None:
                    t = self._embedding_rings[kinds, tp, replicas, total] = s.links.embedding_sync_floor_s(
                        kinds, tp, replicas, devices=total, model=s.model, precision=s.config.precision)
                hit = min(hit, t)
            self._sync[key] = hit
        return hit

    def order_floor(self, segs: tuple[tuple[str, int, int], ...], c: int, devices: int) -> float:
        """`sync_floor` and `tail_floor` of c mixed pipelines of these segments in this order."""
        return max(self.sync_floor([(Slot(*segs[0][:2]), Slot(*segs[-1][:2]))], c, devices),
                   self.tail_floor(segs, c, devices))

    def tail_floor(self, segs: tuple[tuple[str, int, int], ...], c: int, devices: int) -> float:
        """A floor under what closed_step.step_time_s adds after the makespan for c mixed pipelines of
        these segments (at most n stages of each; at least `devices` devices each) beside the pure
        groups: after the loss barrier every stage syncs its layers block by block, so at least the
        pure groups' longest chain of syncs (`_chains`), and one mixed stage's layer rings: the mixed
        stages hold all L layers, so one holds k_s layers with k_s r_s >= L / sum_s 1 / r_s (r_s its
        ring per layer among holders of its kind and every kind-pure group's). Fewer replicas or
        devices only make rings faster, so c and `devices` may be a box's smallest."""
        replicas = self.replicas + c
        if replicas <= 1:
            return 0.0
        total = min(self.devices + c * devices, self._dev_cap)
        key = (segs, replicas, total)
        if (hit := self._tails.get(key)) is None:
            pure = self._chains(replicas, total, frozenset(k for k, _, _ in segs)) if self.pure else 0.0
            inv = sum(n / r for k, tp, n in segs if (r := self._ring(self._kind_sets[k], tp, replicas, total,
                                                                      self._counts, k)) > 0)
            hit = self._tails[key] = max(pure, self.s.model.num_layers / inv if inv > 0 else 0.0)
        return hit
