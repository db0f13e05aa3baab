"""The GPU script is ready to run and skips cleanly where there is no GPU."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.mark.skipif(torch.cuda.is_available(), reason="this host has CUDA: the script would run its checks")
def test_gpu_check_skips_cleanly_without_cuda():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(BENCH.parent / "src"), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, str(BENCH / "gpu_check.py")], capture_output=True, text=True, env=env,
                          timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "skipped: no CUDA"


def test_gpu_check_plans_cover_what_the_issue_asks():
    sys.path.insert(0, str(BENCH))
    try:
        import gpu_check
    finally:
        sys.path.remove(str(BENCH))
    names = [n for n, _ in gpu_check.plans(gpus=2, cpu_only=False)]
    assert names[0].startswith("cuda-only") and "NCCL" in names[0]
    assert [n for n in names if n.startswith("cuda+cpu")] == ["cuda+cpu fp32", "cuda+cpu bf16-mixed",
                                                                 "cuda+cpu fp16-mixed"]
    for _, plan in gpu_check.plans(gpus=1, cpu_only=False):
        assert plan.cluster.kinds["gpu"].device_type == "cuda"


def test_gpu_check_runs_every_schedule_with_8_mib_bf16_messages():
    gpu_check = _import_bench("gpu_check")
    for gpus in (1, 2):
        plans = gpu_check.schedule_plans(gpus=gpus, cpu_only=False)
        assert {(p.schedule, p.pipelines[0].virtual_stages) for _, p in plans} == {
            ("1f1b", 1), ("gpipe", 1), ("zb-h1", 1), ("interleaved", 2)}
        for _, plan in plans:
            pipe = plan.pipelines[0]
            assert plan.precision == "bf16-mixed" and len(pipe.stages) == 2
            assert pipe.micro_batch_size * plan.seq_len * plan.model.hidden_size * 2 >= 8 * 2**20
            kinds = {s.kind for s in pipe.stages}
            assert kinds == ({"gpu"} if gpus == 2 else {"gpu", "host"})  # NCCL on 2 GPUs, else bridged


@pytest.mark.skipif(torch.cuda.is_available(), reason="this host has CUDA: --dry-run is for hosts without")
def test_gpu_check_dry_run_passes_on_cpu(tmp_path):
    """The script's plumbing on the CPU, the GPU kind emulated, with small messages: the bridge check
    and the schedule check for interleaved (both directions on one rank pair, the wrap hop); the
    other schedules and the 8 MiB messages are the script's own job on a GPU (their NCCL ordering is
    tests/unit/test_nccl_replay.py's)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(BENCH.parent / "src"), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, str(BENCH / "gpu_check.py"), "--dry-run", "--steps", "1",
                           "--schedules", "interleaved"],
                          capture_output=True, text=True, env=env, timeout=900, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[-1] == "PASS"
    assert any(x.startswith("cuda+cpu fp32") and " ok " in x for x in lines), proc.stdout
    assert [x.split(" (")[0] for x in lines if "(emulated on the CPU" in x] == ["interleaved x2"], proc.stdout
    assert " ok " in next(x for x in lines if x.startswith("interleaved x2")), proc.stdout
    bridged = [x for x in lines if x.startswith("bridge ")]
    assert [x.split(" (")[0] for x in bridged] == ["bridge   1 MiB", "bridge   4 MiB"], proc.stdout
    assert all(" ok " in x and "byte-exact: True" in x for x in bridged), proc.stdout


def _import_bench(name: str):
    sys.path.insert(0, str(BENCH))
    try:
        return __import__(name)
    finally:
        sys.path.remove(str(BENCH))


def test_gpu_step_check_plans_cover_one_and_two_gpus():
    step = _import_bench("gpu_step_check")
    one = step.plans("h200", model_name="opt-350m", seq_len=2048, devices=1)
    assert [p.world_size for _, p in one] == [1, 1, 1, 1]
    assert [p.precision for _, p in one] == ["fp32", "fp32", "bf16-mixed", "bf16-mixed"]
    assert all(p.cluster.kinds["h200"].device_type == "cuda" for _, p in one)
    two = step.plans("h200", model_name="opt-350m", seq_len=2048, devices=8)
    assert [p.world_size for _, p in two] == [1, 1, 1, 1, 2, 2]
    assert [len(p.pipelines) for _, p in two][-2:] == [1, 2]  # a 2-stage pipeline, then 2 replicas


def test_gpu_step_check_dry_run_runs_the_whole_path_on_cpu():
    """The GPU script's own code (profile in a child, plans through the Trainer, predictions, the
    printout) on the CPU with the tiny model: it is known to run before a GPU is lent."""
    step = _import_bench("gpu_step_check")
    rows = step.check(dry_run=True, steps=2, warmup=1, profile_repeats=1)
    assert [r["ranks"] for r in rows] == [1, 1, 2, 2]
    for r in rows:
        assert "error" not in r, r
        assert r["measured_s"] > 0 and r["profiled_s"] > 0 and r["analytic_s"] > 0
        assert sorted(r["memory_pred"]) == list(range(r["ranks"]))
        assert all(m is None for m in r["memory_meas"].values())  # no allocator statistics on the CPU
    step.print_rows(rows, dry_run=True)
