"""The mixed search drops an order before splitting it where its step with `SyncFloors.held_floor` in
place of its splits' sync floors could not enter the finalists: that floor must be at most
`SyncFloors.split_floor` of every split the search may price of the order (both halves of
Searcher.splits, every slack), checked on random orders beside random pure groups; and the search's
candidates must be those it finds without it (the floor at 0), in the same order, for fewer splits."""

import dataclasses
import itertools
import math
import random

import pytest
from test_mixed_pricing_floor import _pure_groups, _search, random_orders
from test_reference_search import instance

from hethub.predict.holding import most_within, sure_spans
from hethub.search import templates
from hethub.search.sync_floors import SyncFloors
from hethub.search.templates import Searcher


def _ranges(segs: tuple[tuple[str, int, int], ...], counts: tuple[int, ...]) -> list[tuple[int, int]]:
    """The layers [start, end) each segment's stages hold in a split."""
    stage_ends = [0, *itertools.accumulate(n for _, _, n in segs)]
    layer_ends = [sum(counts[:i]) for i in stage_ends]
    return list(itertools.pairwise(layer_ends))


def held_and_split_floors(s: Searcher, rng: random.Random, *, tries: int,
                          covered: list[float]) -> list[tuple[float, float, float]]:
    """(held floor, least split floor over both halves' splits, order floor) of random orders of random
    shapes beside random pure groups; checks on the way that every split of each half gives each segment
    the layers `SyncFloors._sure_spans` says it holds whatever the split (appended to `covered`: the
    share of the layers they are, per half)."""
    out = []
    for mbs in (1, 2):
        pure = _pure_groups(s, mbs, rng)
        ctx = SyncFloors(s, pure)
        for c, segs in random_orders(s, pure, mbs, rng, tries=tries):
            slots = s.mixed_slots(segs)
            halves = [s.layer_splits(slots, mbs, recompute=r)
                      for r in (s.config.allow_recompute, False)[:1 + s.config.allow_recompute]]
            splits = [counts for half in halves for counts in half.counts]
            for spans, half in zip(ctx._sure_spans(segs, mbs) or (), halves[::-1], strict=False):
                if spans is None:  # no split of the half fits
                    assert not half.counts
                    continue
                for counts in half.counts:
                    for (a, b), (start, end) in zip(spans, _ranges(segs, counts), strict=True):
                        assert a >= b or start <= a < b <= end, (segs, spans, counts)
                covered.append(sum(max(0, b - a) for a, b in spans) / s.model.num_layers)
            if splits:
                out.append((ctx.held_floor(segs, c, mbs), min(ctx.split_floor(slots, x, c) for x in splits),
                            ctx.order_floor(segs, c, sum(t * n for _, t, n in segs))))
    return out


@pytest.mark.parametrize("slacks", ["small", "large"])  # the small clusters' slacks (1, 1.5, inf) or 1 alone
@pytest.mark.parametrize(("seed", "schedule"), [(0, "1f1b"), (0, "zb-h1"), (3, "1f1b"), (3, "zb-h1"),
                                                 (6, "gpipe"), (6, "1f1b")])
def test_held_floor_is_below_every_split_floor(seed, schedule, slacks, monkeypatch):
    cluster, model, config = instance(seed)
    if slacks == "large":
        monkeypatch.setattr(templates, "SMALL_CLUSTER", 0)
    s = Searcher(cluster=cluster, model=model, config=dataclasses.replace(config, schedule=schedule), profiles=None)
    covered: list[float] = []
    got = held_and_split_floors(s, random.Random(seed), tries=2, covered=covered)
    assert len(got) > 30
    bad = [(h, x) for h, x, _ in got if h > x]
    assert not bad, f"{len(bad)} of {len(got)} held floors above a split's sync floor, e.g. {bad[0]}"
    # not vacuous: the spans hold much of the model, and the floor knows more than the order's where pure
    # groups chain the syncs
    assert sum(covered) > len(covered) / 4
    assert sum(h > a for h, _, a in got) >= len(got) / 10


# beside pure groups, orders the held floor drops before splitting (3: two thirds of them)
@pytest.mark.parametrize("seed", [1, 3, 40])
def test_held_floor_keeps_the_search_candidates(seed, monkeypatch):
    cluster, model, config = instance(seed)
    monkeypatch.setattr(templates, "SMALL_CLUSTER", 0)  # one slack, as large clusters search
    splits = []
    layer_splits = Searcher.layer_splits
    monkeypatch.setattr(Searcher, "layer_splits", lambda self, *a, **k: splits.append(a) or layer_splits(self, *a, **k))
    got, _, _ = _search(cluster, model, config)
    fast = len(splits)
    monkeypatch.setattr(SyncFloors, "held_floor", lambda self, segs, c, mbs: 0.0)
    plain, _, _ = _search(cluster, model, config)
    assert got == plain
    assert fast < len(splits) - fast


def test_most_within_and_sure_spans_bound_every_split():
    # most_within is at least the layers stages hold within a time (each stage its best mode), their
    # capacities at inf; sure_spans' layers are held by their segment in every split within the bounds,
    # None where there is none (all splits enumerated).
    rng = random.Random(5)
    for _ in range(300):
        caps = [(rng.randint(1, 4), tuple((rng.randint(-1, 9), rng.uniform(0.5, 2.0), rng.choice((0.0, 1.5)))
                                          for _ in range(rng.randint(1, 3)))) for _ in range(rng.randint(1, 4))]
        held = sum(k * max(0, *(cap for cap, _, _ in modes)) for k, modes in caps)
        least = min(w for _, modes in caps for _, w, _ in modes)
        for b in (rng.uniform(0, 20), rng.uniform(0, 5), math.inf):
            exact = sum(k * max([0] + [cap if b == math.inf else min(cap, math.floor((b - base) / w))
                                       for cap, w, base in modes if cap >= 0 and base <= b]) for k, modes in caps)
            most = most_within(held=held, stages=sum(k for k, _ in caps), per_layer_s=least, time_s=b)
            assert most >= exact and (b < math.inf or most == exact)
    for _ in range(300):
        bounds = [(lo, lo + rng.randint(0, 5)) for lo in (rng.randint(0, 3) for _ in range(rng.randint(2, 4)))]
        n_layers = rng.randint(1, 14)
        spans = sure_spans(bounds, n_layers)
        splits = [t for t in itertools.product(*(range(lo, hi + 1) for lo, hi in bounds)) if sum(t) == n_layers]
        assert (spans is None) == (not splits)
        for t in splits:
            ends = list(itertools.accumulate(t))
            for (a, b), start, end in zip(spans, [0, *ends[:-1]], ends, strict=True):
                assert a >= b or start <= a < b <= end
