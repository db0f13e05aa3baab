"""hethub.report: plan.png, timeline.png, trace.json, summary.md, and the measured-metrics reader."""

import itertools
import json
import struct
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

from hethub.errors import PlanError
from hethub.plan import Pipeline, Plan, Stage
from hethub.predict.result import Event, Prediction, StagePrediction
from hethub.report import read_metrics, write_report
from hethub.report.groups import stage_rows
from hethub.spec.cluster import Cluster, Link, NodeGroup, load_cluster
from hethub.spec.kind import DeviceKind
from hethub.spec.model import PRESETS, ModelSpec

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "clusters"


# ---- fixtures built by hand ------------------------------------------------------------------------
def small_cluster() -> Cluster:
    def kind(name: str, flops: float, mem_gb: float) -> DeviceKind:
        return DeviceKind(name=name, vendor="test", mem_bytes=int(mem_gb * 1e9), peak_flops=flops,
                          intra_node_bw_bytes_per_s=100e9, intra_node_latency_s=5e-6)

    return Cluster(name="small", kinds={"fast": kind("fast", 100e12, 40), "slow": kind("slow", 40e12, 16)},
                   groups=(NodeGroup("fast", 2, 2), NodeGroup("slow", 2, 2)), inter_node=Link(12.5e9, 1e-5),
                   cross_kind=Link(5e9, 5e-5))


def tiny_model() -> ModelSpec:
    return ModelSpec(name="t", num_layers=6, hidden_size=64, num_heads=4, num_kv_heads=2, ffn_hidden_size=128,
                     vocab_size=256, max_seq_len=64)


def two_rank_plan(**meta: float) -> Plan:
    """One pipeline, two stages of TP 1 on devices 0 (fast) and 4 (slow): ranks 0 and 1."""
    stages = (Stage("fast", (0,), (0, 4), embedding=True), Stage("slow", (4,), (4, 6), head=True))
    return Plan(model=tiny_model(), cluster=small_cluster(), global_batch=8, seq_len=32,
                pipelines=(Pipeline(2, 4, stages),), meta=dict(meta)).validate()


def mixed_plan() -> Plan:
    """Two different pipelines with TP 2 stages, leaving devices 3 and 5 idle."""
    p0 = Pipeline(2, 4, (Stage("fast", (0, 1), (0, 3), embedding=True), Stage("slow", (4,), (3, 6), head=True)))
    p1 = Pipeline(2, 2, (Stage("fast", (2,), (0, 4), embedding=True), Stage("slow", (6, 7), (4, 6), head=True)))
    return Plan(model=tiny_model(), cluster=small_cluster(), global_batch=12, seq_len=32,
                pipelines=(p0, p1)).validate()


