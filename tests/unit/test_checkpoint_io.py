"""The checkpoint's files: atomic commit, the latest pointer, pruning, verification (one process)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from hethub.errors import CheckpointError
from hethub.runtime import checkpoint_io as io


def _save(root: Path, step: int, *, value: float = 1.0) -> Path:
    tmp = io.prepare_tmp(root, step)
    entry = io.save_tensors(tmp / "model-r00000.pt", {"param:w": torch.full((3,), value)})
    manifest = {"format": io.FORMAT, "version": io.VERSION, "step": step, "model": {}, "tensors": {},
                "files": {"model-r00000.pt": dataclasses.asdict(entry)}}
    return io.commit(root, step, manifest)


def test_commit_is_visible_only_when_complete(tmp_path: Path) -> None:
    assert io.latest_dir(tmp_path) is None
    first = _save(tmp_path, 2)
    assert first.name == "step-000002" and (tmp_path / "latest").read_text().strip() == "step-000002"
    # A save killed before its commit leaves a .tmp directory: never taken for a checkpoint.
    half = io.prepare_tmp(tmp_path, 4)
    (half / "model-r00000.pt").write_bytes(b"half")
    assert io.committed_steps(tmp_path) == [2]
    assert io.resolve(tmp_path) == first
    # The next save of that step discards the stale directory.
    assert _save(tmp_path, 4).name == "step-000004" and not half.exists()
    assert io.resolve(tmp_path).name == "step-000004"


def test_latest_pointer_missing_or_stale_falls_back_to_highest_step(tmp_path: Path) -> None:
    _save(tmp_path, 1)
    _save(tmp_path, 3)
    (tmp_path / "latest").write_text("step-000009\n")
    assert io.latest_dir(tmp_path).name == "step-000003"
    (tmp_path / "latest").unlink()
    assert io.latest_dir(tmp_path).name == "step-000003"


def test_resaving_a_step_replaces_it(tmp_path: Path) -> None:
    _save(tmp_path, 2, value=1.0)
    d = _save(tmp_path, 2, value=5.0)
    m = io.read_manifest(d)
    assert float(io.load_verified(d, "model-r00000.pt", m)["param:w"][0]) == 5.0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-000002"]


def test_prune_keeps_the_newest(tmp_path: Path) -> None:
    for s in (1, 2, 3, 4):
        _save(tmp_path, s)
    io.prune(tmp_path, keep=2)
    assert io.committed_steps(tmp_path) == [3, 4]
    io.prune(tmp_path, keep=0)
    assert io.committed_steps(tmp_path) == [3, 4]


def test_corrupt_file_is_refused_and_named(tmp_path: Path) -> None:
    d = _save(tmp_path, 1)
    m = io.read_manifest(d)
    f = d / "model-r00000.pt"
    raw = bytearray(f.read_bytes())
    raw[-5] ^= 0x01
    f.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match=r"model-r00000\.pt") as err:
        io.load_verified(d, "model-r00000.pt", m)
    assert "sha256" in str(err.value) and "Fix" in str(err.value) and err.value.exit_code == 7
    f.write_bytes(bytes(raw[:-1]))
    assert "bytes" in io.check_file(d, "model-r00000.pt", m["files"]["model-r00000.pt"])
    f.unlink()
    assert io.check_file(d, "model-r00000.pt", m["files"]["model-r00000.pt"]) == "is missing"


def test_bad_manifests_and_paths_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="does not exist"):
        io.resolve(tmp_path / "nope")
    with pytest.raises(CheckpointError, match="no committed checkpoint"):
        io.resolve(tmp_path)
    d = _save(tmp_path, 1)
    (d / io.MANIFEST).write_text("{not json")
    with pytest.raises(CheckpointError, match=r"manifest\.json: not valid JSON"):
        io.read_manifest(d)
    (d / io.MANIFEST).write_text(json.dumps({"format": io.FORMAT, "version": 99}))
    with pytest.raises(CheckpointError, match="version 99"):
        io.read_manifest(d)
    (d / io.MANIFEST).write_text(json.dumps({"format": io.FORMAT, "version": io.VERSION}))
    with pytest.raises(CheckpointError, match="'step' is missing"):
        io.read_manifest(d)
