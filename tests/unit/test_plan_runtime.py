"""hethub plan --runtime: the planner searches only what the runtime runs (hethub.runtimes) and
predicts with its cost rules; Sailor's export takes exactly such plans and refuses the rest by name."""

import json
from dataclasses import replace
from pathlib import Path

import pytest

from hethub.errors import PlanError, SpecError
from hethub.interop.sailor import export_sailor_plan, import_sailor_plan
from hethub.predict.predictor import predict
from hethub.profile import load_profiles
from hethub.runtimes import RUNTIMES, runtime_refusals
from hethub.search import PlannerConfig, make_plan
from hethub.spec.cluster import load_cluster
from hethub.spec.model import get_model

ROOT = Path(__file__).resolve().parents[2]
CLUSTER = ROOT / "examples" / "clusters" / "a100-v100-32.toml"
# SAILOR's plan for OPT-350M on 16 V100-16 + 16 A100-40 (eth-easl/sailor's example, tests/data/sailor).
SAILOR_PLAN = ROOT / "tests" / "data" / "sailor" / "example-plan-opt350-a100-v100.json"


def layout(plan):
    """What Sailor's format carries of a plan: per pipeline its micro-batches and each stage's kind,
    TP degree and layers (no device ids: the import places replicas on the lowest free devices)."""
    return [(p.micro_batch_size, p.num_micro_batches,
             [(s.kind, s.tp, s.layers, s.embedding, s.head) for s in p.stages]) for p in plan.pipelines]


@pytest.fixture(scope="module")
def deepspeed_plan():
    cluster, model = load_cluster(CLUSTER), get_model("opt-350m")
    config = PlannerConfig(global_batch=1024, seq_len=2048, runtime="deepspeed", optimizer_sharding="none")
    return make_plan(cluster=cluster, model=model, config=config)


def test_a_deepspeed_plan_is_what_deepspeed_runs_and_is_predicted_as_it_runs(deepspeed_plan):
    plan = deepspeed_plan.plan
    assert plan.runtime == "deepspeed" and plan.p2p == "lockstep"  # its cost rules: lock-step sends, no overlap
    assert runtime_refusals(plan) == []
    assert plan.schedule == "1f1b" and plan.optimizer_sharding == "none"
    assert len({p.num_micro_batches for p in plan.pipelines}) == 1  # equal batch shares
    assert not any(s.recompute for p in plan.pipelines for s in p.stages)
    assert predict(plan).step_time_s == pytest.approx(deepspeed_plan.prediction.step_time_s)


def test_a_deepspeed_plan_exports_to_sailor_and_imports_back_to_the_same_plan(deepspeed_plan):
    plan = deepspeed_plan.plan
    out = export_sailor_plan(plan)
    # Sailor's shape: per entry one tmp_per_stage entry per replica, dp replicas in every stage.
    for entry in out["pipeline_list"]:
        assert all(len(reps) == entry["dp"][0] for reps in entry["tmp_per_stage"])
    assert out["gbs"] == plan.global_batch
    back = import_sailor_plan(json.loads(json.dumps(out)), cluster=plan.cluster, model=plan.model, seq_len=plan.seq_len)
    assert sorted(layout(back)) == sorted(layout(plan))
    assert back.global_batch == plan.global_batch and back.schedule == plan.schedule


def test_sailor_export_refuses_zero_naming_it(deepspeed_plan):
    zero1 = replace(deepspeed_plan.plan, optimizer_sharding="zero1")
    with pytest.raises(PlanError, match="ZeRO-1") as err:
        export_sailor_plan(zero1)
    assert "optimizer_sharding" in str(err.value) and "--optimizer-sharding none" in str(err.value)
    interleaved = replace(deepspeed_plan.plan, schedule="interleaved")
    with pytest.raises(PlanError, match="1F1B"):
        export_sailor_plan(interleaved)


@pytest.mark.parametrize(("runtime", "schedule", "sharding", "field"), [
    ("deepspeed", "zb-h1", "auto", "'schedule'"), ("deepspeed", "interleaved", "none", "'schedule'"),
    ("megatron", "gpipe", "none", "'schedule'"), ("hethub", "auto", "auto", None)])
