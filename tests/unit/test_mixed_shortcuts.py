"""The mixed search's exact shortcuts against their plain paths (`memo.reference_path`): whether a
split recomputes, read past each stage's `plain_upto` only (`split.LayerSplits.recomputes`)."""

import dataclasses
import random

import pytest
from test_reference_search import instance

from hethub.memo import reference_path
from hethub.search import split
from hethub.search.split import layer_splits
from hethub.search.templates import Searcher


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1", "gpipe"])
@pytest.mark.parametrize("seed", [1, 3, 10, 16, 40])
def test_recomputes_equals_the_plain_walk(seed, schedule):
    # On random mixed stages and layer counts: no stage's cheapest option recomputes at any count up
    # to its plain_upto, and recomputes() is the plain path's (every stage's cheapest option walked).
    cluster, model, config = instance(seed)
    s = Searcher(cluster=cluster, model=model, config=dataclasses.replace(config, schedule=schedule), profiles=None)
    rng = random.Random(seed)
    kinds = [k for k in s.counts if s.tps[k]]
    skipped = 0
    for _ in range(25):
        p = rng.randint(1, model.num_layers + 2)
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