def hand_prediction(plan: Plan, *, layer_s: float = 0.01, p2p_s: float = 0.004) -> Prediction:
    """A GPipe-like timeline: p2p sends overlap the next compute (and each other when p2p_s is long)."""
    stages, events, ends = [], [], []
    for pi, p in enumerate(plan.pipelines):
        n, m = len(p.stages), p.num_micro_batches
        f = [max(s.num_layers, 1) * layer_s * 1e14 / plan.cluster.kinds[s.kind].peak_flops / s.tp for s in p.stages]
        fend = [[0.0] * m for _ in range(n)]
        bend = [[0.0] * m for _ in range(n)]
        for s in range(n):
            for i in range(m):
                fend[s][i] = max(fend[s - 1][i] + p2p_s if s else 0.0, fend[s][i - 1] if i else 0.0) + f[s]
        for s in reversed(range(n)):
            for i in range(m):
                ready = bend[s + 1][i] + p2p_s if s < n - 1 else 0.0
                bend[s][i] = max(ready, bend[s][i - 1] if i else fend[s][m - 1]) + 2 * f[s]
        for si, st in enumerate(p.stages):
            cap = plan.cluster.kinds[st.kind].mem_bytes * 0.92
            share = 0.3 if si == 0 else 0.25  # stage 1 ends up over capacity: the pictures must flag it
            stages.append(StagePrediction(
                pipeline=pi, stage=si, kind=st.kind, devices=st.devices, layers=st.layers, tp=st.tp,
                fwd_s=f[si], bwd_s=2 * f[si], update_s=0.002, p2p_s=p2p_s, sync_s=0.01, weights_bytes=share * cap,
                grads_bytes=share * cap, optimizer_bytes=2 * share * cap, activations_bytes=0.1 * cap,
                capacity_bytes=cap, compute_source="hand"))
            sync_start = bend[si][m - 1]
            for d in st.devices:
                for i in range(m):
                    events.append(Event(d, "forward", f"F{i}", fend[si][i] - f[si], fend[si][i], pi, si, i))
                    if si < n - 1:
                        events.append(Event(d, "p2p", f"send act {i}", fend[si][i], fend[si][i] + p2p_s, pi, si, i))
                    events.append(Event(d, "backward", f"B{i}", bend[si][i] - 2 * f[si], bend[si][i], pi, si, i))
                    if si > 0:
                        events.append(Event(d, "p2p", f"send grad {i}", bend[si][i], bend[si][i] + p2p_s, pi, si, i))
                events.append(Event(d, "allreduce", "allreduce grads", sync_start, sync_start + 0.01, pi, si))
                events.append(Event(d, "optimizer", "optimizer", sync_start + 0.01, sync_start + 0.012, pi, si))
            ends.append(sync_start + 0.012)
    step = max(ends)
    return Prediction(step_time_s=step, tokens_per_s=plan.tokens_per_step / step, pipeline_times_s=(step,),
                      stages=tuple(stages), timeline=tuple(events),
                      model_flops_per_step=plan.model.train_flops_per_token(seq_len=plan.seq_len)
                      * plan.tokens_per_step)


def write_metrics(path: Path, plan: Plan, prediction: Prediction, *, scale: float = 1.25) -> Path:
    """A synthetic run: 3 steps, junk, an older per-rank record, and the last step's events per rank."""
    rank = plan.rank_of_device()
    per_rank: dict[int, list[dict]] = defaultdict(list)
    for e in prediction.timeline:
        per_rank[rank[e.device]].append({"name": e.name, "category": e.category, "start_s": e.start_s * scale,
                                         "end_s": e.end_s * scale, "micro_batch": e.micro_batch})
    step_s = prediction.step_time_s * scale
    lines = [json.dumps({"step": s, "loss": 5.0 - s, "step_time_s": step_s * (3 if s == 0 else 1),
                         "tokens_per_s": plan.tokens_per_step / step_s}) for s in range(3)]
    lines.insert(1, "{not json")
    lines.append(json.dumps({"step": 1, "rank": 0, "events": [{"name": "F", "start_s": 0.0, "end_s": 9.0}]}))
    lines.append(json.dumps({"step": 2, "ranks": [{"rank": r, "events": evs} for r, evs in per_rank.items()]}))
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


# ---- checks ------------------------------------------------------------------------------------------
def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    assert data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    assert 400 <= width <= 5000 and 150 <= height <= 5000, (width, height)
    assert len(data) > 5_000
    return width, height


def check_trace(path: Path) -> list[dict]:
    doc = json.loads(path.read_text(encoding="utf-8"))
    xs = [e for e in doc["traceEvents"] if e.get("ph") == "X"]
    assert xs
    lanes: dict[tuple[int, int], list[tuple[float, float]]] = defaultdict(list)
    for e in xs:
        assert {"name", "ph", "ts", "dur", "pid", "tid"} <= e.keys(), e
        # No `dur >= 0`: report/trace.py clamps it at 0, so that check could not fail.
        assert isinstance(e["ts"], int | float) and isinstance(e["dur"], int | float)
        assert isinstance(e["pid"], int) and isinstance(e["tid"], int) and isinstance(e["name"], str)
        lanes[(e["pid"], e["tid"])].append((e["ts"], e["ts"] + e["dur"]))
    for lane, spans in lanes.items():
        spans.sort()
        for (_, end), (start, _) in itertools.pairwise(spans):
            assert end <= start, f"events overlap on (pid, tid) {lane}"
    for e in doc["traceEvents"]:
        assert e["ph"] in ("X", "M")
    return xs


