"""The mixed search's exact shortcuts against their plain paths (`memo.reference_path`, or the plain
rule written out here): whether a split recomputes, read past each stage's `plain_upto` only
(`split.LayerSplits.recomputes`); the layer greedy on each position's kept cost table (`split._greedy`);
the least layer work summed from each segment's kept hull pieces (`holding.least_layer_work`); the
families and boxes left out of the search's heap where their floor, made part way, cannot enter
(`mixed.price_mixed`)."""

import dataclasses
import heapq
import itertools
import math
import random

import pytest
from test_reference_search import instance

from hethub.memo import reference_path
from hethub.predict import holding
from hethub.search import hetero, mixed, split
from hethub.search.bounds import stage_modes
from hethub.search.split import layer_splits
from hethub.search.templates import Searcher


def _searcher(seed: int, schedule: str | None = None) -> tuple[Searcher, random.Random, list[str]]:
    """A searcher on random instance ``seed`` (under ``schedule`` if given), a generator seeded alike and
    the kinds that have a TP degree."""
    cluster, model, config = instance(seed)
    config = dataclasses.replace(config, schedule=schedule) if schedule else config
    s = Searcher(cluster=cluster, model=model, config=config, profiles=None)
    return s, random.Random(seed), [k for k in s.counts if s.tps[k]]


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1", "gpipe"])
@pytest.mark.parametrize("seed", [1, 3, 10, 16, 40])
def test_recomputes_equals_the_plain_walk(seed, schedule):
    # On random mixed stages and layer counts: no stage's cheapest option recomputes at any count up
    # to its plain_upto, and recomputes() is the plain path's (every stage's cheapest option walked).
    s, rng, kinds = _searcher(seed, schedule)
    skipped = 0
    for _ in range(25):
        p = rng.randint(1, s.model.num_layers + 2)
        picks = [rng.choice(kinds) for _ in range(rng.randint(1, 3))]
        slots = tuple(split.Slot(k, rng.choice(s.tps[k])) for k in picks for _ in range(max(1, p // len(picks))))
        laid = layer_splits(s.book, slots, mbs=rng.choice((1, 2)), allow_recompute=True,
                            in_flight_hint=rng.randint(1, 64), slacks=rng.choice(((1.0,), (1.0, 1.5, float("inf")))))
        for ops, up in zip(laid.opts, laid.plain_upto, strict=True):
            assert all(not split._cheapest(ops, k).sm.recompute for k in range(up + 1))
        # Varied counts too (the splits' own and random ones within each stage's options).
        counts = [*laid.counts, *(tuple(rng.randint(0, max(o.max_layers for o in ops)) for ops in laid.opts)
                                  for _ in range(3) if laid.opts)]
        for c in counts:
            one = dataclasses.replace(laid, counts=(c,))
            got = one.recomputes()
            with reference_path():
                plain = one.recomputes()
            assert got == plain == any(split._cheapest(ops, k).sm.recompute for ops, k in zip(one.opts, c, strict=True))
            skipped += any(k <= up for k, up in zip(c, one.plain_upto, strict=True))
    assert skipped  # the shortcut was taken


def _plain_greedy(opts, lows, n_layers, *, marginal, cap):
    """split._greedy as it was written first: each next cost walked off the stage's options, one pop
    and one push per layer."""
    counts, costs = list(lows), [split._cost(ops, k) for ops, k in zip(opts, lows, strict=True)]
    heap = []
    for s, (ops, k) in enumerate(zip(opts, lows, strict=True)):
        cur, nxt = split._cost(ops, k), split._cost(ops, k + 1)
        if nxt <= cap:
            heap.append((nxt - cur, 0.0, s, nxt) if marginal else (nxt, -cur, s, nxt))
    heapq.heapify(heap)
    for _ in range(n_layers - sum(counts)):
        if not heap:
            return None, math.inf
        _, _, s, cur = heapq.heappop(heap)
        counts[s] += 1
        costs[s] = cur
        nxt = split._cost(opts[s], counts[s] + 1)
        if nxt <= cap:
            heapq.heappush(heap, (nxt - cur, 0.0, s, nxt) if marginal else (nxt, -cur, s, nxt))
    return counts, max(costs)


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1", "gpipe"])
@pytest.mark.parametrize("seed", [1, 3, 10, 16, 40])
def test_greedy_on_kept_costs_equals_the_options_walk(seed, schedule):
    # The greedy reads each stage's cost off its position's table (heapreplace for pop and push): on
    # random mixed stages, random lows and caps, the same counts and bottleneck as the options walked.
    s, rng, kinds = _searcher(seed, schedule)
    n_layers, compared = s.model.num_layers, 0
    for _ in range(25):
        p = rng.randint(1, n_layers + 2)
        picks = [rng.choice(kinds) for _ in range(rng.randint(1, 3))]
        slots = tuple(split.Slot(k, rng.choice(s.tps[k])) for k in picks for _ in range(max(1, p // len(picks))))
        laid = layer_splits(s.book, slots, mbs=rng.choice((1, 2)), allow_recompute=rng.random() < 0.7,
                            in_flight_hint=rng.randint(1, 64))
        if not laid.opts:
            continue
        positions = [pos for pos in s.book.cache(split._POSITIONS).values()]
        tables = {id(pos.opts): pos.costs for pos in positions}
        costs = [tables[id(ops)] for ops in laid.opts]
        for _ in range(4):
            lows = [rng.randint(0, min(2, max(o.max_layers for o in ops))) for ops in laid.opts]
            plain = _plain_greedy(laid.opts, lows, n_layers, marginal=False, cap=math.inf)
            assert split._greedy(costs, lows, n_layers, marginal=False, cap=math.inf) == plain
            if plain[0] is not None:
                for slack in (1.0, 1.5, rng.uniform(1.0, 3.0), math.inf):
                    cap = plain[1] * slack * (1 + 1e-12)
                    assert split._greedy(costs, lows, n_layers, marginal=True, cap=cap) == \
                        _plain_greedy(laid.opts, lows, n_layers, marginal=True, cap=cap)
                    compared += 1
    assert compared


@pytest.mark.parametrize("seed", [1, 3, 10, 16, 40])
def test_least_layer_work_of_kept_segment_pieces_equals_the_plain_sum(seed):
    # pipe_floor keeps each segment's hull pieces (bounds.segment_memory) and sums a pipeline's from
    # them: on random stage modes in random segments, exactly the sum over all its groups' hulls at once.
    s, rng, kinds = _searcher(seed)
    for _ in range(200):
        segments = []
        for _ in range(rng.randint(1, 3)):
            groups = []
            for _ in range(rng.randint(1, 6)):
                modes = stage_modes(s.book, rng.choice(kinds), rng.choice((1, 2, 4, 8)), rng.choice((1, 2)),
                                    rng.random() < 0.2, rng.random() < 0.2, rng.randint(1, 80))
                groups.append((rng.randint(1, 9), modes[:rng.choice((1, 6))]))
            segments.append(groups)
        n_layers = rng.randint(1, 3 * s.model.num_layers)
        kept = [piece for groups in segments for piece in holding.hull_pieces(groups)]
        assert holding.least_layer_work(kept, n_layers) == holding.least_layer_work(
            holding.hull_pieces([g for groups in segments for g in groups]), n_layers)


@pytest.mark.parametrize("seed", [1, 3, 10, 16, 40])
def test_smallest_holding_of_undominated_modes_equals_all_modes(seed):
    # The floors keep each group's undominated modes for smallest_holding (bounds.segment_memory,
    # mixed.Family._held_modes): on random stage modes, counts, layers and starting bottlenecks, exactly
    # the answer over all the modes.
    s, rng, kinds = _searcher(seed)
    dropped = 0
    for _ in range(300):
        caps = []
        for _ in range(rng.randint(1, 12)):
            modes = stage_modes(s.book, rng.choice(kinds), rng.choice((1, 2, 4, 8)), rng.choice((1, 2)),
                                rng.random() < 0.3, rng.random() < 0.3, rng.randint(1, 80))
            if rng.random() < 0.3:  # as Family._held_modes has them: bases 0, capacities at least 0
                modes = tuple((max(c, 0), w, 0.0) for c, w, _ in modes)
            caps.append((rng.randint(1, 9), modes[:rng.choice((1, 3, 6))]))
        kept = [(k, holding.undominated(modes)) for k, modes in caps]
        dropped += sum(len(m) for _, m in caps) - sum(len(m) for _, m in kept)
        n_layers = rng.randint(1, 2 * s.model.num_layers)
        top = max((b + w * n_layers for _, modes in caps for c, w, b in modes), default=1.0)
        for lo in (0.0, rng.uniform(0, top), rng.uniform(0, top / 4), top):
            assert holding.smallest_holding(kept, n_layers, lo) == holding.smallest_holding(caps, n_layers, lo)
    assert dropped


def _recorded_items(s, monkeypatch):
    """Every candidate the search of ``s`` prices, in the order it adds them to its results."""
    made = []

    class Recorded(hetero.Results):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            made.append(self)

    monkeypatch.setattr(hetero, "Results", Recorded)
    hetero.search(s)
    return [[(e.step_time_s, e.groups, e.micro_batches) for e in r.items] for r in made]


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1", "gpipe"])
@pytest.mark.parametrize("seed", [3, 16, 40])
def test_entries_that_cannot_enter_are_left_out_with_the_same_candidates(seed, schedule, monkeypatch):
    # price_mixed leaves out a family or box whose floor, made part way (its water level, then with the
    # embedding sync), cannot enter when it is made: the search prices the same candidates in the same
    # order as with every floor made whole and pushed (the plain path: `enters` ignored).
    fast = {name: getattr(mixed, name) for name in ("_box_level", "_rate_level", "_boxes_level")}
    left = []

    def counted(name):
        def level(*a, enters=None, **k):
            got = fast[name](*a, enters=enters, **k)
            if got is None and enters is not None and fast[name](*a, **k) is not None:
                left.append(name)
            return got
        return level

    for name in fast:
        monkeypatch.setattr(mixed, name, counted(name))
    got = _recorded_items(_searcher(seed, schedule)[0], monkeypatch)
    for name in fast:
        monkeypatch.setattr(mixed, name, lambda *a, enters=None, name=name, **k: fast[name](*a, **k))
    assert _recorded_items(_searcher(seed, schedule)[0], monkeypatch) == got
    assert left  # some entry was left out


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1", "gpipe"])
@pytest.mark.parametrize("seed", [1, 3, 10, 16, 40])
def test_families_share_each_kinds_held_modes_and_runs(seed, schedule):
    # The families' held modes and runs of them are kept per kind, TP degree and micro-batch size, one for
    # every family holding the kind there: each family reads the plain rule on its own modes, in any order.
    s, rng, _ = _searcher(seed, schedule)
    fams = [fam for mbs in (1, 2) for fam, _ in mixed.families(s, dict(s.counts), mbs)]
    assert len({(f.subset[i], f.tps[i]) for f in fams for i in range(len(f.subset))}) > len(s.counts)  # TPs differ
    for fam in rng.sample(fams, min(30, len(fams))):
        for i in range(len(fam.subset)):
            def plain(f, fam=fam, i=i):
                return holding.undominated(tuple((max(c, 0), w, 0.0) for c, w in fam.modes(i, f)))

            lo = rng.randint(1, 30)
            hi = lo + rng.randint(0, 30)
            for f in rng.sample(range(1, 64), 5):
                assert fam._held_modes(i, f) == plain(f)
            runs = [(ms, sum(1 for _ in run)) for ms, run in itertools.groupby(plain(f) for f in range(lo, hi + 1))]
            assert fam._held_runs(i, lo, hi) == runs
