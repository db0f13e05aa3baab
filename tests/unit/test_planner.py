"""The planner on the issue's acceptance cases, its baselines and its upper bound."""

from dataclasses import replace
from pathlib import Path

import pytest

from conftest import plan_768
from hethub.errors import InfeasibleError, SpecError
from hethub.plan import Plan
from hethub.predict.predictor import predict
from hethub.search import PlannerConfig, make_plan, upper_bound
from hethub.spec.cluster import load_cluster, parse_cluster
from hethub.spec.model import get_model

CLUSTERS = Path(__file__).resolve().parents[2] / "examples" / "clusters"


def one_kind_plan(plan: Plan, kind: str) -> Plan | None:
    """The pipelines of `plan` that use only `kind`, sharing the whole global batch as evenly as the
    micro-batch size allows (None if there are none)."""
    pipes = [p for p in plan.pipelines if {s.kind for s in p.stages} == {kind}]
    if not pipes:
        return None
    mbs = pipes[0].micro_batch_size
    pipes = [p for p in pipes if p.micro_batch_size == mbs]
    total = plan.global_batch // mbs
    counts = [total // len(pipes) + (i < total % len(pipes)) for i in range(len(pipes))]
    return replace(plan, pipelines=tuple(replace(p, num_micro_batches=m)
                                         for p, m in zip(pipes, counts, strict=True))).validate()


@pytest.mark.xdist_group("plan_768")
def test_hethub_768_llama_140b_is_fast_efficient_and_reproduced_by_predict():
    # Its search time is measured by bench/planner_scale.py, not asserted: wall clock on a shared
    # machine is not the code's. The search is shared with test_report_scale.py (conftest.plan_768).
    r = plan_768()
    # `efficiency` is read against the proven bound (issue 37: against the kind-alone sum it read
    # 1.005-1.007 here, so that sum was no bound); the kind-alone sum is the reference `vs_kinds_alone`,
    # which this plan must stay close to (0.941 when it was still called efficiency).
    assert r.efficiency <= 1.0
    assert r.vs_kinds_alone >= 0.93
    assert r.prediction.fits_memory
    again = predict(Plan.from_dict(r.plan.to_dict()))  # through the JSON form, as `hethub predict` reads it
    assert again.step_time_s == r.prediction.step_time_s
    assert r.plan.strategy == "hethub"
    assert r.plan.meta["predicted_step_time_s"] == r.prediction.step_time_s
    assert r.plan.meta["efficiency"] == pytest.approx(r.efficiency)
    assert r.plan.meta["vs_kinds_alone"] == pytest.approx(r.vs_kinds_alone)
    # The honest bound (issue 17): each kind's part is at least what any one-kind plan predicts. The
    # one-kind pipelines of the combined plan, given the whole batch, must not beat their kind's part
    # (they did by 2.3% when the kind-alone search kept only its top-3 templates).
    parts = r.upper_bound_by_kind
    assert set(parts) == {"gpu-b", "mi250x"}
    assert sum(parts.values()) == pytest.approx(r.kinds_alone_tokens_per_s)
    for kind, part in parts.items():
        alone = one_kind_plan(r.plan, kind)
        if alone is not None:
            assert predict(alone).tokens_per_s <= part * (1 + 1e-9), kind


def test_hethub_beats_baselines_on_a100_v100():
    cluster = load_cluster(CLUSTERS / "a100-v100-32.toml")
    model = get_model("llama-3-8b")
    tput = {}
    for strategy in ("hethub", "uniform", "flops-proportional", "homogeneous"):
        r = make_plan(cluster=cluster, model=model,
                      config=PlannerConfig(global_batch=512, seq_len=2048, strategy=strategy))
        assert r.plan.strategy == strategy
        assert r.prediction.fits_memory
        tput[strategy] = r.prediction.tokens_per_s
    assert tput["hethub"] > tput["uniform"]
    assert tput["hethub"] > tput["flops-proportional"]
    assert tput["hethub"] >= tput["homogeneous"]


def test_homogeneous_uses_one_kind_and_uniform_splits_evenly():
    cluster = load_cluster(CLUSTERS / "a100-v100-32.toml")
    model = get_model("llama-3-8b")
    homo = make_plan(cluster=cluster, model=model, config=PlannerConfig(global_batch=512, seq_len=2048,
                                                                        strategy="homogeneous")).plan
    assert len({s.kind for p in homo.pipelines for s in p.stages}) == 1
    uni = make_plan(cluster=cluster, model=model, config=PlannerConfig(global_batch=512, seq_len=2048,
                                                                       strategy="uniform")).plan
    assert uni.world_size == cluster.num_devices
    assert len({p.num_samples for p in uni.pipelines}) == 1
    for p in uni.pipelines:
        counts = [s.num_layers for s in p.stages]
        assert max(counts) - min(counts) <= 1


@pytest.mark.slow
def test_cluster_4096_plans_within_the_cluster():
    # Search speed is measured by bench/planner_scale.py, not asserted here (tests never check timings).
    cluster = load_cluster(CLUSTERS / "cluster-4096.toml")
    r = make_plan(cluster=cluster, model=get_model("llama-2-70b"),
                  config=PlannerConfig(global_batch=2048, seq_len=4096))
    assert r.prediction.fits_memory
    assert r.plan.world_size <= 4096


def test_top_k_alternatives_are_sorted_and_include_the_best():
    cluster = load_cluster(CLUSTERS / "a100-v100-32.toml")
    r = make_plan(cluster=cluster, model=get_model("llama-3-8b"),
                  config=PlannerConfig(global_batch=512, seq_len=2048, top_k=3))
    assert 1 < len(r.alternatives) <= 3
    assert r.alternatives[0][0] == r.plan
    times = [p.step_time_s for _, p in r.alternatives]
    assert times == sorted(times)
    for plan, pred in r.alternatives:
        assert predict(plan).step_time_s == pred.step_time_s


def _small_mixed_cluster():
    # A kind whose devices together cannot hold llama-2-7b's training state (2 x 16 GB).
    return parse_cluster({"name": "big-small", "group": [
        {"kind": "a100-80gb", "nodes": 1, "devices_per_node": 4},
        {"kind": "v100-16gb", "nodes": 1, "devices_per_node": 2}]}, where="test")


def test_upper_bound_relaxes_memory_of_a_kind_that_cannot_hold_the_model():
    cluster = _small_mixed_cluster()
    cfg = PlannerConfig(global_batch=64, seq_len=1024)
    bound, notes = upper_bound(cluster=cluster, model=get_model("llama-2-7b"), config=cfg)
    assert bound > 0
    assert len(notes) == 1 and "v100-16gb" in notes[0] and "relaxed" in notes[0]
    alone, _ = upper_bound(cluster=cluster, model=get_model("llama-2-7b"), config=cfg)
    r = make_plan(cluster=cluster, model=get_model("llama-2-7b"), config=cfg)
    assert r.notes[-len(notes):] == notes  # after the planner's own (context parallelism's)
    # The kind-alone sum is reported as the reference; the bound efficiency reads is the proven one.
    assert r.kinds_alone_tokens_per_s == alone
    assert r.upper_bound_tokens_per_s >= alone


def test_infeasible_says_what_does_not_fit_and_what_to_change():
    cluster = load_cluster(CLUSTERS / "a100-v100-32.toml")
    with pytest.raises(InfeasibleError, match=r"llama-3-70b.*GiB.*Fix: use a larger cluster"):
        make_plan(cluster=cluster, model=get_model("llama-3-70b"),
                  config=PlannerConfig(global_batch=256, seq_len=2048))


def test_infeasible_activations_suggest_shorter_sequences():
    # The training state fits in aggregate (16 x 9 GB x 0.9 > 18 B x 6.7B) but not per device once each device
    # also holds its activations.
    cluster = parse_cluster({"name": "tiny-mem", "kinds": {"k": {"base": "a100-40gb", "mem_bytes": 9_000_000_000}},
                             "group": [{"kind": "k", "nodes": 2, "devices_per_node": 8}]}, where="test")
    with pytest.raises(InfeasibleError, match=r"one layer at TP 8 needs .* GiB per k device.*--seq-len"):
        make_plan(cluster=cluster, model=get_model("llama-2-7b"), config=PlannerConfig(global_batch=8, seq_len=4096))


def test_config_rejects_bad_values():
    with pytest.raises(SpecError, match="strategy"):
        PlannerConfig(global_batch=8, seq_len=128, strategy="greedy")
    with pytest.raises(SpecError, match="tp_degrees"):
        PlannerConfig(global_batch=8, seq_len=128, tp_degrees=(3,))
    with pytest.raises(InfeasibleError, match="micro-batch"):
        make_plan(cluster=_small_mixed_cluster(), model=get_model("tiny"),
                  config=PlannerConfig(global_batch=7, seq_len=64, micro_batch_sizes=(2, 4)))


def test_plans_are_valid_and_use_each_device_once():
    cluster = load_cluster(CLUSTERS / "three-kinds-48.toml")
    cfg = PlannerConfig(global_batch=256, seq_len=4096)
    r = make_plan(cluster=cluster, model=get_model("llama-2-70b"), config=cfg)
    r.plan.validate()
    assert len(set(r.plan.devices)) == r.plan.world_size
    assert sum(p.num_samples for p in r.plan.pipelines) == 256
    gp = make_plan(cluster=cluster, model=get_model("llama-2-70b"),
                   config=replace(cfg, global_batch=32, schedule="gpipe"))
    assert gp.prediction.fits_memory and gp.plan.schedule == "gpipe"
