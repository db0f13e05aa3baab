"""Measured per-layer times that replace the analytic roofline where we have them.

A profile belongs to one (model, device kind, sequence length) and holds, per (micro-batch size,
TP degree), the forward/backward/optimizer-update time of the embedding, of one decoder layer and of
the head. The on-disk formats (hethub's own and Sailor's) are read in :mod:`hethub.profile`; this
module is the in-memory form the predictor consumes.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field


@dataclass(frozen=True)
class LayerTimes:
    fwd_s: float
    bwd_s: float
    update_s: float = 0.0

    def scaled(self, factor: float) -> LayerTimes:
        return LayerTimes(self.fwd_s * factor, self.bwd_s * factor, self.update_s)


@dataclass(frozen=True)
class ProfileEntry:
    embedding: LayerTimes
    layer: LayerTimes
    head: LayerTimes
    peak_mem_bytes: int | None = None
    # False when a TP>1 entry was measured as the sharded layer alone (no TP group at hand): the
    # predictor then adds its modelled TP all-reduces. True for real TP groups and Sailor's data.
    tp_comm_included: bool = True
    # Optional: per-layer times measured on a stack of k > 1 decoder layers, as ((k, times per layer), ..)
    # sorted by k. `layer` is the k = 1 measurement. Empty (old files, Sailor): depth-independent.
    layer_by_depth: tuple[tuple[int, LayerTimes], ...] = ()
    # Of forward + backward, the share a rank spends on its CPU rather than waiting in TP collectives
    # (wall-clock TP entries on CPU); an emulated slower kind slows only that share, as the runtime's
    # emulation does (it sleeps in proportion to the chunk's thread CPU time). 1.0: all of it.
    cpu_fraction: float = 1.0

    def layer_at(self, depth: int) -> LayerTimes:
        """Per-layer times for a stage of `depth` decoder layers: linear in the depth between measured
        stack depths, the nearest measured one beyond them."""
        points = [(1, self.layer), *((k, t) for k, t in self.layer_by_depth if k > 1)]
        if len(points) == 1 or depth <= points[0][0]:
            return points[0][1]
        for (k0, t0), (k1, t1) in itertools.pairwise(points):
            if depth <= k1:
                w = (depth - k0) / (k1 - k0)
                return LayerTimes(*((1 - w) * a + w * b for a, b in
                                    zip((t0.fwd_s, t0.bwd_s, t0.update_s), (t1.fwd_s, t1.bwd_s, t1.update_s),
                                        strict=True)))
        return points[-1][1]


@dataclass(frozen=True)
class KindProfile:
    kind: str
    model: str
    seq_len: int
    entries: dict[tuple[int, int], ProfileEntry] = field(default_factory=dict)  # (mbs, tp) -> times
    source: str = ""
    # What the profile measured about its host (wake penalty, core speed spread) is not the kind's:
    # hethub.emulation.effects.HostEffects, read from the same file (profile.format.load_host_effects).

    def lookup(self, *, mbs: int, tp: int) -> ProfileEntry | None:
        """Times for (mbs, tp); a missing mbs is scaled linearly from the nearest measured one."""
        if (mbs, tp) in self.entries:
            return self.entries[(mbs, tp)]
        same_tp = [m for (m, t) in self.entries if t == tp]
        if not same_tp:
            return None
        near = min(same_tp, key=lambda m: abs(m - mbs))
        e, f = self.entries[(near, tp)], mbs / near
        return ProfileEntry(e.embedding.scaled(f), e.layer.scaled(f), e.head.scaled(f), None, e.tp_comm_included,
                            tuple((k, t.scaled(f)) for k, t in e.layer_by_depth), e.cpu_fraction)


@dataclass(frozen=True)
class ProfileSet:
    """Profiles by device kind name; the predictor falls back to analytic times for missing kinds."""

    by_kind: dict[str, KindProfile] = field(default_factory=dict)

    def get(self, kind: str) -> KindProfile | None:
        return self.by_kind.get(kind)
