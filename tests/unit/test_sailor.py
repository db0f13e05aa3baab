"""Sailor's profiles and plans: reading its public data, plan import/export and what cannot be exported."""

import json
from dataclasses import replace

import pytest

from conftest import EXAMPLES, SAILOR_DATA, small_cluster, tiny_model
from hethub.errors import PlanError, SpecError
from hethub.interop import export_sailor_plan, import_sailor_plan, sailor_plan_model
from hethub.plan import Pipeline, Plan, Stage
from hethub.profile import load_profiles, read_profile
from hethub.spec.cluster import load_cluster
from hethub.spec.model import PRESETS

SAILOR = SAILOR_DATA
PROFILES = SAILOR / "profiles"
# Sailor's GPT-Neo-2.7/GH-96 file is a copy of OPT-350/GH-96 (26 layer entries, identical numbers).
MISFILED = {"GPT-Neo-2.7/GH-96"}


def _profile_dirs() -> list[str]:
    return sorted(f"{p.parent.parent.name}/{p.parent.name}" for p in PROFILES.glob("*/*/profile.json"))


@pytest.mark.parametrize("name", _profile_dirs())
def test_every_sailor_profile_loads_or_is_rejected_clearly(name):
    path = PROFILES / name / "profile.json"
    if name in MISFILED:
        with pytest.raises(SpecError, match="belongs to another model"):
            read_profile(path)
        return
    prof = read_profile(path)
    assert prof.entries
    for e in prof.entries.values():
        # Seconds: per micro-batch, a decoder layer takes 0.1 ms .. 2 s (the top: OPT-350 at mbs 64
        # on eight PCIe RTX-3090s, whose TP all-reduces are inside the measured time).
        assert 1e-4 < e.layer.fwd_s < 2.0 and 1e-4 < e.layer.bwd_s < 3.0
        assert e.embedding.fwd_s < 1.0 and e.head.fwd_s < 1.0


def test_units_and_seq_lens():
    opt = read_profile(PROFILES / "OPT-350" / "A100-40" / "profile.json")
    assert (opt.kind, opt.model, opt.seq_len) == ("a100-40gb", "opt-350m", 2048)
    assert 1e-3 < opt.entries[(1, 1)].layer.fwd_s < 1e-2  # milliseconds, stored in seconds
    llama = read_profile(PROFILES / "LLAMA-3-8" / "GH-96" / "profile.json")
    assert (llama.kind, llama.model, llama.seq_len) == ("gh200", "llama-3-8b", 8192)


def test_llama_final_norm_is_folded_into_the_head():
    raw = json.loads((PROFILES / "LLAMA-3-8" / "GH-96" / "profile.json").read_text())["1"]["1"]
    e = read_profile(PROFILES / "LLAMA-3-8" / "GH-96" / "profile.json").entries[(1, 1)]
    assert len(raw) == 35  # embedding, 32 blocks, final norm, head
    assert e.head.fwd_s == pytest.approx(raw["34"][0] + raw["33"][0])
    assert e.layer.fwd_s == pytest.approx(sum(raw[str(i)][0] for i in range(1, 33)) / 32)


@pytest.mark.parametrize("model", ["OPT-350", "GPT-Neo-2.7", "LLAMA-3-8", "OPT-30"])
def test_v100_is_slower_than_a100_per_layer(model):
    a100 = read_profile(PROFILES / model / "A100-40" / "profile.json")
    v100 = read_profile(PROFILES / model / "V100-16" / "profile.json")
    common = set(a100.entries) & set(v100.entries)
    assert common
    for key in common:
        assert v100.entries[key].layer.fwd_s > a100.entries[key].layer.fwd_s, key
        assert v100.entries[key].layer.bwd_s > a100.entries[key].layer.bwd_s, key


def test_loading_the_tree_for_one_model_skips_the_others():
    with pytest.warns(UserWarning, match="profile skipped"):
        ps = load_profiles(PROFILES, model=PRESETS["opt-350m"], seq_len=2048)
    assert set(ps.by_kind) == {"a100-40gb", "a100-80gb", "v100-16gb", "gh200", "rtx-2080-ti", "rtx-3090", "titan-rtx"}
    assert all(p.model == "opt-350m" for p in ps.by_kind.values())


# ---- plans ---------------------------------------------------------------------------------------
def _example() -> dict:
    return json.loads((SAILOR / "example-plan-opt350-a100-v100.json").read_text())


def _import_example() -> Plan:
    return import_sailor_plan(_example(), cluster=load_cluster(EXAMPLES / "a100-v100-32.toml"),
                              model=PRESETS["opt-350m"], seq_len=2048)


