"""The kind-alone search orders micro-batch sizes by upper bounds of their best rate that it tightens only
below the next size's (`Searcher.top_above`), so a size whose exact bound is not needed to place it is never
bounded exactly: `top_above` is the plain largest exact bound where that is above its threshold and an upper
bound on it below the threshold elsewhere, and `hetero._alone_all_sizes` runs the same sizes in the same order
with the same answers as on the reference path (hethub.memo), where every size is keyed by its top rate."""

from __future__ import annotations

import functools
import random
import sys
from pathlib import Path

import pytest

import hethub.search.hetero as hetero
from hethub.memo import Tiers, reference_path
from hethub.search import PlannerConfig
from hethub.search.bounds import BLIND
from hethub.search.hetero import Results, _alone_all_sizes, plan_key
from hethub.search.planner import SHARD_HOLDERS_OPTIMISM
from hethub.search.templates import Searcher
from hethub.spec.model import ModelSpec, get_model

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import planner_scale

_ALONE = hetero._alone

@functools.cache
def _model(name: str) -> ModelSpec:
    return get_model(name)  # one object per name: books of one job share stage models by its id


def _searcher(devices: int, schedule: str, *, kind: str) -> Searcher:
    """The enumeration's searcher of one kind alone (`variants._alone`): ZeRO-1 at the loosest memory."""
    cluster, model, global_batch, seq_len = planner_scale.case(devices)
    config = PlannerConfig(global_batch=global_batch, seq_len=seq_len, schedule=schedule, optimizer_sharding="zero1",
                           shard_holders=SHARD_HOLDERS_OPTIMISM * devices)
    return Searcher(cluster=cluster, model=_model(model), profiles=None, kinds=(kind,), config=config)


@pytest.mark.parametrize(("devices", "schedule"), [(128, "1f1b"), (128, "zb-h1"), (512, "zb-h1")])
def test_top_above_is_the_top_bound_or_below_its_threshold(devices, schedule):
    # Thresholds in a random order on one searcher (each call goes on from the last's tightened bounds): a sure
    # answer is the plain rule's largest exact bound, an unsure one an upper bound on it below the threshold.
    rng = random.Random(devices)
    for kind in planner_scale.case(devices)[0].kind_names:
        s = _searcher(devices, schedule, kind=kind)
        for mbs in s.config.usable_micro_batch_sizes:
            shapes = s._shapes(kind)
            plain = max([s._bound(kind, tp, mbs, p, 1.0) for tp, p in shapes] + [0.0]) * (1 + 1e-9)
            loose = max([s._bound(kind, tp, mbs, p, 1.0, loose=BLIND) for tp, p in shapes] + [0.0])
            aboves = [0.0, plain, plain * (1 - 1e-12), plain * (1 + 1e-12), loose, loose * 1.1,
                      *(rng.uniform(plain * 0.5, loose) for _ in range(6))]
            rng.shuffle(aboves)
            t = _searcher(devices, schedule, kind=kind)  # cold: only what the thresholds ask is tightened
            for above in aboves:
                bound, sure = t.top_above(kind, mbs, share=1.0, above=above)
                assert bound == plain if sure else plain <= bound < above
            assert t.top_bound(kind, mbs, share=1.0) == plain


def _alone_sizes(devices: int, schedule: str, *, kind: str, monkeypatch) -> tuple:
    """`_alone_all_sizes`' answer, the plans it priced and the sizes it ran `_alone` on, in order."""
    ran = []

    def recorded(s, results, kind, mbs):
        ran.append(mbs)
        return _ALONE(s, results, kind, mbs)

    monkeypatch.setattr(hetero, "_alone", recorded)
    s = _searcher(devices, schedule, kind=kind)
    results = Results(4, fits=s.fits)
    best = _alone_all_sizes(s, results, kind)
    return plan_key(best) if best else None, [plan_key(e) for e in results.ranked()], ran


@pytest.mark.parametrize(("devices", "schedule"), [(128, "1f1b"), (512, "1f1b"),
                                                   pytest.param(512, "zb-h1", marks=pytest.mark.slow)])
def test_alone_runs_the_sizes_of_the_plain_order(devices, schedule, monkeypatch):
    # The reference path keys every size by its top rate (a full scan each); the shortcut's keys are upper
    # bounds tightened only below the next one, which leaves some exact bounds unread (bench 512 devices: the
    # larger sizes' H100 and MI300X bounds) and must not change which sizes run, in which order, nor their plans.
    tightened = []
    top_above = Searcher.top_above

    def counted(self, kind, mbs, *, share, above):
        got = top_above(self, kind, mbs, share=share, above=above)  # the method itself, not a patched one
        tightened.append(got[1])
        return got

    for kind in planner_scale.case(devices)[0].kind_names:
        with reference_path():
            want = _alone_sizes(devices, schedule, kind=kind, monkeypatch=monkeypatch)
        monkeypatch.setattr(Searcher, "top_above", counted)
        assert _alone_sizes(devices, schedule, kind=kind, monkeypatch=monkeypatch) == want
        monkeypatch.undo()
    assert devices < 512 or not all(tightened)  # some size placed by a bound below the next, its own unread


def test_tiers_give_the_plain_order_of_the_exact_bounds():
    # memo.Tiers on random bounds (each tier at least the next, ties included): `top` is the largest exact bound
    # where that is above the threshold, else an upper bound on it below the threshold; `pop` takes the items
    # out in the order of their exact bounds (ties: the given order), reading only what that needs.
    rng = random.Random(7)
    for _ in range(200):
        n = rng.randint(0, 12)
        exact = [rng.choice([0.0, 1.0, 2.0, rng.random() * 3]) for _ in range(n)]
        tiers = [[e, e + rng.choice([0.0, rng.random()])] for e in exact]
        for t in tiers:
            t.append(t[1] + rng.choice([0.0, rng.random()]))
        read: list[tuple[int, int]] = []

        def bound(i: int, tier: int, tiers=tiers, read=read) -> float:
            read.append((i, tier))
            return tiers[i][tier]

        plain = max(exact, default=0.0)
        order = Tiers(list(range(n)), bound, loosest=2)
        for above in sorted((rng.random() * 4 for _ in range(3)), key=lambda _: rng.random()):
            got, sure = order.top(above=above, bound=bound)
            assert got == plain if sure else plain <= got < above
        assert order.top(above=0.0, bound=bound) == (plain, True)
        popped = []
        while (got := order.pop(lambda upper: False, bound=bound)) is not None:
            popped.append(got)
        assert popped == sorted(((exact[i], i) for i in range(n)), key=lambda x: (-x[0], x[1]))
        assert len(read) == len(set(read))  # each bound read once
