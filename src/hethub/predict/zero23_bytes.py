"""What a rank holds under ZeRO-2/3 beyond ZeRO-1's optimizer shard (``runtime/zero_grads.py``,
``zero_params.py``): its fp32 gradient shard, the parameters it keeps whole, the peak of the units it has
gathered at once (ZeRO-3) and a bound on its in-flight reduction rounds.

Built on :mod:`hethub.predict.sharding`'s buckets and owned elements (the one home of who owns what);
apart from the gradient shard every part depends on the stage's layout, TP degree and precision only,
not on the split, so the memory model asks it once per layout (``zero23_stage_bytes``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

from hethub.layout import (
    DEFAULT_BUCKET_ELEMS,
    ZERO_IN_FLIGHT_ROUNDS,
    StagePlace,
    bucket_ranges,
    gathers_params,
    stage_places,
    unit_position,
)
from hethub.memo import Kept, reference
from hethub.plan import Plan
from hethub.predict.sharding import Bucket, bucket_lines, layout_key, rank_shards, unit_elems
from hethub.spec.model import ModelSpec


@dataclass(frozen=True)
class Zero23Bytes:
    """One rank's memory under ZeRO-2/3 beyond ZeRO-1's (``runtime/zero_grads.py``, ``zero_params.py``):
    its persistent fp32 gradient shard, the parameters it keeps whole, the peak of the units it has
    gathered at once (ZeRO-3) and a bound on its in-flight reduction rounds."""

    grad_bytes: int
    whole_weight_bytes: int
    gathered_bytes: int
    round_bytes: int


def zero23_rank_bytes(plan: Plan, weights: Mapping[int, float], *,
                      bucket_elems: int = DEFAULT_BUCKET_ELEMS) -> dict[int, Zero23Bytes]:
    """Every rank's :class:`Zero23Bytes` (a ZeRO-2 plan's ranks gather nothing and keep every parameter):
    its gradient shard from its owned elements, the rest its stage's (``zero23_stage_bytes``)."""
    moments = rank_shards(plan, weights).moment_elems
    stage_of = {r: i for i, st in enumerate(stage_places(plan)) for r in st.ranks}
    held = zero23_stage_bytes(plan, bucket_elems=bucket_elems)
    return {r: Zero23Bytes(4 * moments[r], *held[stage_of[r]]) for r in range(plan.world_size)}


# zero23_stage_bytes by what it reads: the layout (layout_key; the model pinned), the ZeRO stage, the bucket
# size and each stage's TP degree and precision. The predictor asks it under several split weights per
# plan (each recomputation mode), and the planner's candidates, SP modes and ZeRO stages repeat layouts.
_HELD = Kept(64, shortcut=True)


def zero23_stage_bytes(plan: Plan, *, bucket_elems: int = DEFAULT_BUCKET_ELEMS) -> tuple[tuple[int, int, int], ...]:
    """Per stage (``stage_places`` order): (whole weight, gathered, round) bytes of :class:`Zero23Bytes`,
    which do not depend on the split. Each rank of a stage is a member of one line of every bucket its
    stage holds (its TP rank's, or the mixed bucket's one line) and of no other, with the stage's TP
    degree and precision: those bytes are its stage's."""
    key = (layout_key(plan), plan.zero_stage, bucket_elems,
           tuple((s.tp, plan.precision_of(s.kind)) for p in plan.pipelines for s in p.stages))
    return _HELD.get(key, lambda: _zero23_stage_bytes(plan, bucket_elems), pin=(plan.model,))


