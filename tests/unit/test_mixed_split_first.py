"""The mixed search finds a split's layer counts before pricing it (`split.layer_splits`) and prices
a split only where one of its counts, at its order's makespan floor plus the sync floor its boundaries
give (`SyncFloors.split_floor`), could still enter the finalists: `combine.estimate` rejects every
other one unpriced, so the search's candidates are the plain path's (every split priced,
`memo.reference_path`), in the same order, for fewer priced splits."""

import dataclasses
import random

import pytest
from test_mixed_pricing_floor import _search
from test_reference_search import instance

from hethub.memo import reference_path
from hethub.search import split
from hethub.search.combine import Group
from hethub.search.split import CostBook, layer_splits, split_layers
from hethub.search.templates import Searcher


# Mixed candidates on each: two or three kinds, 1F1B and GPipe, complete pools.
@pytest.mark.parametrize("seed", [3, 16, 40])
def test_splits_floored_before_pricing_keep_the_plain_candidates(seed):
    cluster, model, config = instance(seed)
    got, priced, _ = _search(cluster, model, config)
    with reference_path():
        plain, plain_priced, _ = _search(cluster, model, config)
    assert got == plain
    assert priced < plain_priced


@pytest.mark.parametrize("seed", [1, 10, 16])
def test_layer_splits_priced_are_split_layers(seed):
    # The counts found first are the priced splits' layers, in order, and whether one recomputes (read off
    # the cheapest option holding each stage's layers) is whether a priced one does: the search decides
    # on the second half (without recomputation) before pricing the first.
    cluster, model, config = instance(seed)
    s = Searcher(cluster=cluster, model=model, config=dataclasses.replace(config, schedule="1f1b")
                 if seed == 1 else config, profiles=None)
    kinds = list(s.counts)
    for mbs in (1, 2):
        for p in range(1, model.num_layers + 3, 5):
            slots = tuple(split.Slot(kinds[i % len(kinds)], s.tps[kinds[i % len(kinds)]][0]) for i in range(p))
            for recompute in (True, False):
                for slacks in ((1.0,), (1.0, 1.5, float("inf"))):
                    laid = layer_splits(s.book, slots, mbs=mbs, allow_recompute=recompute, slacks=slacks)
                    pipes = split_layers(s.book, slots, mbs=mbs, allow_recompute=recompute, slacks=slacks,
                                         hops=s.links.pipe_hops)
                    assert [p.layers for p in pipes] == list(laid.counts)
                    assert laid.recomputes() == any(any(p.recompute) for p in pipes)


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])  # GPipe sizes stages by the in-flight hint
@pytest.mark.parametrize("seed", [3, 10, 16])
def test_kept_positions_and_splits_equal_cold_ones(seed, schedule):
    # layer_splits keeps each stage position's options with their first costs (shared between books of
    # equal stage models) and each split's counts: on random mixed stages, asked after many others, they
    # equal those of a fresh book with nothing kept or shared (the reference path).
    cluster, model, config = instance(seed)
    s = Searcher(cluster=cluster, model=model, config=dataclasses.replace(config, schedule=schedule), profiles=None)
    rng = random.Random(seed)
    kinds = [k for k in s.counts if s.tps[k]]
    asked = []
    for _ in range(15):
        p = rng.randint(1, model.num_layers + 2)
        picks = [rng.choice(kinds) for _ in range(rng.randint(1, 3))]
        slots = tuple(split.Slot(k, rng.choice(s.tps[k])) for k in picks for _ in range(max(1, p // len(picks))))
        for _ in range(4):  # the same stages asked again with other arguments
            args = dict(mbs=rng.choice((1, 2)), allow_recompute=rng.random() < 0.7, in_flight_hint=rng.randint(1, 64),
                        slacks=rng.choice(((1.0,), (1.0, 1.5, float("inf")))))
            asked.append((slots, args, layer_splits(s.book, slots, **args)))
    with reference_path():
        cold = [layer_splits(CostBook(s.job, cluster), slots, **args) for slots, args, _ in asked]
    assert sum(bool(w.counts) for _, _, w in asked) > 10
    for (_, _, warm), plain in zip(asked, cold, strict=True):
        assert warm.counts == plain.counts
        assert [[o[:3] for o in ops] for ops in warm.opts] == [[o[:3] for o in ops] for ops in plain.opts]


def test_whole_estimates_keep_every_pipeline():
    # The mixed search adds only candidates whose every pipeline gets micro-batches (estimate's ``whole``):
    # where a much slower pipeline beside another gets none, it is None, and where both get some, the
    # plain estimate.
    cluster, model, config = instance(16)
    s = Searcher(cluster=cluster, model=model, config=config, profiles=None)
    pipe = next(r.pipe for k in s.counts for r in s.pure(k, 1, share=s.share[k]) if r.rate > 0)
    slow = dataclasses.replace(pipe, fwd_s=tuple(1e3 * x for x in pipe.fwd_s))
    for other, idle in ((slow, True), (pipe, False)):
        groups = [Group(pipe, 1), Group(other, 1)]
        plain = s.estimate(groups, 1)
        assert plain is not None and (len(plain.groups) == 1) == idle
        assert s.estimate(groups, 1, whole=True) == (None if idle else plain)
