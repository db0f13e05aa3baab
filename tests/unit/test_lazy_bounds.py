"""The template scan's lazy rate bounds give the plain scan's answers: the loose bounds
(`bounds.rate_bound(loose=GRID)`, capacities at fewer in-flight counts; BLIND, memory ignored) are
above the exact one, so the seeds computed in
its order (`Searcher.seeds`) are the top of every exact bound, and the micro-batch sizes the bound
rules out unscanned (`hetero._promising_mbs`, `hetero._alone_all_sizes`) are those the full scan
drops; on the reference path (hethub.memo) every bound is exact and every size scanned."""

from __future__ import annotations

import functools
import itertools
import sys
from pathlib import Path

import pytest

import hethub.search.bounds as bounds
from hethub.memo import reference_path
from hethub.search import PlannerConfig
from hethub.search.hetero import (
    Results,
    _aligned_groups,
    _alone,
    _alone_all_sizes,
    _promising_mbs,
    _top_distinct,
    plan_key,
)
from hethub.search.templates import TOP_PER_KIND, Searcher
from hethub.spec.cluster import parse_cluster
from hethub.spec.model import ModelSpec, get_model

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import planner_scale

KINDS = ("h100-sxm", "a100-80gb", "v100-16gb")
CASES = [("llama-2-70b", "1f1b"), ("llama-2-13b", "zb-h1")]


CLUSTER = parse_cluster({"name": "three", "group": [{"kind": k, "nodes": 4, "devices_per_node": 8} for k in KINDS]},
                        where="test")  # 96 devices: the scans prune


def _searcher(model: str, schedule: str, *, kinds: tuple[str, ...] | None = None) -> Searcher:
    return Searcher(cluster=CLUSTER, model=_model(model), profiles=None, kinds=kinds,
                    config=PlannerConfig(global_batch=256, seq_len=4096, schedule=schedule))


@functools.cache
def _model(name: str) -> ModelSpec:
    return get_model(name)  # one object per name: books of one job share stage models by its id