def _zero23_stage_bytes(plan: Plan, bucket_elems: int) -> tuple[tuple[int, int, int], ...]:
    """Per bucket, what a holder adds (its units' bytes, largest sub-bucket) depends only on its TP
    degree and weight bytes, and a stage's gather peak only on its gathered units' sizes and whether
    it holds the embedding: each is found once per such shape (replicas repeat a few), in integers,
    so the sums are the per-holder walk's whatever their order (a shortcut: memo.py)."""
    if reference():
        return _plain_zero23_stage_bytes(plan, bucket_elems)
    model, t = plan.model, _Tally(plan)
    for b, gather_bytes, gathered in t.buckets(plan):
        adds: dict[tuple[int, int], _HolderBytes] = {}  # by the holder's (TP degree, weight bytes)
        for st in b.holders:
            i = t.holder(st, mixed=b.mixed)
            add = adds.get((st.tp, t.wbytes[i]))
            if add is None:
                add = adds[(st.tp, t.wbytes[i])] = _holder_bytes(model, b.units, tp=st.tp, mixed=b.mixed,
                                                                wbytes=t.wbytes[i], gather_bytes=gather_bytes,
                                                                gathered=gathered, bucket_elems=bucket_elems)
            t.largest[i] = max(t.largest[i], add.largest)
            t.whole[i] += add.whole_bytes
            t.sizes[i].update(add.gathered)
    peaks: dict[tuple, int] = {}

    def peak(i: int, st: StagePlace) -> int:
        key = (st.embedding, tuple(t.sizes[i].items()))
        if key not in peaks:
            peaks[key] = _gather_peak(st, t.sizes[i], tied=model.tied_embeddings, num_layers=model.num_layers)
        return peaks[key]
    return t.rows(peak)


class _Tally:
    """Per stage of a plan, what its buckets add up to (`_zero23_stage_bytes` and its plain rule): the
    bytes of units kept whole, each gathered unit's (bytes, staging bytes), the largest bucket's (layout
    elems, local elems) and whether any of its buckets is mixed."""

    def __init__(self, plan: Plan) -> None:
        self.places = stage_places(plan)
        self.index = {(st.pipeline, st.stage): i for i, st in enumerate(self.places)}
        self.wbytes = [ModelSpec.state_bytes_per_param(plan.precision_of(st.kind))["weights"] for st in self.places]
        n = len(self.places)
        self.whole, self.largest, self.mixed_any = [0] * n, [(0, 0)] * n, [False] * n
        self.sizes: list[dict[str, tuple[int, int]]] = [{} for _ in range(n)]

    @staticmethod
    def buckets(plan: Plan) -> Iterator[tuple[Bucket, int, bool]]:
        """Each bucket with the bytes per weight its gathers move and whether ZeRO-3 gathers it."""
        for b, _ in bucket_lines(plan):
            precisions = {plan.precision_of(s.kind) for s in b.holders}
            gather_bytes = ModelSpec.state_bytes_per_param(precisions.pop())["weights"] if len(precisions) == 1 else 4
            yield b, gather_bytes, plan.zero_stage == 3 and gathers_params([(s.stage, s.num_stages) for s in b.holders])

    def holder(self, st: StagePlace, *, mixed: bool) -> int:
        """The index of holder ``st``'s stage, noting whether a bucket it holds is ``mixed``."""
        i = self.index[(st.pipeline, st.stage)]
        self.mixed_any[i] = self.mixed_any[i] or mixed
        return i

    def rows(self, peak: Callable[[int, StagePlace], int]) -> tuple[tuple[int, int, int], ...]:
        """(whole bytes, gather peak, bucket rounds' bytes) per stage, ``peak`` giving the gather peak."""
        out = []
        for i, st in enumerate(self.places):
            layout_elems, local_elems = self.largest[i]
            rounds = (ZERO_IN_FLIGHT_ROUNDS + 1) * layout_elems * 4 + (local_elems * 4 if self.mixed_any[i] else 0)
            out.append((self.whole[i], peak(i, st), rounds))
        return tuple(out)


@dataclass(frozen=True)
class _HolderBytes:
    """What one holder of a bucket adds: its largest sub-bucket (layout elems, local elems), the bytes
    of the units it keeps whole, and each gathered unit's (bytes, staging bytes)."""

    largest: tuple[int, int]
    whole_bytes: int
    gathered: tuple[tuple[str, tuple[int, int]], ...]