def _shape(plan: Plan) -> list:
    return [(p.micro_batch_size, p.num_micro_batches, [(s.kind, s.tp, s.layers, s.embedding, s.head)
                                                       for s in p.stages]) for p in plan.pipelines]


def test_example_plan_imports_and_exports_back():
    plan = _import_example()
    assert plan.validate() is plan
    assert len(plan.pipelines) == 8 and plan.world_size == 32
    p = plan.pipelines[0]
    assert (p.micro_batch_size, p.num_micro_batches) == (2, 64)  # 1024 / (2 x 8)
    assert [(s.kind, s.tp, s.layers) for s in p.stages] == [("v100-16gb", 2, (0, 7)), ("a100-40gb", 2, (7, 24))]
    assert all(len({plan.cluster.devices[d].node for d in s.devices}) == 1 for q in plan.pipelines for s in q.stages)
    assert export_sailor_plan(plan) == _example()
    assert export_sailor_plan(Plan.from_dict(json.loads(plan.to_json()))) == _example()  # survives saving


def test_example_plan_needs_enough_devices():
    cluster = load_cluster(EXAMPLES / "a100-v100-32.toml")
    data = _example()
    for stage in data["pipeline_list"][0]["tmp_per_stage"]:  # 12 replicas of 2 per stage
        stage.extend(stage[:4])
    data["pipeline_list"][0]["dp"] = [12, 12]
    data["gbs"] = 2 * 12 * 8
    with pytest.raises(PlanError, match=r"'v100-16gb'.*Fix"):
        import_sailor_plan(data, cluster=cluster, model=PRESETS["opt-350m"], seq_len=2048)
    with pytest.raises(PlanError, match=r"GPU 'V100-16'.*does not have"):
        import_sailor_plan(_example(), cluster=small_cluster(), model=PRESETS["opt-350m"], seq_len=2048)


def _sailor(stages, dp, *, mbs=1, gbs=8) -> dict:
    return {"pipeline_list": [{"num_stages": len(stages), "layers_per_stage": [s[0] for s in stages],
                               "tmp_per_stage": [s[1] for s in stages], "dp": [dp] * len(stages)}],
            "mbs": mbs, "gbs": gbs}


def test_mixed_replicas_round_trip_without_shared_data():
    # tiny model: Sailor layers 0 (embedding), 1..6 (blocks), 7 (head).
    data = _sailor([([0, 1, 2, 3], [[[["fast", 2, "z"]], 1], [[["slow", 2, "z"]], 2]]),
                    ([4, 5, 6, 7], [[[["slow", 2, "z"]], 1], [[["fast", 2, "z"]], 2]])], dp=3, mbs=2, gbs=12)
    plan = import_sailor_plan(data, cluster=small_cluster(fast=4, slow=4), model=tiny_model(), seq_len=32)
    assert [[(s.kind, s.tp) for s in p.stages] for p in plan.pipelines] == [
        [("fast", 1), ("slow", 1)], [("fast", 1), ("slow", 1)], [("slow", 2), ("fast", 2)]]
    assert plan.pipelines[0].stages[0].layers == (0, 3) and plan.pipelines[0].num_micro_batches == 2
    out = export_sailor_plan(plan)
    # Export writes Sailor's own form: one entry per replica (3 here), device_count = tp.
    per_replica = _sailor([([0, 1, 2, 3], [[[["fast", 1, "z"]], 1], [[["fast", 1, "z"]], 1], [[["slow", 2, "z"]], 2]]),
                           ([4, 5, 6, 7], [[[["slow", 1, "z"]], 1], [[["slow", 1, "z"]], 1], [[["fast", 2, "z"]], 2]])],
                          dp=3, mbs=2, gbs=12)
    assert out == per_replica
    assert all(len(t) == 3 for t in out["pipeline_list"][0]["tmp_per_stage"])
    assert export_sailor_plan(import_sailor_plan(out, cluster=plan.cluster, model=plan.model, seq_len=32)) == out
    assert _shape(import_sailor_plan(out, cluster=plan.cluster, model=plan.model, seq_len=32)) == _shape(plan)


def test_sailor_planner_form_one_entry_per_replica():
    # Sailor's planners write one entry per replica, the count being the GPUs of the VM.
    data = _sailor([([0, 1, 2, 3, 4, 5, 6, 7], [[[["fast", 2, "z"]], 1], [[["fast", 2, "z"]], 1]])], dp=2, gbs=4)
    plan = import_sailor_plan(data, cluster=small_cluster(), model=tiny_model(), seq_len=32)
    assert [p.stages[0].devices for p in plan.pipelines] == [(0,), (1,)]