def test_report_of_hand_prediction_with_measured_two_ranks(tmp_path: Path) -> None:
    plan = two_rank_plan(upper_bound_tokens_per_s=1e6)
    pred = hand_prediction(plan)
    metrics = write_metrics(tmp_path / "run.jsonl", plan, pred)
    paths = write_report(plan=plan, prediction=pred, out_dir=tmp_path / "out", metrics_path=metrics)
    png_size(paths.plan_png)
    w, _ = png_size(paths.timeline_png)
    w_alone, _ = png_size(write_report(plan=plan, prediction=pred, out_dir=tmp_path / "alone").timeline_png)
    assert w > w_alone * 1.5  # the measured panel is drawn beside the predicted one
    xs = check_trace(paths.trace_json)
    assert {e["pid"] for e in xs} == {0, 1000}  # predicted pipeline 0, measured pipeline 0
    # p2p sends overlap the next forward, so they must sit on another thread than compute
    p2p_tids = {e["tid"] for e in xs if e["cat"] == "p2p"}
    assert p2p_tids.isdisjoint({e["tid"] for e in xs if e["cat"] in ("forward", "backward")})
    md = paths.summary_md.read_text(encoding="utf-8")
    assert "1.25×" in md and "of the upper bound" in md and "measured (step 2)" in md
    assert "| fast |" in md and "| slow |" in md and "**no**" in md
    assert "line 2: not JSON" in md


def test_report_without_upper_bound_or_metrics_says_so(tmp_path: Path) -> None:
    plan = mixed_plan()
    paths = write_report(plan=plan, prediction=hand_prediction(plan), out_dir=tmp_path)
    md = paths.summary_md.read_text(encoding="utf-8")
    assert "upper bound is not known" in md
    assert "| step time |" in md and "—" in md
    png_size(paths.plan_png)
    png_size(paths.timeline_png)
    check_trace(paths.trace_json)


def test_long_p2p_spills_into_extra_lanes_without_overlap(tmp_path: Path) -> None:
    plan = mixed_plan()
    pred = hand_prediction(plan, layer_s=0.001, p2p_s=0.05)  # sends far longer than compute
    paths = write_report(plan=plan, prediction=pred, out_dir=tmp_path)
    xs = check_trace(paths.trace_json)
    assert len({(e["pid"], e["tid"]) for e in xs if e["cat"] == "p2p"}) > 4


def test_prediction_without_timeline_still_renders(tmp_path: Path) -> None:
    plan = two_rank_plan()
    pred = hand_prediction(plan)
    bare = Prediction(step_time_s=pred.step_time_s, tokens_per_s=pred.tokens_per_s,
                      pipeline_times_s=pred.pipeline_times_s, stages=pred.stages)
    paths = write_report(plan=plan, prediction=bare, out_dir=tmp_path)
    png_size(paths.timeline_png)
    assert "no timeline" in paths.summary_md.read_text(encoding="utf-8")


