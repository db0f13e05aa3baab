"""Run identity of a checkpoint root: one run per ``--checkpoint-dir``, never two mixed.

Every run has an id (``20261205-101500-3fa9c1``: start time and six random hex digits), written to
``ROOT/run.json`` when the run claims the root and into every checkpoint manifest it saves (field
``run``). Why: pruning keeps the highest step numbers and a resume falls back to the next older
checkpoint, so a second run sharing the root with an earlier one would have its own checkpoints
pruned in favour of the old run's higher steps, and a corrupt newest checkpoint would resume the
*other* run. So a run that does not resume refuses a root that holds another run's committed
checkpoints, unless told to start over, which moves them (never deletes them) into
``ROOT/previous/RUN/``. Pruning and fallback then only ever act on the run's own checkpoints.

Manifests written before run ids existed have no ``run`` field; they count as the root's run.
No torch.distributed here: rank 0 claims under the root's lock and shares the id (``checkpoint.py``);
``hethub train`` runs the same check (``dry_run``) before any rank starts.
"""

from __future__ import annotations

import json
import os
import secrets
import time
from dataclasses import dataclass
from pathlib import Path

from hethub.errors import CheckpointError
from hethub.runtime import checkpoint_io as io

RUN_FILE = "run.json"
PREVIOUS = "previous"  # where --start-over moves an earlier run's files


def new_run_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(3)


def read_run_id(root: Path) -> str | None:
    """The id in ``ROOT/run.json``; None when there is none (a new root, or one from before run ids)."""
    try:
        data = json.loads((Path(root) / RUN_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    run = data.get("run") if isinstance(data, dict) else None
    return run if isinstance(run, str) and run else None


def manifest_run(step_dir: Path) -> str | None:
    """The ``run`` field of a committed checkpoint's manifest (None: unreadable, or written before run ids)."""
    try:
        data = json.loads((step_dir / io.MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    run = data.get("run") if isinstance(data, dict) else None
    return run if isinstance(run, str) else None


def belongs(step_dir: Path, run: str | None) -> bool:
    """Whether checkpoint ``step_dir`` is one of run ``run``'s (an unknown run, or a manifest without
    a run id, matches: nothing tells them apart)."""
    saved = manifest_run(step_dir)
    return run is None or saved is None or saved == run


def run_steps(root: Path, run: str | None) -> list[int]:
    """Committed steps of run ``run`` under ``root``, ascending."""
    return [s for s in io.committed_steps(root) if belongs(root / io.step_dir_name(s), run)]


def resumes_root(resume: str | None, root: Path) -> bool:
    """Whether ``--resume`` continues the run whose checkpoints are in ``root`` (auto, or a path inside it)."""
    if resume == "auto":
        return True
    if not resume:
        return False
    here, there = Path(root).resolve(), Path(resume).resolve()
    return there == here or here in there.parents


@dataclass(frozen=True)
class Claim:
    run: str  # the id this run saves under
    resumed_run: bool  # the root's earlier run is being continued
    moved_to: Path | None = None  # where --start-over moved the earlier run's files


def claim(root: Path, *, resume: bool, start_over: bool, dry_run: bool = False) -> Claim:
    """Decide which run ``root``'s checkpoints belong to from now on (rank 0, under the root's lock).

    - ``resume`` (``--resume auto`` or a checkpoint inside ``root``): the root's run continues, its id kept;
    - else, committed checkpoints present: CheckpointError, or with ``start_over`` they are moved aside;
    - else (an empty root, or one whose run never committed): a new run.
    ``dry_run`` checks only (the launcher, before any rank exists): nothing is written or moved.
    """
    root = Path(root)
    current = read_run_id(root)
    steps = io.committed_steps(root)
    if resume and (current is not None or steps):
        run = current or new_run_id()
        if not dry_run and current is None:
            _write_run_file(root, run)
        return Claim(run=run, resumed_run=True)
    moved = None
    if steps:
        if not start_over:
            who = f"run {current}" if current else "an earlier run"
            listed = ", ".join(map(str, steps[-5:])) + (" ..." if len(steps) > 5 else "")
            raise CheckpointError(
                f"--checkpoint-dir '{root}' holds the checkpoints of {who} (steps {listed}); a new run there would "
                "mix with them (pruning keeps the highest steps, a fallback could resume the other run). Fix: pass "
                "--resume auto to continue that run, --start-over to move its files aside into "
                f"'{root / PREVIOUS}/' and start anew, or another --checkpoint-dir.")
        if not dry_run:
            moved = _move_aside(root, current)
    run = new_run_id()
    if not dry_run:
        _write_run_file(root, run)
    return Claim(run=run, resumed_run=False, moved_to=moved)


def _write_run_file(root: Path, run: str) -> None:
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / (RUN_FILE + ".tmp")
    io.write_bytes_durably(tmp, (json.dumps({"run": run, "started": time.strftime("%Y-%m-%d %H:%M:%S")})
                                 + "\n").encode())
    os.replace(tmp, root / RUN_FILE)


def _move_aside(root: Path, run: str | None) -> Path:
    """Move everything of the earlier run (its step directories, unfinished saves, ``latest``,
    ``run.json``, re-plans) into ``ROOT/previous/RUN/``; the lock file stays."""
    dest = root / PREVIOUS / (run or f"unnamed-{time.strftime('%Y%m%d-%H%M%S')}")
    while dest.exists():
        dest = dest.with_name(dest.name + "-" + secrets.token_hex(2))
    dest.mkdir(parents=True)
    for p in sorted(root.iterdir()):
        if p.name in (io.LOCK, PREVIOUS):
            continue
        os.replace(p, dest / p.name)
    return dest