@pytest.mark.parametrize("kind", ["rtx-2080-ti", "rtx-2080"])
def test_sailors_rtx_2080_is_the_2080_ti_and_older_clusters_still_match(kind, tmp_path):
    """Sailor's RTX-2080 machines have 11 GiB (its basic_cluster_config.json): RTX 2080 Ti cards. Its
    profiles load as rtx-2080-ti; a plan naming RTX-2080 imports onto rtx-2080-ti nodes, and onto a
    cluster that still names its cards rtx-2080, and exports back as RTX-2080."""
    from hethub.interop.sailor import read_sailor_profile
    from hethub.spec.cluster import Cluster, Link, NodeGroup
    from hethub.spec.kind import catalog

    assert catalog()["rtx-2080-ti"].mem_bytes > 10e9 > catalog()["rtx-2080"].mem_bytes
    model = tiny_model()
    f = tmp_path / "OPT-350" / "RTX-2080" / "profile.json"
    f.parent.mkdir(parents=True)
    data = {"1": {"1": {str(i): [1e-3, 2e-3, 1e-4] for i in range(model.num_layers + 2)}}}
    assert read_sailor_profile(f, data=data, model=model, seq_len=32).profile.kind == "rtx-2080-ti"
    cluster = Cluster(name="turing", kinds={kind: catalog()[kind]}, groups=(NodeGroup(kind, 1, 2),),
                      inter_node=Link(12.5e9, 1e-5), cross_kind=Link(5e9, 5e-5))
    plan_in = _sailor([(list(range(model.num_layers + 2)), [[[["RTX-2080", 2, "z"]], 2]])], dp=1, gbs=2)
    plan = import_sailor_plan(plan_in, cluster=cluster, model=model, seq_len=32)
    assert [s.kind for s in plan.pipelines[0].stages] == [kind]
    assert export_sailor_plan(plan)["pipeline_list"][0]["tmp_per_stage"][0][0][0][0][0] == "RTX-2080"


@pytest.mark.parametrize(("change", "match"), [
    (lambda d: d.update(gbs=0), "'gbs'"),
    (lambda d: d["pipeline_list"][0].update(dp=[2, 1]), r"'pipeline_list\[0\].dp'"),
    (lambda d: d["pipeline_list"][0]["layers_per_stage"][1].pop(), "layers_per_stage"),
    (lambda d: d["pipeline_list"][0]["tmp_per_stage"][0][0].__setitem__(1, 0), r"tmp_per_stage\[0\]\[0\]\[1\]"),
    (lambda d: d.pop("mbs"), "'mbs'"),
    (lambda d: d.update(pipeline_list=[]), "non-empty"),
])
def test_malformed_sailor_plan(change, match):
    data = _sailor([([0, 1, 2, 3], [[[["fast", 2, "z"]], 1]]), ([4, 5, 6, 7], [[[["slow", 2, "z"]], 1]])], dp=2)
    change(data)
    with pytest.raises(PlanError, match=match):
        import_sailor_plan(data, cluster=small_cluster(), model=tiny_model(), seq_len=32)


def _plan(shares=(2, 2), splits=(3, 3), mbs=(1, 1), recompute=False) -> Plan:
    pipes = tuple(Pipeline(m, n, (Stage("fast", (i,), (0, s), embedding=True, recompute=recompute),
                                  Stage("slow", (4 + i,), (s, 6), head=True)))
                  for i, (n, s, m) in enumerate(zip(shares, splits, mbs, strict=True)))
    return Plan(model=tiny_model(), cluster=small_cluster(), global_batch=sum(p.num_samples for p in pipes),
                seq_len=32, pipelines=pipes).validate()


@pytest.mark.parametrize(("plan", "reason"), [
    (lambda: _plan(shares=(3, 1)), "unequal batch shares"),
    (lambda: _plan(mbs=(1, 2), shares=(2, 1)), "different micro-batch sizes"),
    (lambda: _plan(recompute=True), "recompute"),
])
def test_unexportable_plans_say_why(plan, reason):
    with pytest.raises(PlanError, match=f"cannot write this plan in Sailor's format: .*{reason}"):
        export_sailor_plan(plan())


def test_plan_model_from_file_if_named():
    assert sailor_plan_model({"mbs": 1}) is None
    assert sailor_plan_model({"model": "OPT-350"}) == PRESETS["opt-350m"]
    with pytest.raises(PlanError, match="--model"):
        sailor_plan_model({"model": "GPT-5"})


