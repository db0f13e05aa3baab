"""Memos live for one search (memo.search_scope, which make_plan opens): the outermost search leaves
them empty, nested scopes and `reused_searches` keep theirs, and a search
after another in one process gives the plan it gives alone."""

from __future__ import annotations

import gc

from hethub import memo
from hethub.memo import Kept, clear_caches, search_scope
from hethub.search import make_plan
from hethub.search.config import PlannerConfig
from hethub.search.planner import reused_searches
from hethub.spec.cluster import parse_cluster
from hethub.spec.model import get_model


def _cluster(name: str, kinds: tuple[str, str]):
    return parse_cluster({"name": name, "group": [{"kind": k, "nodes": 1, "devices_per_node": 4} for k in kinds]},
                         where="test")


def _filled() -> dict[int, int]:
    """Entries of every memo that holds any (by id)."""
    return {id(k): len(k.entries) for k in list(memo._ALL) if k.entries}


def _plan(cluster):
    r = make_plan(cluster=cluster, model=get_model("llama-2-7b"),
                  config=PlannerConfig(global_batch=16, seq_len=1024, polish=False, micro_batch_sizes=(1, 2)))
    return r.plan.to_dict() | {"meta": None}, r.prediction.tokens_per_s


def test_the_outermost_scope_ends_empty_and_nested_ones_keep_theirs():
    kept = Kept(8)
    was = gc.isenabled()
    gc.enable()
    try:
        with search_scope():
            assert not gc.isenabled()
            kept.get(("outer",), lambda: 2)
            with search_scope():
                kept.get(("inner",), lambda: 3)
            assert set(kept.entries) == {("outer",), ("inner",)} and not gc.isenabled()
        assert not kept.entries and gc.isenabled()
    finally:
        if not was:
            gc.disable()


def test_make_plan_leaves_every_memo_empty_and_a_search_after_another_gives_the_plan_it_gives_alone():
    a, b = _cluster("scope-a", ("a100-80gb", "v100-16gb")), _cluster("scope-b", ("h100-sxm", "a100-40gb"))
    clear_caches()
    alone = _plan(b)
    assert _filled() == {}
    _plan(a)
    assert _plan(b) == alone
    with reused_searches():  # the rows keep their memos: the second search meets the first one's
        _plan(a)
        assert _filled()
        assert _plan(b) == alone
    assert _filled() == {}
