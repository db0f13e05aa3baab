"""The real entry point: ``torchrun -m hethub.train`` on a 2-rank plan, and its launch checks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _harness import F, S, make_plan

from hethub import train
from hethub.runtime.launch import launch_local


@pytest.mark.slow
def test_torchrun_two_ranks_writes_metrics(tmp_path: Path) -> None:
    plan = make_plan([(2, 2, [(F, 1, 4), (S, 1, 2)])])
    plan.save(tmp_path / "plan.json")
    metrics = tmp_path / "m.jsonl"
    proc = launch_local(tmp_path / "plan.json", nproc=2, steps=2, metrics=metrics, capture=True, timeout_s=120,
                        extra_args=["--timeout-s", "60", "--trace"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    recs = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in recs] == [0, 1]
    for r in recs:
        assert r["loss"] > 0 and r["step_time_s"] > 0 and r["tokens_per_s"] > 0
        assert r["tokens"] == plan.tokens_per_step
        assert r["emulated"] is True and r["kinds"][S]["emulated"] and not r["kinds"][F]["emulated"]
        assert r["kinds"][F]["achieved_flops_per_s"] > 0
        assert sorted(x["rank"] for x in r["ranks"]) == [0, 1]
        for x in r["ranks"]:
            ops = [(e["op"], e["mb"]) for e in x["events"] if e["op"] in ("F", "B")]
            assert sorted(ops) == [("B", 0), ("B", 1), ("F", 0), ("F", 1)]
            # Gradient sync then the optimizer close the step, after the last backward.
            tail = [e for e in x["events"] if e["op"] not in ("F", "B")]
            assert [e["op"] for e in tail] == ["sync", "optim"]
            assert tail[0]["start_s"] >= max(e["end_s"] for e in x["events"] if e["op"] == "B") - 1e-6
            assert all(0 <= e["start_s"] <= e["end_s"] for e in x["events"])
        slow = next(x for x in r["ranks"] if x["kind"] == S)
        assert slow["emulated_sleep_s"] > 0
    assert "loss" in proc.stdout
    _report_from_real_metrics(plan, metrics, tmp_path / "report")


def _report_from_real_metrics(plan, metrics: Path, out: Path) -> None:
    """The report draws the measured timeline of this real run beside the prediction."""
    from hethub.predict.predictor import predict
    from hethub.report import read_metrics, write_report

    paths = write_report(plan=plan, prediction=predict(plan, timeline=True), out_dir=out, metrics_path=metrics)
    for p in (paths.plan_png, paths.timeline_png, paths.trace_json, paths.summary_md):
        assert Path(p).stat().st_size > 100
    run = read_metrics(metrics, plan=plan)
    assert sorted(run.events) == [0, 1] and all(run.events.values())
    trace = json.loads(Path(paths.trace_json).read_text())
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    measured = [e for e in events if e.get("ph") == "X" and e["pid"] >= 1000]
    assert measured, "the trace should hold the measured events"
    assert "measured" in Path(paths.summary_md).read_text()


def test_world_size_mismatch_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    make_plan([(2, 2, [(F, 1, 4), (S, 1, 2)])]).save(tmp_path / "plan.json")
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("RANK", "0")
    code = train.main(["--plan", str(tmp_path / "plan.json"), "--steps", "1"])
    assert code == 6
    err = capsys.readouterr().err
    assert "WORLD_SIZE=3" in err and "needs 2" in err and "--nproc-per-node 2" in err