def test_prediction_uses_sailor_profiles():
    from hethub.predict.predictor import predict

    plan = _import_example()
    files = [PROFILES / "OPT-350" / g / "profile.json" for g in ("A100-40", "V100-16")]
    with_profiles = predict(plan, profiles=load_profiles(files, model=plan.model, seq_len=plan.seq_len))
    assert with_profiles.compute_sources == {"v100-16gb": "profile", "a100-40gb": "profile"}
    # Without profiles: the operator model. Sailor's runs were fp32/TF32, so a bf16 plan has its
    # shape, memory and launch numbers fitted there; A100's bf16 GEMM and attention efficiencies come
    # from cited public measurements (predict/cited.py), V100's fp16 GEMM efficiency is assumed; an
    # fp32 plan is calibrated throughout.
    assert plan.precision == "fp32"  # an imported Sailor plan records what Sailor's runs used
    # (V100 has no bf16 units: a bf16-mixed plan runs fp16-mixed there, the catalog's first precision.)
    src = predict(replace(plan, precision="bf16-mixed")).compute_sources
    assert src["a100-40gb"].startswith("analytic, calibrated on MAMF table, Sailor profiles"), src
    assert src["v100-16gb"].startswith("analytic, partly calibrated on Sailor profiles"), src
    assert src["v100-16gb"].endswith("(gemm_eff 0.8 assumed)"), src
    fp32 = predict(plan).compute_sources
    assert fp32["v100-16gb"].startswith("analytic, calibrated on Sailor profiles") and "V100-16" in fp32["v100-16gb"]


def test_gbs_is_rounded_up_per_replica_as_sailor_does():
    # 7 sequences over 2 replicas of micro-batch 1: Sailor's simulator runs ceil(7 / 2) = 4 each.
    data = _sailor([([0, 1, 2, 3], [[[["fast", 1, "z"]], 1]] * 2), ([4, 5, 6, 7], [[[["slow", 1, "z"]], 1]] * 2)],
                   dp=2, gbs=7)
    plan = import_sailor_plan(data, cluster=small_cluster(), model=tiny_model(), seq_len=32)
    assert [p.num_micro_batches for p in plan.pipelines] == [4, 4] and plan.global_batch == 8
    assert plan.meta["sailor"]["gbs"] == 7 and "ceil" in plan.meta["sailor"]["note"]
    assert export_sailor_plan(plan)["gbs"] == 7  # the file's own gbs, which Sailor rounds the same way


def test_sailor_planner_style_plan_with_two_entries_imports():
    # gbs 1024, dp 10, mbs 4, two pipeline_list entries (Sailor's simulator runs both as one plan).
    def entry(split: int) -> dict:
        return {"num_stages": 2, "layers_per_stage": [list(range(0, split + 1)), list(range(split + 1, 8))],
                "tmp_per_stage": [[[[["fast", 1, "z"]], 1]] * 10, [[[["slow", 1, "z"]], 1]] * 10], "dp": [10, 10]}

    data = {"pipeline_list": [entry(3), entry(4)], "mbs": 4, "gbs": 1024}
    plan = import_sailor_plan(data, cluster=small_cluster(fast=20, slow=20), model=tiny_model(), seq_len=32)
    assert len(plan.pipelines) == 20 and plan.world_size == 40
    assert {p.stages[0].layers for p in plan.pipelines[:10]} == {(0, 3)}
    assert {p.stages[0].layers for p in plan.pipelines[10:]} == {(0, 4)}
    # ceil(1024 / (4 x 10 x 2)) = 13 micro-batches per replica: 13 x 4 x 20 = 1040 sequences.
    assert {p.num_micro_batches for p in plan.pipelines} == {13} and plan.global_batch == 1040
    assert export_sailor_plan(plan) == data


def test_k_replicas_export_as_k_entries_and_different_splits_as_separate_pipelines():
    plan = _plan(shares=(2, 2), splits=(3, 4))
    out = export_sailor_plan(plan)
    assert len(out["pipeline_list"]) == 2 and all(e["dp"] == [1, 1] for e in out["pipeline_list"])
    back = import_sailor_plan(out, cluster=plan.cluster, model=plan.model, seq_len=32)
    assert _shape(back) == _shape(plan)
    for k in (1, 2, 3, 4):
        out = export_sailor_plan(_plan(shares=(2,) * k, splits=(3,) * k, mbs=(1,) * k))
        assert [len(t) for t in out["pipeline_list"][0]["tmp_per_stage"]] == [k, k]


def test_unequal_shares_export_as_the_nearest_equal_plan_on_request():
    plan = _plan(shares=(3, 2))
    with pytest.raises(PlanError, match="nearest_equal=True"):
        export_sailor_plan(plan)
    out = export_sailor_plan(plan, nearest_equal=True)
    back = import_sailor_plan(out, cluster=plan.cluster, model=plan.model, seq_len=32)
    assert {p.num_micro_batches for p in back.pipelines} == {2} and out["gbs"] == 4  # mean 2.5 rounds to 2
