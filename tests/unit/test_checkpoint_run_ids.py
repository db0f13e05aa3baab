"""Run identity of a checkpoint root (one process): claims, moving an earlier run aside, the run's own steps."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hethub.errors import CheckpointError
from hethub.runtime import checkpoint_io as io
from hethub.runtime import checkpoint_runs as runs


def _commit(root: Path, step: int, run: str | None) -> None:
    io.prepare_tmp(root, step)
    io.commit(root, step, {"format": io.FORMAT, "version": io.VERSION, "step": step, "model": {}, "tensors": {},
                           "files": {}, **({"run": run} if run else {})})


def test_new_root_gets_a_new_run_and_a_resume_keeps_it(tmp_path: Path) -> None:
    first = runs.claim(tmp_path, resume=False, start_over=False)
    assert runs.read_run_id(tmp_path) == first.run and not first.resumed_run
    _commit(tmp_path, 2, first.run)
    again = runs.claim(tmp_path, resume=True, start_over=False)
    assert again.run == first.run and again.resumed_run


def test_another_run_is_refused_then_moved_aside_never_deleted(tmp_path: Path) -> None:
    old = runs.claim(tmp_path, resume=False, start_over=False).run
    for s in (2, 4):
        _commit(tmp_path, s, old)
    (tmp_path / io.LOCK).write_text("held")
    with pytest.raises(CheckpointError, match=rf"run {old} \(steps 2, 4\).*--resume auto.*--start-over"):
        runs.claim(tmp_path, resume=False, start_over=False)
    with pytest.raises(CheckpointError):
        runs.claim(tmp_path, resume=False, start_over=False, dry_run=True)
    assert runs.claim(tmp_path, resume=False, start_over=True, dry_run=True).moved_to is None  # a check only
    assert io.committed_steps(tmp_path) == [2, 4] and runs.read_run_id(tmp_path) == old
    new = runs.claim(tmp_path, resume=False, start_over=True)
    assert new.run != old and new.moved_to == tmp_path / runs.PREVIOUS / old
    assert io.committed_steps(new.moved_to) == [2, 4] and (new.moved_to / io.LATEST).is_file()
    assert json.loads((new.moved_to / runs.RUN_FILE).read_text())["run"] == old
    assert io.committed_steps(tmp_path) == [] and (tmp_path / io.LOCK).read_text() == "held"


def test_pruning_and_fallback_candidates_stay_within_the_run(tmp_path: Path) -> None:
    _commit(tmp_path, 5, None)  # written before run ids: belongs to whichever run the root has
    _commit(tmp_path, 20, "a")
    _commit(tmp_path, 30, "a")
    _commit(tmp_path, 10, "b")
    assert runs.run_steps(tmp_path, "b") == [5, 10] and runs.run_steps(tmp_path, "a") == [5, 20, 30]
    io.prune(tmp_path, keep=1, steps=runs.run_steps(tmp_path, "b"))
    assert io.committed_steps(tmp_path) == [10, 20, 30]  # b's older one pruned, a's untouched


def test_which_resume_continues_the_root(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    assert runs.resumes_root("auto", root) and not runs.resumes_root(None, root)
    assert runs.resumes_root(str(root / "step-000002"), root) and runs.resumes_root(str(root), root)
    assert not runs.resumes_root(str(tmp_path / "other" / "step-000002"), root)
