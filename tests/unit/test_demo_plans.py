"""The demo's three plans: the planner's on every kind, uniform's and the best on a proper subset of
the kinds, and the sentence saying why the mixed plan wins (predictions only: no ranks start here)."""

from dataclasses import replace

from conftest import EXAMPLES
from hethub.demo import (
    DemoConfig,
    default_cluster_path,
    idle_kinds,
    kind_role,
    kind_subsets,
    plan_contenders,
    why_mixed_wins,
    work_shares,
)
from hethub.emulation.host import host_model
from hethub.spec.cluster import load_cluster
from hethub.spec.model import PRESETS


def _contenders():
    cluster = load_cluster(default_cluster_path())
    cluster = replace(cluster, host=replace(cluster.host, cores=2))  # the 2-core machine the demo is sized for
    return plan_contenders(cluster, PRESETS["small"], DemoConfig(), profiles=None, host=host_model(cluster))


def test_the_embedded_cluster_is_the_example_file():
    assert default_cluster_path().read_text() == (EXAMPLES / "demo-cpu.toml").read_text()


def test_the_mixed_plan_gives_every_kind_work_and_beats_each_subset_and_uniform():
    """By the predictor (catalog CPU numbers here; the demo measures this CPU first), with the margin the
    demo is designed for: >= 1.2x the best subset and uniform."""
    (mixed, uniform, subset), subsets = _contenders()
    assert [c.key for c in (mixed, uniform, subset)] == ["hethub", "uniform", "subset"]
    assert not idle_kinds(mixed.result.plan)
    shares = work_shares(mixed.result.plan)
    assert set(shares) == {"cpu-fast", "cpu-slow"} and abs(sum(shares.values()) - 1) < 1e-9
    assert shares["cpu-slow"] < shares["cpu-fast"]  # the slower kind takes less
    assert [name for name, _ in subsets] == ["cpu-fast alone", "cpu-slow alone"]
    assert subset.result.prediction.tokens_per_s == max(r.prediction.tokens_per_s for _, r in subsets)
    best = mixed.result.prediction.tokens_per_s
    assert best >= 1.2 * subset.result.prediction.tokens_per_s
    assert best >= 1.2 * uniform.result.prediction.tokens_per_s


def test_why_names_what_the_slow_kind_takes_and_what_it_frees():
    (mixed, uniform, subset), _ = _contenders()
    text = why_mixed_wins(mixed.result, subset.result, uniform.result)
    share = work_shares(mixed.result.plan)["cpu-slow"]
    assert f"cpu-slow takes {share:.0%} of the work as {kind_role(mixed.result.plan, 'cpu-slow')}" in text
    assert f"frees cpu-fast from {share:.0%}" in text
    assert f"{mixed.result.prediction.step_time_s:.2f} s against {subset.result.prediction.step_time_s:.2f} s" in text
    assert "the cpu-slow ranks set its pace" in text
    # With nothing beyond the subset's kinds, it says the plan cannot win by mixing.
    assert "cannot win by mixing" in why_mixed_wins(subset.result, subset.result, uniform.result)


def test_roles_and_subsets():
    (mixed, _, _), _ = _contenders()
    assert kind_role(mixed.result.plan, "cpu-fast").startswith("2 replicas of ")
    cluster = load_cluster(EXAMPLES / "three-kinds-48.toml")
    subs = kind_subsets(cluster)
    assert len(subs) == 6 and all(0 < len(s.kind_names) < 3 for s in subs)
    assert {s.name for s in subs} >= {f"{cluster.name}[h100-sxm+a100-80gb]", f"{cluster.name}[mi300x]"}
