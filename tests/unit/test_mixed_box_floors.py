"""The mixed search's box floors evaluated fast give exactly the plain rule's numbers.

`water.capped_level` asks its bisection's question (do the pure groups and the capped pipelines
finish `total` micro-batches by t?) only near the answer it computes from two water levels, and
`Family.bottleneck` is kept by what it reads. Here the plain rule (the bisection asking everywhere,
its start a fresh water level) is written out and compared bit for bit on random inputs, with ties
and integer times where rounding decides; then on every capped level a search asks; and a whole
search's candidates against `memo.reference_path()` (every shortcut off)."""

import math
import random

import pytest
from test_reference_search import instance

import hethub.search.mixed as mixed
from hethub.memo import reference_path
from hethub.predict.water import bisect_time, capped_level, finish_lines, finished_mb, water_level
from hethub.search import hetero
from hethub.search.bounds import PipeFloor
from hethub.search.combine import Group
from hethub.search.templates import Searcher


def plain_capped_level(pure, floor, count, rate, total):
    """water.capped_level's rule, plainly: bisect from the water level, asking done(t) at every step."""
    a, b = floor.base_s, floor.per_mb_s

    def done(t):
        n = finished_mb(pure, t)
        if t > a:
            n += min(count * max(0, math.floor((t - a) / b)), math.floor(rate * (t - a)))
        return n

    lo = water_level([*pure, Group(floor, count)], total)
    hi = a + max(-(-total // count) * b, total / rate) * (1 + 1e-9) + 1e-12
    if pure:
        hi = min(hi, water_level(pure, total) * (1 + 1e-9) + 1e-12)
    if done(lo) >= total:
        return lo
    lo, _ = bisect_time(lambda t: done(t) >= total, lo_s=lo, hi_s=hi, rel_tol=1e-7, max_iter=40)
    return lo


def _fast(pure, floor, count, rate, total):
    lo = water_level([*pure, Group(floor, count)], total)
    return capped_level(pure, finish_lines(pure), floor, count=count, rate=rate, total=total, lo=lo)


@pytest.mark.parametrize("seed", range(6))
def test_capped_level_is_the_plain_bisection(seed):
    rng = random.Random(seed)
    asked = 0
    for _ in range(400):
        whole = rng.random() < 0.4  # integer times: finishes coincide, rounding decides the ties

        def t(lo_s, hi_s, whole=whole):
            return float(rng.randint(int(lo_s) + 1, int(hi_s) + 1)) if whole else rng.uniform(lo_s, hi_s)

        pure = [Group(PipeFloor(base_s=t(0, 20), per_mb_s=t(0.5, 6)), rng.randint(1, 6))
                for _ in range(rng.choice((0, 1, 2, 4)))]
        b = t(0.5, 8)
        count = rng.randint(1, 12)
        rate = count / b * rng.choice((0.1, 0.5, 0.9, 0.999, 1.0)) if rng.random() < 0.8 else rng.uniform(0.01, 3)
        if whole and rng.random() < 0.5:
            rate = 1.0 / rng.randint(1, 4)
        floor = PipeFloor(base_s=t(0, 30), per_mb_s=b)
        total = rng.randint(1, 400)
        want = plain_capped_level(pure, floor, count, rate, total)
        assert _fast(pure, floor, count, rate, total) == want, (pure, floor, count, rate, total)
        with reference_path():
            assert _fast(pure, floor, count, rate, total) == want
        asked += want > water_level([*pure, Group(floor, count)], total)
    assert asked > 50  # the rate cap raised the floor: the bisection ran


@pytest.mark.parametrize("seed", [1, 16])
def test_a_search_asks_the_plain_capped_levels_and_prices_the_reference_candidates(seed, monkeypatch):
    cluster, model, config = instance(seed)
    asked = []
    fast = mixed.capped_level

    def record(pure, lines, floor, *, count, rate, total, lo):
        got = fast(pure, lines, floor, count=count, rate=rate, total=total, lo=lo)
        asked.append((pure, floor, count, rate, total, got))
        return got

    monkeypatch.setattr(mixed, "capped_level", record)

    def candidates():
        s = Searcher(cluster=cluster, model=model, config=config, profiles=None)
        return [(e.step_time_s, e.groups, e.micro_batches) for e in hetero.search(s)]

    got = candidates()
    for pure, floor, count, rate, total, level in asked:
        assert level == plain_capped_level(pure, floor, count, rate, total)
    with reference_path():
        assert candidates() == got
    assert len(asked) > 100 and len(got) > 80  # enough of both to compare
