"""The refinement's one fan-out (`planner._refined`): the chunkings of the 1F1B starts as they stand
before the polish run beside it, and only those of starts the polish changed run after it, so the
plans are those of polishing first and then chunking the best 1F1B plans."""

import copy
from types import SimpleNamespace

import pytest

from hethub.search import planner

ONE = planner.ONE_F_ONE_B


def _plan(name: str, schedule: str, devices: int, *, v: int = 1):
    stage = SimpleNamespace(kind="k", devices=tuple(range(devices)))
    return SimpleNamespace(name=name, schedule=schedule, zero_stage=1,
                           pipelines=(SimpleNamespace(stages=(stage,), virtual_stages=v),))


def _cand(name: str, schedule: str, devices: int, step_s: float):
    return _plan(name, schedule, devices), SimpleNamespace(step_time_s=step_s)


@pytest.fixture
def calls(monkeypatch):
    """Serial fan-outs; a polish that turns its second start (the 1F1B plan B) into another 1F1B plan
    B' and keeps the others (the third as an equal copy, as from a worker); a chunking that pays
    (v 2, 10 % faster) on B' and E only. Calls logged."""
    monkeypatch.setenv("HETHUB_PLAN_WORKERS", "1")
    log = {"polish": [], "chunk": []}

    def polish(start, cand, **_):
        log["polish"].append(cand[0].name)
        if start == 1:
            return _cand(cand[0].name + "'", ONE, 3, cand[1].step_time_s * 0.95)
        return copy.deepcopy(cand) if start == 2 else cand  # C comes back as a worker's equal copy

    def chunked(start, **_):
        plan, pred = start
        log["chunk"].append(plan.name)
        if plan.name in ("B'", "E"):
            return _plan(plan.name + "/v2", plan.schedule, 1, v=2), SimpleNamespace(step_time_s=pred.step_time_s * 0.9)
        return start

    monkeypatch.setattr(planner, "_polish", polish)
    monkeypatch.setattr(planner, "_chunked", chunked)
    return log


def _scored():
    return [_cand("A", "zb-h1", 1, 1.0), _cand("B", ONE, 2, 1.1), _cand("C", ONE, 4, 1.2),
            _cand("D", "zb-h1", 5, 1.3), _cand("E", ONE, 6, 1.4), _cand("F", ONE, 7, 1.5)]


def _reference(scored):
    """Polish first, then chunk the post-polish starts: what `_refined` must return."""
    polished = [planner._polish(i, c) for i, c in enumerate(scored[:len(planner.POLISH_BUDGETS)])]
    scored = sorted([*polished, *scored[len(polished):]], key=lambda x: x[1].step_time_s)
    tried = [planner._chunked(x) for x in planner._interleave_starts(scored)]
    chunked = [(p, r) for p, r in tried if any(q.virtual_stages > 1 for q in p.pipelines)]
    return [(p.name, r.step_time_s) for p, r in sorted([*scored, *chunked], key=lambda x: x[1].step_time_s)]


def _refined(scored, *, polish=True, interleave=True):
    got = planner._refined(scored, polish=polish, interleave=interleave, config=None, profiles=None, host=None)
    return [(p.name, r.step_time_s) for p, r in got]


def test_the_starts_the_polish_changed_are_chunked_after_it_and_the_rest_beside_it(calls):
    got = _refined(_scored())
    # Beside the polish: the pre-polish starts B, C, E; after it only B' (B is no start any more; C's
    # equal copy is not chunked again).
    assert calls["polish"] == ["A", "B", "C"] and calls["chunk"] == ["B", "C", "E", "B'"]
    want = _reference(_scored())
    assert got == want and ("B'/v2", pytest.approx(1.1 * 0.95 * 0.9)) in want and ("E/v2", 1.4 * 0.9) in want


def test_without_the_polish_each_start_is_chunked_once_and_without_chunks_only_the_polish_runs(calls):
    _refined(_scored(), polish=False)
    assert calls["chunk"] == ["B", "C", "E"] and calls["polish"] == []
    calls["chunk"].clear()
    assert _refined(_scored(), interleave=False) == [(n, t) for n, t in _reference(_scored()) if "/" not in n]
    assert calls["chunk"] == ["B'", "C", "E"]  # the reference's own chunkings, none of _refined's
