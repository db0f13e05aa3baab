"""The commands as a user types them (in-process through hethub.cli.main)."""

import json

import pytest

from conftest import EXAMPLES, SAILOR_DATA, two_stage_plan
from hethub import cli
from hethub.plan import Pipeline, Plan, Stage
from hethub.spec.cluster import load_cluster
from hethub.spec.model import get_model


def run(argv, capsys) -> tuple[int, str, str]:
    code = cli.main([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_plan_then_predict_agree(tmp_path, capsys):
    plan_path = tmp_path / "plan.json"
    # ZB-H1 is what the default (auto) schedule chooses here, the same plan: naming it spares the
    # other schedules' searches (~7 of 11 CPU s); the auto choice is the README tour's and test_zero_bubble's.
    code, out, _ = run(["plan", "--cluster", EXAMPLES / "a100-v100-32.toml", "--model", "llama-2-7b",
                        "--global-batch", "64", "--seq-len", "2048", "--schedule", "zb-h1", "--json",
                        "--out", plan_path], capsys)
    assert code == 0
    planned = json.loads(out)
    for key in ("tokens_per_s", "step_time_s", "upper_bound_tokens_per_s", "efficiency", "search_time_s",
                "feasible", "peak_mem_bytes_by_kind", "kinds_alone_tokens_per_s", "vs_kinds_alone", "mfu"):
        assert key in planned
    assert 0 < planned["efficiency"] <= 1 and 0 < planned["mfu"] <= 1
    assert planned["vs_kinds_alone"] == pytest.approx(planned["tokens_per_s"] / planned["kinds_alone_tokens_per_s"])
    assert planned["feasible"] is True
    code, out, _ = run(["predict", "--plan", plan_path, "--json"], capsys)
    assert code == 0
    pred = json.loads(out)
    assert pred["step_time_s"] == planned["step_time_s"]
    # What the predictor says about itself: per stage where the step goes, MFU per kind, sources.
    for st in pred["stages"]:
        parts = st["step_breakdown_s"]
        assert sum(parts.values()) == pytest.approx(pred["step_time_s"])
    assert set(pred["mfu_by_kind"]) == {"a100-40gb", "v100-16gb", "all"}
    assert all(0 < v < 1 for v in pred["mfu_by_kind"].values())
    assert pred["sources"]["compute"]["a100-40gb"].startswith("analytic, calibrated on MAMF table, Sailor profiles")
    # every efficiency the op model used, per kind, with its value and where it comes from
    numbers = pred["sources"]["calibration"]["v100-16gb"]["numbers"]
    assert numbers["gemm_eff"] == {"value": 0.8, "source": "assumed default"}
    k_half = numbers["gemm_k_half"]["source"]
    assert k_half.startswith("Sailor profiles") and "V100-16" in k_half
    code, out, _ = run(["predict", "--plan", plan_path], capsys)
    assert "predicted step time" in out and "a100-40gb" in out
    assert "partly calibrated: v100-16gb: gemm_eff 0.8 assumed" in out  # the text says what is assumed too


def test_compare_prints_every_strategy_with_speedups(capsys):
    code, out, _ = run(["plan", "--cluster", EXAMPLES / "local-cpu.toml", "--model", "tiny", "--global-batch", "8",
                        "--seq-len", "32", "--precision", "fp32", "--compare", "--json"], capsys)
    assert code == 0
    rows = {r["strategy"]: r for r in json.loads(out)}
    # With the schedule left to the planner (the default), hethub also under each candidate schedule.
    # With optimizer sharding left to the planner (the default), hethub's best unsharded plan too, and
    # its best plan without sequence parallelism.
    assert set(rows) == {"hethub", "hethub (no SP)", "hethub (no sharding)", "hethub (1f1b)", "hethub (zb-h1)",
                         "hethub (interleaved)", "uniform",
                         "flops-proportional", "homogeneous"}
    assert rows["hethub"]["step_time_s"] <= rows["hethub (no SP)"]["step_time_s"] * (1 + 1e-9)
    assert rows["hethub"]["step_time_s"] == pytest.approx(min(rows["hethub (1f1b)"]["step_time_s"],
                                                              rows["hethub (zb-h1)"]["step_time_s"],
                                                              rows["hethub (interleaved)"]["step_time_s"]))
    assert rows["hethub (no sharding)"]["optimizer_sharding"] == "none"
    assert rows["hethub"]["step_time_s"] <= rows["hethub (no sharding)"]["step_time_s"] * (1 + 1e-9)
    assert rows["uniform"]["optimizer_sharding"] == "none"  # baselines are other systems' unsharded plans
    assert rows["uniform"]["speedup_over_uniform"] == pytest.approx(1.0)
    assert rows["hethub"]["tokens_per_s"] >= rows["homogeneous"]["tokens_per_s"] * 0.999


def test_sharded_plan_file_carries_its_split_at_the_planned_headroom(tmp_path, capsys):
    """`hethub plan --mem-headroom H` writes the ZeRO-1 split computed at H, which the runtime then
    makes (it no longer recomputes it at the default headroom)."""
    from dataclasses import replace

    from hethub.predict.predictor import optimizer_shard_weights, predict

    plan_path = tmp_path / "plan.json"
    code, out, _ = run(["plan", "--cluster", EXAMPLES / "a100-v100-32.toml", "--model", "llama-3-8b",
                        "--global-batch", "256", "--seq-len", "2048", "--schedule", "1f1b", "--optimizer-sharding",
                        "zero1", "--mem-headroom", "0.3", "--json", "--out", plan_path], capsys)
    assert code == 0
    plan = Plan.load(plan_path)
    assert json.loads(plan_path.read_text())["version"] == 7
    assert plan.optimizer_sharding == "zero1" and plan.shard_weights is not None
    assert plan.shard_weights.mem_headroom == 0.3
    bare = replace(plan, shard_weights=None)
    assert plan.rank_shard_weights() == optimizer_shard_weights(bare, mem_headroom=0.3)
    assert plan.rank_shard_weights() != optimizer_shard_weights(bare)  # what the runtime used to take
    # The file predicts as planned: the carried split is the one the planner scored.
    assert predict(plan, mem_headroom=0.3).step_time_s == json.loads(out)["step_time_s"]


def test_plan_zero1_on_one_replica_writes_a_plan_training_accepts(tmp_path, capsys):
    """`hethub plan --optimizer-sharding zero1` whose best plan has one replica (every parameter with a
    single holder) writes it unsharded and says so, as Megatron's distributed optimizer runs at
    data-parallel size 1, instead of a zero1 plan `hethub train` refuses (exit 3)."""
    from hethub.runtime.launch_checks import check_sharding

    plan_path = tmp_path / "plan.json"
    code, out, _ = run(["plan", "--cluster", EXAMPLES / "local-cpu.toml", "--model", "tiny", "--global-batch", "4",
                        "--seq-len", "64", "--optimizer-sharding", "zero1", "--out", plan_path],
                       capsys)
    assert code == 0
    plan = Plan.load(plan_path)
    assert len(plan.pipelines) == 1 and plan.optimizer_sharding == "none"
    assert "although zero1 was asked: the plan has one replica" in out
    check_sharding(plan, plan_path=str(plan_path))  # what `hethub train` checks first: no PlanError
    with pytest.raises(Exception, match="single data-parallel holder"):
        from dataclasses import replace

        check_sharding(replace(plan, optimizer_sharding="zero1"), plan_path=str(plan_path))


def test_report_command_writes_four_files(tmp_path, capsys):
    plan_path = tmp_path / "plan.json"
    two_stage_plan().save(plan_path)
    code, _, _ = run(["report", "--plan", plan_path, "--out", tmp_path / "rep"], capsys)
    assert code == 0
    for name in ("plan.png", "timeline.png", "trace.json", "summary.md"):
        assert (tmp_path / "rep" / name).stat().st_size > 100


def test_train_refuses_a_plan_that_does_not_fit_memory(tmp_path, capsys):
    cluster = load_cluster(EXAMPLES / "local-cpu.toml")
    model = get_model("llama-2-7b")  # 108 GB of training state on one 8 GB CPU "device"
    stage = Stage("cpu-fast", (0,), (0, model.num_layers), embedding=True, head=True)
    plan = Plan(model=model, cluster=cluster, global_batch=1, seq_len=128, pipelines=(Pipeline(1, 1, (stage,)),))
    path = tmp_path / "big.json"
    plan.validate().save(path)
    code, _, err = run(["train", "--plan", path, "--steps", "1"], capsys)
    assert code == 4
    assert "pipelines[0].stages[0]" in err and "cpu-fast" in err and "GiB" in err and "Fix:" in err
    assert "Traceback" not in err


def test_sailor_plan_imports_predicts_and_exports_back(tmp_path, capsys):
    src = SAILOR_DATA / "example-plan-opt350-a100-v100.json"
    plan_path = tmp_path / "plan.json"
    code, out, err = run(["import-plan", "--format", "sailor", src, "--cluster", EXAMPLES / "a100-v100-32.toml",
                          "--model", "opt-350m", "--out", plan_path], capsys)
    assert code == 0, err
    assert "note: p2p set to lockstep" in out and "DeepSpeed" in out
    code, out, _ = run(["predict", "--plan", plan_path, "--json", "--profiles",
                        SAILOR_DATA / "profiles" / "OPT-350"], capsys)
    assert code == 0
    assert set(json.loads(out)["compute_sources"].values()) == {"profile"}
    assert json.loads(out)["p2p"] == "lockstep"
    back = tmp_path / "back.json"
    code, _, _ = run(["export-plan", "--format", "sailor", plan_path, "--out", back], capsys)
    assert code == 0
    original = json.loads(src.read_text())
    exported = json.loads(back.read_text())
    for key in ("mbs", "gbs"):
        assert exported[key] == original[key]
    assert exported["pipeline_list"][0]["layers_per_stage"] == original["pipeline_list"][0]["layers_per_stage"]


def test_export_refuses_unequal_shares_with_the_reason(tmp_path, capsys):
    base = two_stage_plan()
    p = base.pipelines[0]
    a = Pipeline(1, 6, (Stage("fast", (0,), (0, 4), embedding=True), Stage("slow", (4,), (4, 6), head=True)))
    b = Pipeline(1, 2, (Stage("fast", (1,), (0, 4), embedding=True), Stage("slow", (5,), (4, 6), head=True)))
    plan = Plan(model=base.model, cluster=base.cluster, global_batch=p.num_samples, seq_len=32, pipelines=(a, b))
    path = tmp_path / "uneven.json"
    plan.validate().save(path)
    code, _, err = run(["export-plan", "--format", "sailor", path], capsys)
    assert code == 3
    assert "unequal" in err.lower() or "share" in err.lower()


def test_report_of_a_run_predicts_hethubs_async_sends_whatever_the_plan_says(tmp_path, capsys):
    # A lockstep plan (as imported from Sailor) trained by hethub's runtime: the run's metrics are
    # compared with the async prediction, the runtime that produced them.
    from dataclasses import replace

    from conftest import three_stage_plan
    from hethub.predict.predictor import predict
    from hethub.report.summary import fmt_time

    plan = replace(three_stage_plan(), p2p="lockstep").validate()
    assert fmt_time(predict(plan).step_time_s) != fmt_time(predict(replace(plan, p2p="async")).step_time_s)
    plan_path, metrics = tmp_path / "plan.json", tmp_path / "run.jsonl"
    plan.save(plan_path)
    metrics.write_text("".join(json.dumps({"step": s, "loss": 1.0, "step_time_s": 0.5}) + "\n" for s in range(3)))
    code, out, _ = run(["report", "--plan", plan_path, "--metrics", metrics, "--out", tmp_path / "rep"], capsys)
    assert code == 0
    assert "training.p2p = 'lockstep'" in out and "'async' sends" in out
    summary = (tmp_path / "rep" / "summary.md").read_text(encoding="utf-8")
    assert f"| step time | {fmt_time(predict(replace(plan, p2p='async')).step_time_s)} |" in summary
