"""The demo names the kind its best plan leaves out, why, and finds the best plan using every kind."""

from conftest import EXAMPLES
from hethub.demo import best_with_every_kind, why_left_out
from hethub.search.config import PlannerConfig
from hethub.search.planner import make_plan
from hethub.spec.cluster import load_cluster
from hethub.spec.model import PRESETS


def test_best_plan_with_every_kind_and_the_reason():
    cluster = load_cluster(EXAMPLES / "local-cpu.toml")
    res = make_plan(cluster=cluster, model=PRESETS["small"],
                    config=PlannerConfig(global_batch=16, seq_len=128, precision="fp32", top_k=16))
    every = best_with_every_kind(res, cluster)
    assert every is not None
    plan, pred = every
    assert {s.kind for p in plan.pipelines for s in p.stages} == set(cluster.kind_names)
    assert pred.tokens_per_s <= res.prediction.tokens_per_s  # the planner's best is the best
    faster = [p for pl, p in res.alternatives if {s.kind for q in pl.pipelines for s in q.stages} ==
              set(cluster.kind_names) and p.tokens_per_s > pred.tokens_per_s]
    assert not faster  # the fastest among the plans using every kind
    text = why_left_out(res, every, ["cpu-slow"])
    assert f"{pred.tokens_per_s:,.0f} tokens/s" in text and f"{res.prediction.tokens_per_s:,.0f}" in text
    assert "none of" in why_left_out(res, None, ["cpu-slow"])
