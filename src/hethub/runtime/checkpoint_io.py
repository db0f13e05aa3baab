"""The checkpoint's files on disk: atomic commit, manifest, checksums, ``latest`` pointer, pruning.

No torch.distributed here (unit-tested in one process). Layout of a checkpoint root::

    ROOT/latest                 text: name of the newest committed step directory
    ROOT/step-000123/           one committed checkpoint (123 optimizer steps done)
        manifest.json           written last; lists every other file with its sha256 and size
        model-r00000.pt ...     full tensors (parameters + AdamW state) owned by each writer rank
        rng-r00000.pt ...       each rank's RNG state
    ROOT/step-000124.tmp/       a checkpoint being written: never read, removed by the next save

Why atomic: a job killed mid-save (the elastic case) must never resume from half a checkpoint. Files
go into ``step-N.tmp/`` and are fsynced, the manifest is written last, then one ``rename`` makes the
directory visible as ``step-N/`` and ``latest`` is replaced with ``os.replace``. A committed directory
therefore always has a manifest; its checksums catch later damage (disk, copies, hand edits).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hethub.errors import CheckpointError

FORMAT = "hethub-checkpoint"
VERSION = 1
MANIFEST = "manifest.json"
LATEST = "latest"
_STEP_RE = re.compile(r"^step-(\d{6,})$")


class CorruptCheckpointError(CheckpointError):
    """A committed checkpoint whose manifest or files are damaged (an older one may still be good)."""


def step_dir_name(step: int) -> str:
    return f"step-{step:06d}"


@dataclass(frozen=True)
class FileEntry:
    sha256: str
    bytes: int


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_bytes_durably(path: Path, data: bytes) -> None:
    with path.open("wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def save_tensors(path: Path, obj: dict[str, Any]) -> FileEntry:
    """torch.save ``obj`` to ``path`` (fsynced); return its checksum entry. Any failure to write (disk
    full, permissions) is an OSError: torch's zip writer reports a failed write as a RuntimeError
    ("unexpected pos ..."), which is turned into one naming the file."""
    try:
        with path.open("wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
    except RuntimeError as err:
        raise OSError(f"writing {path} failed ({str(err).splitlines()[0][:200]}); is the disk full?") from None
    return FileEntry(sha256=sha256_file(path), bytes=path.stat().st_size)


def prepare_tmp(root: Path, step: int) -> Path:
    """Empty ``ROOT/step-N.tmp/`` (a stale one from a killed save is discarded)."""
    tmp = root / (step_dir_name(step) + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    return tmp


def discard_tmp(root: Path, step: int) -> None:
    """Remove a failed save's ``step-N.tmp/`` (it may be what filled the disk)."""
    shutil.rmtree(root / (step_dir_name(step) + ".tmp"), ignore_errors=True)


def commit(root: Path, step: int, manifest: dict[str, Any]) -> Path:
    """Write the manifest into the tmp directory, rename it into place and point ``latest`` at it."""
    tmp = root / (step_dir_name(step) + ".tmp")
    write_bytes_durably(tmp / MANIFEST, (json.dumps(manifest, indent=1, sort_keys=True) + "\n").encode())
    _fsync_dir(tmp)
    final = root / step_dir_name(step)
    if final.exists():  # the same step saved by an earlier attempt of a restarted job
        old = root / (step_dir_name(step) + ".old")
        shutil.rmtree(old, ignore_errors=True)
        final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(final)
    write_bytes_durably(root / (LATEST + ".tmp"), (final.name + "\n").encode())
    os.replace(root / (LATEST + ".tmp"), root / LATEST)
    _fsync_dir(root)
    return final


def committed_steps(root: Path) -> list[int]:
    """Steps of the committed checkpoints under ``root``, ascending (tmp/old directories excluded)."""
    if not root.is_dir():
        return []
    steps = []
    for p in root.iterdir():
        m = _STEP_RE.match(p.name)
        if m and (p / MANIFEST).is_file():
            steps.append(int(m.group(1)))
    return sorted(steps)


def prune(root: Path, *, keep: int, steps: list[int] | None = None) -> None:
    """Keep the newest ``keep`` of the committed checkpoints ``steps`` (default: all under ``root``;
    a run passes its own, ``checkpoint_runs.run_steps``); 0 keeps all; never the one ``latest`` names."""
    if keep <= 0:
        return
    latest = latest_dir(root)
    for step in sorted(committed_steps(root) if steps is None else steps)[:-keep]:
        d = root / step_dir_name(step)
        if latest is None or d.resolve() != latest.resolve():
            shutil.rmtree(d, ignore_errors=True)