def _stage_counts(s: Searcher, kind: str) -> list[tuple[int, int]]:
    return [(tp, p) for tp in s.tps[kind] for p in range(1, min(s.counts[kind] // tp, s.model.num_layers + 2) + 1)]


@pytest.mark.parametrize(("model", "schedule"), CASES)
def test_loose_bound_is_above_the_bound_and_seeds_are_the_top_bounds(model, schedule):
    s = _searcher(model, schedule)
    for kind, mbs in itertools.product(s.counts, s.config.usable_micro_batch_sizes):
        share = s.share[kind]
        exact = [(s._bound(kind, tp, mbs, p, share), tp, p) for tp, p in _stage_counts(s, kind)]
        for b, tp, p in exact:
            assert s._bound(kind, tp, mbs, p, share, loose=bounds.GRID) >= b
            assert s._bound(kind, tp, mbs, p, share, loose=bounds.BLIND) >= b
        plain = sorted(exact, key=lambda x: -x[0])[:TOP_PER_KIND]  # the plain rule: every bound, sorted
        assert s.seeds(kind, mbs, share=share) == [x for x in plain if x[0] > 0]
        t = _searcher(model, schedule)  # cold: `top_bound` reads the bounds best first, not every seed's
        top = max([b for b, _, _ in plain if b > 0] + [0.0]) * (1 + 1e-9)
        assert t.top_bound(kind, mbs, share=share) == top <= t.top_bound(kind, mbs, share=share, loose=True)


def _sizes_and_alone(model: str, schedule: str) -> tuple:
    s = _searcher(model, schedule)
    promising = _promising_mbs(s)
    alone = []
    for kind in s.counts:
        k = _searcher(model, schedule, kinds=(kind,))
        results = Results(4, fits=k.fits)
        best = _alone_all_sizes(k, results, kind)
        alone.append((plan_key(best) if best else None, [plan_key(e) for e in results.ranked()],
                      len({key[1] for key in k._pure})))
    return promising, len({key[1] for key in s._pure}), alone


@pytest.mark.slow
@pytest.mark.parametrize(("model", "schedule"), CASES)
def test_sizes_the_bound_rules_out_are_those_the_full_scan_drops(model, schedule):
    with reference_path():
        want, want_scanned, want_alone = _sizes_and_alone(model, schedule)
    got, scanned, alone = _sizes_and_alone(model, schedule)
    assert got == want
    assert [a[:2] for a in alone] == [a[:2] for a in want_alone]
    assert scanned <= want_scanned and all(a[2] <= b[2] for a, b in zip(alone, want_alone, strict=True))


@pytest.mark.parametrize("tier", [bounds.BLIND, bounds.GRID])
def test_a_loose_bound_below_the_bound_would_change_the_seeds(monkeypatch, tier):
    # The comparison above can fail: a "loose" bound that is not above the exact one reorders the seeds
    # (BLIND, their order) or drops one (GRID, which passes over a candidate below the third best).
    s = _searcher(*CASES[0])
    kind, mbs = "h100-sxm", 1
    want = s.seeds(kind, mbs, share=1.0)
    rate_bound = bounds.rate_bound

    def low(*args, loose: int = bounds.EXACT, **kw) -> float:
        b = rate_bound(*args, loose=loose, **kw)
        return b * (0.5 if loose == tier and (tier == bounds.GRID or kw["p"] == want[0][2]) else 1.0)

    monkeypatch.setattr("hethub.search.templates.rate_bound", low)
    t = _searcher(*CASES[0])
    assert t.seeds(kind, mbs, share=1.0) != want


def _bounds_after_the_other_schedule(model: str) -> tuple[list[float], bool]:
    """ZB-H1's exact rate bounds, on a book whose stage models equal a 1F1B book's that bounded first
    (its shared caches, `split.Cache.shared`, warm); whether the two books share their stage modes."""
    first, s = _searcher(model, "1f1b"), _searcher(model, "zb-h1")
    out = []
    for t in (first, s):
        out = [t._bound(kind, tp, mbs, p, t.share[kind]) for kind in t.counts
               for mbs in t.config.usable_micro_batch_sizes[:2] for tp, p in _stage_counts(t, kind)]
    return out, first.book.cache(bounds._STAGE_MODES) is s.book.cache(bounds._STAGE_MODES)


@pytest.mark.parametrize("shared_capacity", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_books_of_equal_stage_models_share_schedule_free_caches(monkeypatch, shared_capacity):
    # With the capacities (which read the schedule's in-flight bound) wrongly marked shared, the bounds
    # differ from the plain ones: the comparison can fail.
    with reference_path():
        want, shared = _bounds_after_the_other_schedule("llama-2-70b")
    assert not shared
    monkeypatch.setattr(bounds._CAPACITY, "shared", shared_capacity)
    got, shared = _bounds_after_the_other_schedule("llama-2-70b")
    assert shared
    assert (got == want) != shared_capacity


@pytest.mark.parametrize(("model", "schedule"), CASES)
def test_skipped_bounds_read_lazily_are_the_plain_ones(model, schedule):
    # `Searcher.skipped(above=...)` and `top_skipped` compute a skipped stage count's bound only where
    # its loose one is above the threshold; the answers are the plain rule's over every exact bound.
    for kind in KINDS:
        s = _searcher(model, schedule)
        mbs, share = 2, s.share[kind]
        s.pure(kind, mbs, share=share)
        with reference_path():
            t = _searcher(model, schedule)
            plain = t.skipped(kind, mbs, share=share)
        assert s.skipped(kind, mbs, share=share) == plain
        for above in sorted({0.0, *(b for _, _, b in plain)})[::3]:
            def want(tp, p):
                return (tp * p) % 3 != 1
            fits = [(b, tp, p) for tp, p, b in plain if b > above and want(tp, p)]
            s = _searcher(model, schedule)
            assert s.top_skipped(kind, mbs, share=share, above=above, want=want) == (max(fits) if fits else None)
            assert s.skipped(kind, mbs, share=share, above=above, want=want) == [(tp, p, b) for b, tp, p in fits]


def test_alone_reads_skipped_bounds_lazily_and_keeps_the_plain_answer():
    # `_alone` keys a skipped stage count by its loose bound until its turn (bench 512 devices' A100s at
    # micro-batch 2 split some): the same plan, rate and priced candidates as on the reference path.
    cluster, model, global_batch, seq_len = planner_scale.case(512)

    def alone() -> tuple:
        s = Searcher(cluster=cluster, model=_model(model), profiles=None, kinds=("a100-80gb",),
                     config=PlannerConfig(global_batch=global_batch, seq_len=seq_len, schedule="zb-h1"))
        results = Results(4, fits=s.fits)
        found, best = _alone(s, results, "a100-80gb", 2)
        return plan_key(found), best, [plan_key(e) for e in results.ranked()]

    with reference_path():
        want = alone()
    assert alone() == want


@pytest.mark.parametrize("case", [*CASES, (128, "zb-h1")])
def test_best_rate_is_the_scans_where_it_reaches_the_bar(case):
    # `Searcher.best_rate` reads bounds and splits stage shapes best bound first, only while one could reach the
    # bar and beat the best rate found; its answer is the plain rule's: the scan's best rate where it is at
    # least the bar, else None. bench's 128 devices hold kinds whose best template is not of the stage shape
    # of highest bound (the stop must wait for the best rate to pass every bound left).
    if isinstance(case[0], int):
        cluster, model, global_batch, seq_len = planner_scale.case(case[0])
    else:
        (model, _), cluster, global_batch, seq_len = case, CLUSTER, 256, 4096

    def searcher() -> Searcher:
        return Searcher(cluster=cluster, model=_model(model), profiles=None,
                        config=PlannerConfig(global_batch=global_batch, seq_len=seq_len, schedule=case[1]))

    s = searcher()
    for kind, mbs in itertools.product(s.counts, (1, 2, 4)):
        for share in (s.share[kind], 1.0):
            top = max([s._bound(kind, tp, mbs, p, share) for tp, p in _stage_counts(s, kind)] + [0.0])
            rate = max((r.rate for r in s.pure(kind, mbs, share=share)), default=0.0)
            bars = [0.0, *(rate * f for f in (0.5, 1 - 1e-12, 1.0, 1 + 1e-12)), top * 1.2]
            t = searcher()  # nothing scanned before: each answer from the bounds and the splits it reads
            assert [t.best_rate(kind, mbs, share=share, bar=bar) for bar in bars] == [
                rate if rate >= bar else None for bar in bars]
            assert (kind, mbs, share) not in t._pure


PROMISING = [  # (kinds with nodes of 8, model, schedule): sizes whose kinds rule one another in or out
    ((("a100-80gb", 3), ("v100-16gb", 2), ("h100-sxm", 1)), "llama-2-7b", "zb-h1"),  # V100s unscanned at 2
    ((("h100-sxm", 2), ("a100-80gb", 2), ("v100-16gb", 4)), "llama-2-7b", "1f1b"),  # A100s alone scanned at 4
    ((("h100-sxm", 2), ("v100-16gb", 6)), "llama-2-13b", "1f1b"),
]


@pytest.mark.parametrize(("groups", "model", "schedule"), PROMISING)
def test_promising_sizes_scan_a_kind_only_where_its_bound_reaches(groups, model, schedule):
    # `_promising_mbs` finds a kind's best rate at a size (`Searcher.best_rate`) only where its best rate bound
    # reaches MBS_KEEP of its rate at an earlier size; the sizes kept are the full scan's (reference path: every
    # size scanned), and only the sizes kept are scanned in full (by their search, not here).
    cluster = parse_cluster({"name": "mix", "group": [{"kind": k, "nodes": n, "devices_per_node": 8}
                                                      for k, n in groups]}, where="test")

    def sizes() -> tuple[list[int], set]:
        s = Searcher(cluster=cluster, model=_model(model), profiles=None,
                     config=PlannerConfig(global_batch=512, seq_len=4096, schedule=schedule))
        return _promising_mbs(s), set(s._pure)

    with reference_path():
        want, _ = sizes()
    got, scanned = sizes()
    assert got == want
    assert not scanned


def _plain_aligned(s: Searcher, ranked: dict, mbs: int) -> list:
    """`hetero._aligned_groups` after the plain rule's completions: every skipped shape of each stage count the
    kinds' top templates have whose bound is above its kind's second best rate of that count as scanned."""
    for p in sorted({len(r.pipe.slots) for k in s.counts for r in _top_distinct(ranked[k], TOP_PER_KIND)}):
        for k in s.counts:
            rates = [r.rate for r in ranked[k] if len(r.pipe.slots) == p and r.rate > 0][:2]
            s.complete(k, mbs, share=s.share[k], want=lambda tp, p_, p=p: p_ == p,
                       above=rates[1] if len(rates) == 2 else 0.0)
    return _aligned_groups(s, ranked, mbs)  # no shape left above those bars: it splits nothing more


@pytest.mark.parametrize("case", [*CASES, (128, "zb-h1"), (128, "1f1b")])
def test_aligned_groups_split_best_bound_first_as_the_plain_rule(case):
    # `_aligned_groups` splits a kind's skipped shapes of a stage count best rate bound first, only while one
    # could beat the second best template of that count; its groups are those of splitting every shape above
    # the second best as first scanned.
    if isinstance(case[0], int):
        cluster, model, global_batch, seq_len = planner_scale.case(case[0])
    else:
        (model, _), cluster, global_batch, seq_len = case, CLUSTER, 256, 4096

    def aligned(mbs: int, rule) -> list:
        s = Searcher(cluster=cluster, model=_model(model), profiles=None,
                     config=PlannerConfig(global_batch=global_batch, seq_len=seq_len, schedule=case[1]))
        ranked = {k: s.pure(k, mbs, share=s.share[k]) for k in s.counts}
        return [[(g.pipe.slots, g.pipe.layers, g.pipe.recompute, g.count) for g in groups]
                for groups in rule(s, ranked, mbs)]

    for mbs in (1, 2):
        assert aligned(mbs, _aligned_groups) == aligned(mbs, _plain_aligned)
