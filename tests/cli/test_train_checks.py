"""`hethub train` checks everything it can before any rank starts: arguments, the host's devices and
memory, the checkpoint directory's lock. No rank is launched in these tests."""

from __future__ import annotations

import contextlib
import io

import pytest

from conftest import EXAMPLES, gpu_two_kind_plan, two_stage_plan
from hethub import cli
from hethub.errors import MemoryFitError
from hethub.plan import Plan
from hethub.predict.predictor import predict
from hethub.runtime import launch
from hethub.runtime.host_check import Host, check_host


@pytest.fixture
def no_launch(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("a rank was launched")

    monkeypatch.setattr(launch, "launch_local", refuse)


def _train(argv, capsys) -> tuple[int, str]:
    code = cli.main(["train", *map(str, argv)])
    return code, capsys.readouterr().err


@pytest.fixture
def gpu_plan(tmp_path) -> str:
    path = tmp_path / "gpu.json"
    gpu_two_kind_plan().save(path)
    return str(path)


@pytest.fixture(scope="module")
def cpu_plan(tmp_path_factory) -> str:
    """The planner's plan for the local CPU cluster, searched once for the module's tests (each only
    reads the file)."""
    path = tmp_path_factory.mktemp("cpu") / "cpu.json"
    with contextlib.redirect_stdout(io.StringIO()):
        assert cli.main(["plan", "--cluster", str(EXAMPLES / "local-cpu.toml"), "--model", "tiny",
                         "--global-batch", "4", "--seq-len", "32", "--precision", "fp32", "--out", str(path)]) == 0
    return str(path)


def test_gpu_plan_on_this_cpu_host_is_refused_before_any_rank(gpu_plan, no_launch, capsys):
    code, err = _train(["--plan", gpu_plan, "--steps", "2"], capsys)
    assert code == 6
    assert "Traceback" not in err and "a100-40gb" in err and "v100-16gb" in err
    assert "has 0 visible" in err and "Nothing was started" in err and err.count("error:") == 1


def test_cpu_ranks_beyond_host_memory_are_refused_with_the_numbers(cpu_plan):
    plan = Plan.load(cpu_plan)
    pred = predict(plan)
    check_host(plan, pred, host=Host(accelerators={}, mem_available_bytes=64 * 2**30))  # fits
    with pytest.raises(MemoryFitError) as err:
        check_host(plan, pred, host=Host(accelerators={}, mem_available_bytes=2**29), plan_path=cpu_plan)
    msg = str(err.value)
    assert "0.5 GiB available" in msg and f"{plan.world_size} CPU ranks" in msg and "Fix:" in msg


def test_host_check_counts_accelerator_ranks():
    plan = two_stage_plan()  # test kinds use gloo: CPU ranks
    check_host(plan, predict(plan), host=Host(accelerators={}, mem_available_bytes=None))


def test_locked_checkpoint_directory_is_refused(cpu_plan, tmp_path, no_launch, capsys):
    from hethub.runtime.checkpoint_io import lock_dir

    fd = lock_dir(tmp_path / "ck")
    try:
        code, err = _train(["--plan", cpu_plan, "--checkpoint-dir", tmp_path / "ck"], capsys)
    finally:
        import os

        os.close(fd)
    assert code == 7 and "in use by another run" in err and "Traceback" not in err


@pytest.mark.parametrize("flags,names", [
    (["--steps", "0"], "--steps"), (["--steps", "-5"], "--steps"), (["--lr", "-1"], "--lr"),
    (["--lr", "nan"], "--lr"), (["--min-lr-ratio", "2"], "--min-lr-ratio"), (["--grad-clip", "-1"], "--grad-clip"),
    (["--warmup-steps", "50", "--steps", "5"], "--warmup-steps"), (["--resume", "auto"], "--checkpoint-dir"),
    (["--timeout-s", "0"], "--timeout-s"), (["--checkpoint-every", "-1"], "--checkpoint-every"),
])
def test_bad_training_flags_are_refused_once_before_launch(cpu_plan, no_launch, capsys, flags, names):
    try:
        code, err = _train(["--plan", cpu_plan, *flags], capsys)
    except SystemExit as exc:  # argparse's own usage errors
        code, err = exc.code, capsys.readouterr().err
    assert code == 2 and names in err and "Traceback" not in err and err.count("error:") == 1


def test_flags_after_double_dash_still_work(cpu_plan, monkeypatch, capsys):
    seen = {}

    def fake(plan_path, **kw):
        import subprocess

        seen.update(kw)
        return subprocess.CompletedProcess([], 0)

    monkeypatch.setattr(launch, "launch_local", fake)
    assert cli.main(["train", "--plan", cpu_plan, "--steps", "3", "--", "--trace", "--lr", "1e-3"]) == 0
    assert seen["steps"] == 3 and seen["extra_args"] == ["--lr", "0.001", "--trace"]


def test_agent_noise_is_dropped_but_rank_tracebacks_are_kept():
    lines = ["step 1\n", "W1201 17:37:05.140000 11861 torch/distributed/elastic/multiprocessing/api.py:1028] x\n",
             "Traceback (most recent call last):\n", '  File "run.py", line 1\n',
             "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n", "=====\n", "hethub FAILED\n",
             "-----\n", "Root Cause\n", "=====\n", "Traceback (most recent call last):\n", '  File "x.py"\n',
             "ZeroDivisionError: boom\n", "done\n"]
    out = list(launch.agent_noise_filter(lines))
    assert out == ["step 1\n", "Traceback (most recent call last):\n", '  File "x.py"\n', "ZeroDivisionError: boom\n",
                   "done\n"]


def test_rank_errors_are_reported_once_with_the_rank_exit_code(tmp_path):
    import json

    from hethub.commands.run import _rank_failure

    msg = "checkpoint file 'ck/step-000004/model-r00000.pt' is missing. Fix: resume from an earlier step"
    for rank in (1, 0):
        (tmp_path / f"rank-{rank}.json").write_text(json.dumps({"rank": str(rank), "exit_code": 7, "message": msg}))
    err = _rank_failure(tmp_path, 1)
    assert err.exit_code == 7 and str(err) == msg  # once, though both ranks raised it
    err = _rank_failure(tmp_path / "none", 1)
    assert err.exit_code == 1 and "without a hethub error" in str(err)