def _holder_bytes(model: ModelSpec, units: tuple[str, ...], *, tp: int, mixed: bool, wbytes: int, gather_bytes: int,
                  gathered: bool, bucket_elems: int) -> _HolderBytes:
    """``_HolderBytes`` of a holder of TP degree ``tp`` and ``wbytes`` per weight of a bucket of ``units``."""
    layout = [unit_elems(model, u, tp=1 if mixed else tp) for u in units]
    local = [unit_elems(model, u, tp=tp) for u in units]
    spans = bucket_ranges(layout, cap_elems=bucket_elems)  # units are not split here: a bound
    big = max(((sum(layout[lo:hi]), sum(local[lo:hi])) for lo, hi in spans), default=(0, 0))
    if not gathered:
        return _HolderBytes(big, sum(n * wbytes for n in local), ())
    direct = not mixed and gather_bytes == wbytes
    return _HolderBytes(big, 0, tuple((u, (n * wbytes, 0 if direct else n_layout * gather_bytes))
                                      for u, n_layout, n in zip(units, layout, local, strict=True)))


def _plain_zero23_stage_bytes(plan: Plan, bucket_elems: int) -> tuple[tuple[int, int, int], ...]:
    """The plain rule of ``_zero23_stage_bytes``: every holder of every bucket walked, every stage's
    gathers replayed (the reference path's, memo.py)."""
    model, t = plan.model, _Tally(plan)
    for b, gather_bytes, gathered in t.buckets(plan):
        for st in b.holders:
            i = t.holder(st, mixed=b.mixed)
            layout = [unit_elems(model, u, tp=1 if b.mixed else st.tp) for u in b.units]
            local = [unit_elems(model, u, tp=st.tp) for u in b.units]
            spans = bucket_ranges(layout, cap_elems=bucket_elems)  # units are not split here: a bound
            big = max(((sum(layout[lo:hi]), sum(local[lo:hi])) for lo, hi in spans), default=(0, 0))
            t.largest[i] = max(t.largest[i], big)
            for u, n_layout, n in zip(b.units, layout, local, strict=True):
                if not gathered:
                    t.whole[i] += n * t.wbytes[i]
                    continue
                direct = not b.mixed and gather_bytes == t.wbytes[i]
                t.sizes[i][u] = (n * t.wbytes[i], 0 if direct else n_layout * gather_bytes)
    return t.rows(lambda i, st: _gather_peak(st, t.sizes[i], tied=model.tied_embeddings, num_layers=model.num_layers))


def _gather_peak(st: StagePlace, sizes: Mapping[str, tuple[int, int]], *, tied: bool, num_layers: int) -> int:
    """Most bytes of gathered units a rank holds at once: its forward and backward ops replayed as
    ``runtime/zero_params.py`` runs them (groups gathered in data-flow order, the next one prefetched,
    a layer released after its use; a staging tensor lives from a gather's start to its wait)."""
    order = sorted(sizes, key=lambda u: unit_position(u, num_layers=num_layers))
    layers = [u for u in order if u.startswith("layer.")]
    front = [u for u in order if u in ("embed", "pos") and st.embedding]
    tail = [u for u in order if u in ("final_norm", "head") or (u == "embed" and not st.embedding)]
    back = [u for u in order if u in ("final_norm", "head") or (u == "embed" and tied)]
    replay = _Replay(sizes)
    for seq in ([g for g in (front, *([u] for u in layers), tail) if g],
                [g for g in (back, *([u] for u in reversed(layers))) if g]):
        replay.op(seq)
    return replay.peak


class _Replay:
    """The live bytes of one rank's gathers over its ops (``_gather_peak``)."""

    def __init__(self, sizes: Mapping[str, tuple[int, int]]) -> None:
        self.sizes, self.peak = sizes, 0

    def op(self, seq: list[list[str]]) -> None:
        self.live, self.started, self.waited = 0, set(), set()
        for k, g in enumerate(seq):
            layer = g[0].startswith("layer.")
            if k == 0 and layer:
                self._start(g)
            self._run(seq, k)
            if layer:
                self.live -= self.sizes[g[0]][0]  # released after its use

    def _start(self, g: list[str]) -> None:
        for u in g:
            if u not in self.started:
                self.started.add(u)
                self.live += sum(self.sizes[u])
                self.peak = max(self.peak, self.live)

    def _run(self, seq: list[list[str]], k: int) -> None:
        self._start(seq[k])
        for u in seq[k]:
            if u not in self.waited:
                self.waited.add(u)
                self.live -= self.sizes[u][1]
        if k + 1 < len(seq):
            self._start(seq[k + 1])
