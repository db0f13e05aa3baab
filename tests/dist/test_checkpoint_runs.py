"""Runs never mix in one checkpoint directory (issue 34, problems 1 and 2), through ``hethub.train``'s
own ranks forked from this process (``launch_forked``): a second run refuses the first run's
directory unless it resumes it or starts over; starting over moves the first run's checkpoints aside;
pruning and fallback stay within the run; a resume after a fallback checks the checkpoint it loaded."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _harness import F, make_plan, warm_imports

from hethub.runtime import checkpoint_io as io
from hethub.runtime.checkpoint_runs import PREVIOUS, manifest_run, read_run_id
from hethub.runtime.launch import launch_forked

warm_imports()


def _train(tmp: Path, *, steps: int, args: list[str], capfd: pytest.CaptureFixture[str]) -> tuple[list[int], str]:
    codes = launch_forked(tmp / "plan.json", nproc=2, steps=steps, quiet=False, timeout_s=120,
                          extra_args=["--timeout-s", "30", "--checkpoint-dir", str(tmp / "ck"), *args])
    out, err = capfd.readouterr()
    return codes, out + err


def _corrupt(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    path.write_bytes(bytes(raw))


@pytest.fixture
def plan_dir(tmp_path: Path) -> Path:
    make_plan([(2, 1, [(F, 1, 3), (F, 1, 3)])]).save(tmp_path / "plan.json")
    return tmp_path


def test_a_second_run_never_mixes_with_the_first(plan_dir: Path, capfd: pytest.CaptureFixture[str]) -> None:
    ck = plan_dir / "ck"
    # Run A: 6 steps, checkpoints at 2, 4 and 6.
    codes, out = _train(plan_dir, steps=6, args=["--checkpoint-every", "2"], capfd=capfd)
    assert codes == [0, 0], out
    run_a = read_run_id(ck)
    assert run_a and io.committed_steps(ck) == [2, 4, 6]
    assert {manifest_run(ck / io.step_dir_name(s)) for s in (2, 4, 6)} == {run_a}
    # Run B on the same directory without --resume: refused on every rank (exit 7), A's files untouched.
    codes, out = _train(plan_dir, steps=3, args=["--checkpoint-every", "1"], capfd=capfd)
    assert codes == [7, 7]
    assert f"holds the checkpoints of run {run_a} (steps 2, 4, 6)" in out and "--start-over" in out
    assert io.committed_steps(ck) == [2, 4, 6] and read_run_id(ck) == run_a
    # With --start-over, A's checkpoints move aside (not deleted) and B's own are pruned among themselves.
    codes, out = _train(plan_dir, steps=3, args=["--checkpoint-every", "1", "--keep-checkpoints", "2",
                                                 "--start-over"], capfd=capfd)
    assert codes == [0, 0], out
    run_b = read_run_id(ck)
    assert run_b != run_a and io.committed_steps(ck) == [2, 3]
    aside = ck / PREVIOUS / run_a
    assert io.committed_steps(aside) == [2, 4, 6] and "moved to" in out
    # B's newest damaged: --resume auto falls back to B's step 2, never to one of A's checkpoints.
    _corrupt(ck / "step-000003" / "model-r00000.pt")
    codes, out = _train(plan_dir, steps=4, args=["--resume", "auto", "--allow-schedule-change"], capfd=capfd)
    assert codes == [0, 0], out
    assert "resumed from " + str(ck / "step-000002") + " at step 2" in out
    assert all(manifest_run(ck / io.step_dir_name(s)) == run_b for s in io.committed_steps(ck))


def test_a_corrupt_newest_manifest_falls_back_and_the_run_goes_on(plan_dir: Path,
                                                                 capfd: pytest.CaptureFixture[str]) -> None:
    ck = plan_dir / "ck"
    codes, out = _train(plan_dir, steps=4, args=["--checkpoint-every", "2"], capfd=capfd)
    assert codes == [0, 0], out
    manifest = ck / "step-000004" / io.MANIFEST
    manifest.write_bytes(manifest.read_bytes()[:40] + b"\xff\xfe" + manifest.read_bytes()[42:])
    codes, out = _train(plan_dir, steps=6, args=["--resume", "auto", "--allow-schedule-change"], capfd=capfd)
    # The fallback is announced, the checkpoint loaded is the one checked afterwards: the run completes.
    assert codes == [0, 0], out
    assert "skipping a corrupt checkpoint" in out and str(manifest) in out
    assert "resumed from " + str(ck / "step-000002") + " at step 2" in out
    assert (ck / io.LATEST).read_text().strip() == "step-000006"
    saved = json.loads((ck / "step-000006" / io.MANIFEST).read_text())
    assert saved["run"] == read_run_id(ck) and saved["step"] == 6
