"""The polish's move screen (search/polish._score): a layer move whose receiving stage alone reaches the
bar is refused before its pipeline is priced, and every move's answer is the plain rule's (the whole
moved pipeline's floor, `memo.reference_path`), on the planner's plans at their own bars and at random
ones; and the polish from them ends where the plain rule's does."""

from __future__ import annotations

import random

from conftest import EXAMPLES
from hethub.memo import reference_path
from hethub.predict.interleave import pipeline_signature
from hethub.predict.plan_costs import PlanCosts
from hethub.predict.predictor import predict
from hethub.search import PlannerConfig, make_plan
from hethub.search.polish import _moves, _score, polish
from hethub.spec.cluster import load_cluster
from hethub.spec.model import get_model


def _plans() -> list:
    cluster, model = load_cluster(EXAMPLES / "a100-v100-32.toml"), get_model("llama-2-7b")
    cfg = PlannerConfig(global_batch=128, seq_len=2048, micro_batch_sizes=(1, 2), top_k=4, polish=False)
    return [(p, r) for p, r in make_plan(cluster=cluster, model=model, config=cfg).alternatives]


def test_layer_moves_refused_early_are_those_the_plain_screen_refuses(monkeypatch):
    rng = random.Random(3)
    early = moves = 0
    for plan, pred in _plans():
        costs = PlanCosts(plan, None)
        priced = []
        plain_closed = costs.closed_form
        monkeypatch.setattr(costs, "closed_form",
                            lambda *a, plain=plain_closed, log=priced, **k: log.append(1) or plain(*a, **k))
        sigs = [pipeline_signature(p) for p in plan.pipelines]
        times = [costs.closed_form_of(p) for p in plan.pipelines]
        lists = {sig: costs.pipeline_times(plan.pipelines[sigs.index(sig)]) for sig in set(sigs)}
        for bar in (pred.step_time_s * (1 - 1e-9), pred.step_time_s * rng.uniform(0.5, 1.5), float("inf")):
            for move in _moves(plan, sigs):
                priced.clear()
                got = _score(plan, sigs, times, move, costs, bar, lists)
                fast = len(priced)
                with reference_path():
                    assert _score(plan, sigs, times, move, costs, bar, lists) == got, (move, bar)
                if move[0] == "layer":
                    moves += 1
                    early += fast < len(priced) - fast
    assert moves > 100 and early > moves // 10  # some refused before their pipeline was priced


def test_polish_ends_where_the_plain_screen_does():
    for plan, pred in _plans()[:2]:
        kw = dict(profiles=None, budget=6, allow_recompute=True)
        got = polish(plan, pred, **kw)
        with reference_path():
            want = polish(plan, pred, **kw)
        assert got[0] == want[0] and got[1].step_time_s == want[1].step_time_s
        assert got[1].step_time_s <= predict(plan).step_time_s