def latest_dir(root: Path) -> Path | None:
    """The newest committed checkpoint under ``root``: the ``latest`` pointer, else the highest step."""
    ptr = root / LATEST
    if ptr.is_file():
        name = ptr.read_text(encoding="utf-8").strip()
        if _STEP_RE.match(name) and (root / name / MANIFEST).is_file():
            return root / name
    steps = committed_steps(root)
    return root / step_dir_name(steps[-1]) if steps else None


LOCK = ".lock"


def lock_dir(root: Path) -> int:
    """Take an exclusive lock on checkpoint root ``root`` (created if missing) for this process's life;
    returns the open descriptor holding it (keep it referenced). A second run on the same directory
    gets CheckpointError naming the holder. ``flock`` locks are released when the holder dies, so a
    killed run (the elastic restart case) never leaves a stale lock."""
    import fcntl
    import socket
    import time

    root.mkdir(parents=True, exist_ok=True)
    fd = os.open(root / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 400).decode("utf-8", "replace").strip() or "unknown process"
        os.close(fd)
        raise CheckpointError(f"checkpoint directory '{root}' is in use by another run ({holder}). Fix: wait for "
                              "that run to finish, or give this one another --checkpoint-dir.") from None
    os.ftruncate(fd, 0)
    os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}"
             .encode())
    return fd


def resolve(path: str | Path) -> Path:
    """A checkpoint directory from ``--resume PATH``: a step directory itself, or a root holding some."""
    p = Path(path)
    if (p / MANIFEST).is_file():
        return p
    if not p.is_dir():
        raise CheckpointError(f"checkpoint directory '{p}' does not exist. Fix: pass the --checkpoint-dir of an "
                              "earlier run (or one of its step-NNNNNN directories), or use --resume auto.")
    found = latest_dir(p)
    if found is None:
        raise CheckpointError(f"'{p}' holds no committed checkpoint (no step-NNNNNN/{MANIFEST}). Fix: pass the "
                              "--checkpoint-dir of a run that saved one; '.tmp' directories are unfinished saves.")
    return found


def read_manifest(step_dir: Path) -> dict[str, Any]:
    path = step_dir / MANIFEST
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CorruptCheckpointError(f"checkpoint '{step_dir}' has no {MANIFEST}: it is incomplete. Fix: resume "
                                     "from another step directory of the same run.") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CorruptCheckpointError(f"{path}: not valid JSON ({err}); the checkpoint is corrupt. Fix: resume "
                                     "from another step directory of the same run.") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise CorruptCheckpointError(f"{path}: not a hethub checkpoint manifest (field 'format' is not {FORMAT!r}). "
                              "Fix: pass a directory written by 'hethub.train --checkpoint-dir'.")
    if data.get("version") != VERSION:
        raise CheckpointError(f"{path}: checkpoint version {data.get('version')!r}; this hethub reads version "
                              f"{VERSION}. Fix: resume with the hethub version that wrote it.")
    for key in ("step", "files", "tensors", "model"):
        if key not in data:
            raise CorruptCheckpointError(f"{path}: field '{key}' is missing; the checkpoint is corrupt. Fix: "
                                         "resume from another step directory of the same run.")
    return data


def check_file(step_dir: Path, name: str, entry: dict[str, Any]) -> str | None:
    """None if ``name`` is present with the manifest's size and sha256; else what is wrong with it."""
    path = step_dir / name
    if not path.is_file():
        return "is missing"
    size = path.stat().st_size
    if size != entry.get("bytes"):
        return f"has {size} bytes, the manifest says {entry.get('bytes')}"
    if sha256_file(path) != entry.get("sha256"):
        return "does not match its sha256 checksum in the manifest"
    return None


def corrupt_error(step_dir: Path, name: str, problem: str) -> CheckpointError:
    return CorruptCheckpointError(f"checkpoint file '{step_dir / name}' {problem}: the checkpoint is corrupt and "
                                  "was not loaded. Fix: resume from an earlier step directory of the same run "
                                  f"(--resume {step_dir.parent}/step-NNNNNN), or restore the file from a copy.")


def load_verified(step_dir: Path, name: str, manifest: dict[str, Any]) -> dict[str, Any]:
    """Load one tensor file after checking it against the manifest (single-process callers)."""
    problem = check_file(step_dir, name, manifest["files"].get(name, {}))
    if problem:
        raise corrupt_error(step_dir, name, problem)
    return torch.load(step_dir / name, map_location="cpu", weights_only=True)
