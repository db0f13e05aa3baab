"""`scoring.score_plans`' floor order (``in_floor_order``: every plan taken first, then screened and
predicted by its tight floor, least first) keeps exact what the plain order (each plan screened and
predicted as it comes) keeps: the first ``keep`` plans with their predictions, ties in the given order,
the steps the screen shares with later calls, each ``Firsts``' bar for every plan and the first plan of
each of its first keys in the list; on the planner's candidates of a job where memory binds (some over
it), in random orders with copies of plans (ties), random keeps and firsts, against the plain order and
against the reference path; and it predicts no more plans than the plain order."""

from __future__ import annotations

import copy
import itertools
import random

import pytest

from conftest import laid_out_layouts
from hethub.memo import reference_path
from hethub.predict import scoring
from hethub.predict.scoring import Firsts, Screen, score_plans
from hethub.predict.stage_modes import choose_recompute


@pytest.fixture(scope="module")
def candidates():
    """The default search's layouts of llama-2-7b on a100-v100-32 in their chosen modes (distinct)."""
    mp = pytest.MonkeyPatch()
    try:
        laid = laid_out_layouts(mp, global_batch=64)
    finally:
        mp.undo()
    plans = {id(p): choose_recompute(p, **k) for p, k in laid}
    return list({p.to_json(): p for p in plans.values()}.values())


def _shape(plan) -> tuple:
    return tuple(sorted((len(p.stages), p.micro_batch_size) for p in plan.pipelines))


def _firsts(rng: random.Random) -> tuple[Firsts, ...]:
    return tuple(Firsts(rng.randint(1, 3), rng.choice([None, _shape])) for _ in range(rng.randint(0, 2)))


def _kept(plans, scored, screen: Screen, n_own: int) -> tuple:
    """What readers of a screened scoring read: its first plans (``keep`` and the own firsts' count),
    the screen's shared steps, each firsts' bar for every plan, and the first plan of each of a keyed
    firsts' first keys as the list gives them."""
    firsts = []
    for f in screen.firsts:
        bars = [f.bar(p) for p in plans]
        walk, keys = [], set()
        for p, r in scored:
            if f.key is not None and len(keys) < f.n and f.key(p) not in keys:
                keys.add(f.key(p))
                walk.append((id(p), r.step_time_s))
        firsts.append((bars, walk))
    head = [(id(p), r.step_time_s, r.tokens_per_s, r.fits_memory) for p, r in scored[:max(screen.keep, n_own)]]
    place = {id(p): i for i, p in enumerate(plans)}
    assert all(a[1] < b[1] or place[a[0]] < place[b[0]] for a, b in itertools.pairwise(head))  # ties: given order
    return head, list(screen.steps), firsts


def _score(plans, *, keep: int, firsts_seed: int, ordered: bool, counted: list) -> tuple:
    screen = Screen(keep, None, [], _firsts(random.Random(firsts_seed)))
    own = max([f.n for f in screen.firsts if f.key is None], default=0)
    plain = scoring.predict
    scoring.predict = lambda plan, **k: counted.append(1) or plain(plan, **k)
    try:
        scored = score_plans(plans, None, screen=screen, in_floor_order=ordered)
    finally:
        scoring.predict = plain
    return _kept(plans, scored, screen, own)


@pytest.mark.parametrize("seed", range(4))
def test_floor_order_keeps_what_the_plain_order_keeps(candidates, seed):
    rng = random.Random(seed)
    assert len(candidates) > 8
    fewer = 0
    for trial in range(12):
        plans = rng.sample(candidates, rng.randint(1, min(len(candidates), 14)))
        plans += [copy.copy(p) for p in rng.sample(plans, rng.randint(0, min(3, len(plans))))]  # ties
        rng.shuffle(plans)
        keep, firsts_seed = rng.randint(1, 4), rng.randrange(10**6)
        plain, ordered = [], []
        want = _score(plans, keep=keep, firsts_seed=firsts_seed, ordered=False, counted=plain)
        assert _score(plans, keep=keep, firsts_seed=firsts_seed, ordered=True, counted=ordered) == want, trial
        assert len(ordered) <= len(plain)
        fewer += len(ordered) < len(plain)
    assert fewer  # the order saves predictions somewhere


def test_floor_order_keeps_what_the_reference_path_keeps(candidates):
    rng = random.Random(11)
    for _ in range(3):
        plans = rng.sample(candidates, min(len(candidates), 10))
        plans += [copy.copy(p) for p in plans[:2]]
        keep, firsts_seed = rng.randint(1, 3), rng.randrange(10**6)
        with reference_path():
            want = _score(plans, keep=keep, firsts_seed=firsts_seed, ordered=True, counted=[])
        assert _score(plans, keep=keep, firsts_seed=firsts_seed, ordered=True, counted=[]) == want
