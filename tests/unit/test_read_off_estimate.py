"""What `finalist_plans` reads off a candidate instead of its layout, or reads of it at once. Whether a laid-out
candidate is sharded (`layout.single_holder_units`, which answers a plan of several pipelines without walking its
holders) is the walk's answer, for models with and without tied embeddings, candidates of one pipeline included.
`finalists.unequal_refused` says a candidate is
refused exactly where laying it out (as `finalist_plans` does: sharded unless it has one replica) gives a
plan that `plan.zero23_refusal` refuses, on the planner's own candidates; and `priced_plans`, which skips a
variant all of whose splits it refuses, and `finalist_plans`, which skips such a candidate before laying it
out, return what the reference path (every candidate laid out and refused) returns."""

from __future__ import annotations

from dataclasses import replace

import pytest

from conftest import EXAMPLES
from hethub.layout import single_holder_units
from hethub.layout_assemble import build_plan
from hethub.memo import reference_path
from hethub.plan import zero23_refusal
from hethub.predict.scoring import Screen
from hethub.predict.stage_links import LinkBook
from hethub.search import PlannerConfig, finalists
from hethub.search.finalists import unequal_refused
from hethub.search.variants import Variant, enumerate_shapes, priced_plans, repriced
from hethub.spec.cluster import load_cluster
from hethub.spec.model import get_model


def _job(model_name: str = "llama-2-7b"):
    """Two kinds, 32 devices: about a third of the enumeration's shapes run unequal micro-batch counts."""
    cluster, model = load_cluster(EXAMPLES / "nvidia-amd-32.toml"), get_model(model_name)
    cfg = PlannerConfig(global_batch=64, seq_len=2048, micro_batch_sizes=(1, 2), schedule="auto",
                        optimizer_sharding="auto")
    links = LinkBook(cluster)
    enum = [Variant(n, "zero1").searcher(cfg, cluster=cluster, model=model, profiles=None, links=links, holders=64)
            for n in ("zb-h1", "1f1b")]
    shapes, _ = enumerate_shapes(enum, alone=False)
    return cluster, model, cfg, links, shapes


@pytest.mark.parametrize("model_name", ["llama-2-7b", "opt-350m"])
def test_sharding_a_candidate_reads_the_walks_lone_units(model_name):
    cluster, model, cfg, links, shapes = _job(model_name)
    s = Variant("1f1b", "zero1").searcher(cfg, cluster=cluster, model=model, profiles=None, links=links, holders=4)
    ests = [e for o in repriced(s, shapes[:24]).options for e in o]
    ests += [replace(e, groups=(replace(e.groups[0], count=1),), micro_batches=(e.micro_batches[0][:1],)) for e in ests]
    seen = set()
    for est in ests:
        total = sum(sum(m) * g.pipe.mbs for g, m in zip(est.groups, est.micro_batches, strict=True))
        plan = build_plan(cluster=cluster, model=model, est=est, global_batch=total, seq_len=cfg.seq_len,
                          schedule="1f1b", precision=cfg.precision, strategy="hethub")
        with reference_path():
            want = single_holder_units(plan)
        assert single_holder_units(plan) == want, est.micro_batches
        seen.add(not want)
    assert seen == {True, False}


def test_unequal_refused_is_the_laid_out_refusal():
    cluster, model, cfg, links, shapes = _job()
    seen = set()
    for v in (Variant("1f1b", "zero2"), Variant("zb-h1", "zero3"), Variant("1f1b", "zero1")):
        s = v.searcher(cfg, cluster=cluster, model=model, profiles=None, links=links, holders=4)
        for est in (e for o in repriced(s, shapes).options for e in o):
            plan = build_plan(cluster=cluster, model=model, est=est, global_batch=cfg.global_batch,
                              seq_len=cfg.seq_len, schedule=v.schedule, precision=cfg.precision, strategy="hethub")
            if not single_holder_units(plan):  # finalist_plans's layout: sharded unless one replica
                plan = replace(plan, optimizer_sharding=v.sharding)
            refused = plan.zero_stage >= 2 and zero23_refusal(plan) is not None
            assert unequal_refused(est, v.sharding) == refused, (v, est.micro_batches)
            seen.add(refused)
    assert seen == {True, False}  # both answers were asked


def test_refused_variants_price_the_reference_plans(monkeypatch):
    cluster, model, cfg, links, shapes = _job()
    laid = []
    plain = finalists.build_plan
    monkeypatch.setattr(finalists, "build_plan", lambda **k: laid.append(1) or plain(**k))

    def priced() -> list:
        out = []
        for v in (Variant("1f1b", "zero2"), Variant("zb-h1", "zero3"), Variant("zb-h1", "zero2"),
                  Variant("1f1b", "zero1")):
            s = v.searcher(cfg, cluster=cluster, model=model, profiles=None, links=links, holders=4)
            for pool in (shapes[30:60], shapes[:3], [e for e in shapes if unequal_refused(e, "zero2")][:4]):
                got = priced_plans(s, config=cfg, shapes=pool, screen=Screen(3), firsts=min(3, len(pool)))
                # the first three: what the screen keeps exact in any order of prediction (test_floor_order.py)
                out.append([(p.to_dict(), r.step_time_s) for p, r in got[:3]])
        return out
    with reference_path():
        want = priced()
    eager = len(laid)
    laid.clear()
    assert priced() == want
    assert len(laid) < eager  # refused candidates were not laid out