def test_forcing_what_the_runtime_cannot_run_names_the_field_and_the_fix(runtime, schedule, sharding, field):
    if field is None:
        PlannerConfig(global_batch=8, seq_len=128, runtime=runtime, schedule=schedule, optimizer_sharding=sharding)
        return
    with pytest.raises(SpecError, match=field) as err:
        PlannerConfig(global_batch=8, seq_len=128, runtime=runtime, schedule=schedule, optimizer_sharding=sharding)
    assert "Fix:" in str(err.value) and runtime in str(err.value)


def test_a_deepspeed_plan_notes_why_sailors_format_refuses_it(deepspeed_plan):
    from hethub.commands.plan import runtime_notes

    config = PlannerConfig(global_batch=1024, seq_len=2048, runtime="deepspeed")
    plan = deepspeed_plan.plan
    assert not [n for n in runtime_notes(config, plan) if "Sailor's format" in n]  # it exports
    said = [n for n in runtime_notes(config, replace(plan, optimizer_sharding="zero1")) if "Sailor's format" in n]
    assert len(said) == 1 and "ZeRO-1" in said[0] and "--optimizer-sharding none" in said[0]
    assert not [n for n in runtime_notes(replace(config, runtime="hethub"), replace(plan, optimizer_sharding="zero1"))
                if "Sailor's format" in n]  # only DeepSpeed's engine is what Sailor runs


def test_runtime_refusals_name_each_feature(deepspeed_plan):
    plan = deepspeed_plan.plan
    p0 = plan.pipelines[0]
    more = replace(p0, num_micro_batches=p0.num_micro_batches + 1)
    uneven = replace(plan, pipelines=(more, *plan.pipelines[1:]))
    assert any("unequal batch shares" in r for r in runtime_refusals(uneven, "deepspeed"))
    assert runtime_refusals(uneven, "hethub") == []
    assert any("zb-h1" in r for r in runtime_refusals(replace(plan, schedule="zb-h1"), "megatron"))
    # Megatron: one TP degree, identical replicas; the deepspeed plan mixes TP degrees or kinds per stage
    if len({s.tp for s in p0.stages}) > 1:
        assert any("TP degrees" in r for r in runtime_refusals(plan, "megatron"))


def test_megatron_plans_keep_to_megatron(deepspeed_plan):
    cluster, model = load_cluster(CLUSTER), get_model("opt-350m")
    got = make_plan(cluster=cluster, model=model,
                    config=PlannerConfig(global_batch=256, seq_len=2048, runtime="megatron"))
    plan = got.plan
    assert plan.runtime == "megatron" and runtime_refusals(plan) == []
    assert plan.schedule in RUNTIMES["megatron"].schedules and plan.optimizer_sharding in ("none", "zero1")
    assert len({tuple((s.kind, s.tp, s.layers) for s in p.stages) for p in plan.pipelines}) == 1
    assert len({s.tp for p in plan.pipelines for s in p.stages}) == 1


def test_deepspeed_plan_beats_sailors_under_sailors_rules():
    """SAILOR's OPT-350M plan for 16 A100 + 16 V100 against hethub's --runtime deepspeed plan, both
    through Sailor's format and predicted as hethub models Sailor's runs (Sailor's measured layer
    profiles; the import's fp32, math attention, lock-step sends): the planner is given the same
    profiles, precision and attention. (Sailor's larger A100 + V100 scenarios have no SAILOR plan here.)"""
    cluster, model = load_cluster(CLUSTER), get_model("opt-350m")
    profiles = load_profiles(SAILOR_PLAN.parent / "profiles" / "OPT-350", model=model, seq_len=2048)
    theirs = predict(import_sailor_plan(json.loads(SAILOR_PLAN.read_text()), cluster=cluster, model=model,
                                        seq_len=2048), profiles=profiles)
    as_sailor_runs = replace(cluster, kinds={k: replace(v, attention="math") for k, v in cluster.kinds.items()})
    ours = make_plan(cluster=as_sailor_runs, model=model, profiles=profiles,
                     config=PlannerConfig(global_batch=1024, seq_len=2048, runtime="deepspeed", precision="fp32",
                                          optimizer_sharding="none"))
    back = predict(import_sailor_plan(export_sailor_plan(ours.plan), cluster=cluster, model=model, seq_len=2048),
                   profiles=profiles)
    assert theirs.fits_memory and back.fits_memory
    assert back.tokens_per_s >= theirs.tokens_per_s
