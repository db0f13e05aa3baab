"""The paper-scale report: `hethub report` of the 768-device plan (the search shared with
test_planner.py through conftest.plan_768; the README tour runs `hethub plan` on that cluster).

Identical replicas and TP peers are traced once, named with how many devices they stand for, and
the prediction builds events only for those devices; the trace stays far under 20 MB (it was 144 MB
with every device). Wall time is measured by bench/report_scale.py, not asserted here.
"""

from __future__ import annotations

import json

import pytest

from conftest import plan_768
from hethub import cli
from hethub.plan import Plan
from hethub.report.groups import stage_rows, timeline_devices


@pytest.mark.slow
@pytest.mark.xdist_group("plan_768")
def test_768_device_report_traces_each_stage_shape_once(tmp_path, capsys):
    plan_path, out = tmp_path / "p.json", tmp_path / "r"
    plan_768().plan.save(plan_path)
    assert cli.main(["report", "--plan", str(plan_path), "--out", str(out)]) == 0
    capsys.readouterr()
    plan = Plan.load(plan_path)
    rows = stage_rows(plan)
    trace = out / "trace.json"
    assert trace.stat().st_size < 20 * 2**20
    events = json.loads(trace.read_text())["traceEvents"]
    traced = {e["args"]["device"] for e in events if e["ph"] == "X"}
    assert traced == timeline_devices(plan) and len(traced) == len(rows) < plan.world_size
    names = [e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"]
    assert all("traced once for" in n for n in names)
    traced_for = sum(int(n.split("traced once for ")[1].split()[0]) for n in names if n.endswith("compute"))
    assert traced_for == plan.world_size  # every device the plan uses, each counted once
