"""hethub plan --runtime as a user types it: a plan for DeepSpeed's engine goes to Sailor's format and
back; forcing what the runtime cannot run, or exporting ZeRO to Sailor, says what and how to fix it."""

import json

from conftest import EXAMPLES
from hethub import cli

CLUSTER = EXAMPLES / "a100-v100-32.toml"
JOB = ["--cluster", CLUSTER, "--model", "opt-350m", "--global-batch", "256", "--seq-len", "2048"]


def run(argv, capsys) -> tuple[int, str, str]:
    code = cli.main([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_deepspeed_plan_exports_to_sailor_and_imports_back(tmp_path, capsys):
    plan, sailor, back = tmp_path / "plan.json", tmp_path / "sailor.json", tmp_path / "back.json"
    code, out, _ = run(["plan", *JOB, "--runtime", "deepspeed", "--optimizer-sharding", "none", "--json",
                        "--out", plan], capsys)
    planned = json.loads(out)
    assert code == 0 and planned["runtime"] == "deepspeed"
    assert any("no activation recomputation planned" in n for n in planned["notes"])  # said, not narrowed quietly
    code, _, err = run(["export-plan", "--format", "sailor", plan, "--out", sailor], capsys)
    assert code == 0, err
    code, _, err = run(["import-plan", "--format", "sailor", sailor, "--cluster", CLUSTER, "--model", "opt-350m",
                        "--out", back], capsys)
    assert code == 0, err

    def shape(path):
        d = json.loads(path.read_text())
        return sorted((p["micro_batch_size"], p["num_micro_batches"],
                       [(s["kind"], s["tp"], s["layers"]) for s in p["stages"]]) for p in d["pipelines"])

    assert shape(back) == shape(plan)


def test_forcing_a_schedule_deepspeed_cannot_run_names_the_option(capsys):
    code, _, err = run(["plan", *JOB, "--runtime", "deepspeed", "--schedule", "zb-h1"], capsys)
    assert code == 2
    assert "'schedule' is 'zb-h1'" in err and "deepspeed" in err and "Fix: use --schedule 1f1b" in err


def test_sailor_export_of_a_zero1_plan_names_zero(tmp_path, capsys):
    plan = tmp_path / "zero.json"
    code, _, _ = run(["plan", *JOB, "--runtime", "deepspeed", "--optimizer-sharding", "zero1", "--out", plan], capsys)
    assert code == 0
    assert json.loads(plan.read_text())["training"]["optimizer_sharding"] == "zero1"
    code, _, err = run(["export-plan", "--format", "sailor", plan], capsys)
    assert code == 3 and "ZeRO-1" in err and "--optimizer-sharding none" in err


def test_a_deepspeed_plan_sailor_cannot_take_says_so_and_how(tmp_path, capsys):
    # DeepSpeed's engine runs ZeRO-1, so the default sharding may choose it; Sailor's format cannot say it.
    # The plan's notes then carry the export's refusal and its fix, exactly where the export refuses.
    for sharding in ("auto", "none"):
        plan = tmp_path / f"{sharding}.json"
        code, out, _ = run(["plan", *JOB, "--runtime", "deepspeed", "--optimizer-sharding", sharding, "--json",
                            "--out", plan], capsys)
        assert code == 0
        said = [n for n in json.loads(out)["notes"] if "Sailor's format" in n]
        code, _, err = run(["export-plan", "--format", "sailor", plan], capsys)
        assert (code == 3) == bool(said), (sharding, said, err)
        if said:
            assert "ZeRO" in said[0] and "--optimizer-sharding none" in said[0]