def test_metrics_reader_takes_last_step_with_ranks_and_skips_junk(tmp_path: Path) -> None:
    plan = two_rank_plan()
    pred = hand_prediction(plan)
    path = write_metrics(tmp_path / "run.jsonl", plan, pred, scale=2.0)
    with path.open("a", encoding="utf-8") as f:
        f.write(json.dumps({"step": 3, "step_time_s": 1.0}) + "\n")
        f.write(json.dumps({"step": 3, "rank": 1, "events": [{"name": "B", "start_s": 1, "end_s": 0}]}) + "\n")
        f.write('{"step": 4, "step_ti')  # cut short by the failure that ended the run
    run = read_metrics(path, plan=plan)
    assert run.step_times_s[-1] == 1.0 and len(run.step_times_s) == 4
    assert run.timeline_step == 3  # the last step with per-rank records wins, even a bad one
    assert run.events == {1: ()}
    assert any("not JSON" in w for w in run.warnings) and any("start_s <= end_s" in w for w in run.warnings)
    with path.open("a", encoding="utf-8") as f:  # a rank the plan does not have: another plan's metrics
        f.write("\n" + json.dumps({"step": 5, "rank": 7, "events": []}) + "\n")
    with pytest.raises(PlanError, match=r"run.jsonl' line \d+: field 'rank' is 7, the plan has ranks 0..1"):
        read_metrics(path, plan=plan)
    run2 = read_metrics(write_metrics(tmp_path / "b.jsonl", plan, pred, scale=2.0), plan=plan)
    assert run2.timeline_step == 2 and set(run2.events) == {0, 1}
    assert {e.device for e in run2.events[1]} == {4} and {e.stage for e in run2.events[1]} == {1}
    assert run2.typical_step_time_s == pytest.approx(pred.step_time_s * 2.0)  # first (slow) step left out


def test_report_package_does_not_import_torch() -> None:
    # A fresh interpreter: other tests in this session may have imported torch themselves.
    code = "import sys, hethub.report, hethub.report.writer; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_report_with_the_real_predictor(tmp_path: Path) -> None:
    predictor = pytest.importorskip("hethub.predict.predictor")
    plan = mixed_plan()
    pred = predictor.predict(plan, timeline=True)
    assert pred.timeline
    paths = write_report(plan=plan, prediction=pred, out_dir=tmp_path)
    png_size(paths.plan_png)
    png_size(paths.timeline_png)
    check_trace(paths.trace_json)


# ---- the paper's 768-device cluster --------------------------------------------------------------------
def hethub_768_plan() -> Plan:
    """Kind-pure pipelines: 4 x (4 stages x TP 8) of mi250x, 16 x (5 stages x TP 8) of gpu-b."""
    cluster = load_cluster(EXAMPLES / "hethub-768.toml")
    pipes = []
    for kind, splits, nmb in (("mi250x", (0, 23, 46, 68, 90), 16), ("gpu-b", (0, 18, 36, 54, 72, 90), 24)):
        devs = [d.id for d in cluster.devices_of_kind(kind)]
        n = len(splits) - 1
        for i in range(0, len(devs), 8 * n):
            pipes.append(Pipeline(1, nmb, tuple(
                Stage(kind, tuple(devs[i + 8 * s:i + 8 * s + 8]), (splits[s], splits[s + 1]), embedding=s == 0,
                      head=s == n - 1, recompute=True) for s in range(n))))
    return Plan(model=PRESETS["llama-140b"], cluster=cluster, global_batch=sum(p.num_samples for p in pipes),
                seq_len=4096, pipelines=tuple(pipes)).validate()


def test_768_device_pictures_are_aggregated_and_quick(tmp_path: Path) -> None:
    plan = hethub_768_plan()
    assert plan.world_size == 768
    pred = hand_prediction(plan, layer_s=0.02, p2p_s=0.01)
    assert len({e.device for e in pred.timeline}) == 768
    rows = stage_rows(plan)
    assert len(rows) == 9 and rows[4].replicas == tuple(range(4, 20))  # 2 distinct pipeline shapes
    paths = write_report(plan=plan, prediction=pred, out_dir=tmp_path)
    _, ph = png_size(paths.plan_png)
    _, th = png_size(paths.timeline_png)
    assert ph < 2000 and th < 1500  # one row per stage shape, not per device
    check_trace(paths.trace_json)
    assert "16× p4–19" in paths.summary_md.read_text(encoding="utf-8")
