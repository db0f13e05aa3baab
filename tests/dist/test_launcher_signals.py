"""`hethub train` keeps its run in hand (runtime/supervise.py): a SIGTERM to the launcher alone stops
torchrun and every rank and frees the checkpoint lock, with exit code 128 + 15; a rank killed by a
signal is named, with the signal and its likely cause. Two small torchrun runs (2 ranks, tiny model)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from _harness import F, make_plan

from hethub.runtime.checkpoint_io import lock_dir
from hethub.runtime.supervise import AgentReport, agent_noise_filter

pytestmark = pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="needs /proc to find the run")


def _env(marker: str) -> dict[str, str]:
    import hethub

    return {**os.environ, "OMP_NUM_THREADS": "1", "HETHUB_TEST_RUN": marker,
            "PYTHONPATH": str(Path(hethub.__file__).resolve().parents[1])}


def _processes_of(marker: str) -> list[int]:
    """Live processes whose environment carries ``marker`` (every process of the run inherits it)."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            env = (d / "environ").read_bytes().split(b"\0")
            state = (d / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if f"HETHUB_TEST_RUN={marker}".encode() in env and state != "Z":
            out.append(int(d.name))
    return out


@pytest.fixture
def plan(tmp_path: Path) -> Path:
    make_plan([(2, 1, [(F, 1, 3), (F, 1, 3)])]).save(tmp_path / "plan.json")
    return tmp_path / "plan.json"


@pytest.mark.skipif(shutil.which("setsid") is None, reason="needs setsid")
def test_sigterm_to_the_launcher_alone_stops_the_whole_run(plan: Path, tmp_path: Path) -> None:
    marker, ck = uuid.uuid4().hex, tmp_path / "ck"
    cmd = ["setsid", sys.executable, "-m", "hethub.cli", "train", "--plan", str(plan), "--steps", "100000",
           "--checkpoint-dir", str(ck), "--timeout-s", "60"]
    proc = subprocess.Popen(cmd, env=_env(marker), cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + 120
        for line in proc.stdout:  # training is under way once the first step is logged
            if line.startswith("step ") or time.monotonic() > deadline:
                break
        assert len(_processes_of(marker)) >= 4, "launcher, torchrun and two ranks should be running"
        os.kill(proc.pid, signal.SIGTERM)  # the launcher only: not its group, not its session
        _, err = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, err[-2000:]
    assert "stopped by SIGTERM" in err and "lock" in err and "released" in err and "Traceback" not in err
    for _ in range(50):  # ranks already reaped by torchrun; give the kernel a moment to clear them
        if not _processes_of(marker):
            break
        time.sleep(0.1)
    assert _processes_of(marker) == []
    os.close(lock_dir(ck))  # the checkpoint lock is free


def test_a_rank_killed_by_a_signal_is_named_with_its_likely_cause(plan: Path, tmp_path: Path) -> None:
    env = {**_env(uuid.uuid4().hex), "HETHUB_FAULT_INJECT": "rank=1,step=1"}  # rank 1 SIGKILLs itself
    proc = subprocess.run([sys.executable, "-m", "hethub.cli", "train", "--plan", str(plan), "--steps", "3",
                           "--timeout-s", "30"], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "rank 1 was killed by SIGKILL (signal 9)" in proc.stderr and "out-of-memory" in proc.stderr
    assert "ChildFailedError" not in proc.stderr and proc.stderr.count("hethub train: error:") == 1


def test_torchruns_report_gives_each_failed_ranks_exit_code() -> None:
    lines = ["Traceback (most recent call last):\n", '  File "run.py", line 1\n',
             "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n", "=====\n", "x FAILED\n",
             "-----\n", "Failures:\n", "[1]:\n", "  rank      : 0 (local_rank: 0)\n", "  exitcode  : 1 (pid: 7)\n",
             "-----\n", "Root Cause (first observed failure):\n", "[0]:\n", "  rank      : 1 (local_rank: 1)\n",
             "  exitcode  : -9 (pid: 8)\n", "  traceback : Signal 9 (SIGKILL) received by PID 8\n", "=====\n"]
    report = AgentReport()
    stopping = ["Traceback (most recent call last):\n", '  File "api.py", line 86\n',
                "torch.distributed.elastic.multiprocessing.api.SignalException: Process 1 got signal: 15\n"]
    assert list(agent_noise_filter(stopping + lines, report=report)) == []
    assert report.exit_codes == {0: 1, 1: -9} and report.signalled == {1: 9}
