"""Checkpoint faults on forked gloo ranks: a full disk mid-save, a corrupt newest checkpoint, a
different LR schedule on resume, a directory held by another run."""

from __future__ import annotations

import errno
import os
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from _harness import OPTIM, F, batches, make_plan, run_ranks, warm_imports

from hethub.comm.communicator import Communicator
from hethub.errors import CheckpointError
from hethub.runtime import checkpoint_io as io
from hethub.runtime.checkpoint import load_newest_valid, save_checkpoint
from hethub.runtime.trainer import Trainer, TrainerConfig

CFG = TrainerConfig(optim=replace(OPTIM, total_steps=4, warmup_steps=1))
PLAN = make_plan([(2, 2, [(F, 1, 4), (F, 1, 2)])])


warm_imports()


def _trainer(rank: int, cfg: TrainerConfig = CFG) -> Trainer:
    from _harness import TIMEOUT

    return Trainer(PLAN, rank=rank, comm=Communicator(timeout=TIMEOUT), cfg=cfg)


def _step(trainer: Trainer, data: torch.Tensor) -> None:
    trainer.forward_backward(data)
    trainer.sync_grads()
    trainer.clip_and_update()


def _save_twice(rank: int, root: str, fail: str) -> str:
    """Save step 1; then save step 2 with rank 1's writer failing the way ``fail`` says."""
    trainer = _trainer(rank)
    data = batches(PLAN, steps=2)
    _step(trainer, data[0])
    save_checkpoint(trainer, root=root, step=1)
    _step(trainer, data[1])
    if rank == 1:
        real_save = torch.save

        def full_disk(obj, f, *a, **k):
            if fail == "enospc":
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            real_save(obj, f, *a, **k)
            raise RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 4160 vs 4096")

        io.torch.save = full_disk  # this forked rank only
    try:
        save_checkpoint(trainer, root=root, step=2)
    except CheckpointError as err:
        return str(err)
    return "saved"


@pytest.mark.parametrize("fail", ["enospc", "torch-writer"])
def test_disk_full_during_save_keeps_previous_and_cleans_up(tmp_path: Path, fail: str) -> None:
    msgs = run_ranks(2, _save_twice, str(tmp_path), fail)
    for msg in msgs:  # the documented error on every rank: the rank, the cause, what was kept
        assert "failed on rank 1" in msg and "step-000002.tmp" in msg, msg
        assert ("No space left on device" if fail == "enospc" else "is the disk full") in msg
        assert "previous checkpoint" in msg and "step-000001" in msg and "Fix:" in msg
    assert not (tmp_path / "step-000002.tmp").exists() and not (tmp_path / "step-000002").exists()
    assert io.latest_dir(tmp_path) == tmp_path / "step-000001"
    manifest = io.read_manifest(tmp_path / "step-000001")
    for name, entry in manifest["files"].items():
        assert io.check_file(tmp_path / "step-000001", name, entry) is None


def _save_steps(rank: int, root: str) -> None:
    trainer = _trainer(rank)
    data = batches(PLAN, steps=2)
    for step in (1, 2):
        _step(trainer, data[step - 1])
        save_checkpoint(trainer, root=root, step=step)


def _resume(rank: int, root: str, fallback: bool, total_steps: int = 4, allow: bool = False) -> tuple:
    trainer = _trainer(rank, TrainerConfig(optim=replace(CFG.optim, total_steps=total_steps)))
    try:
        got, skipped = load_newest_valid(trainer, root, fallback=fallback, allow_schedule_change=allow)
    except CheckpointError as err:
        return type(err).__name__, str(err)
    return got.step, skipped


def test_corrupt_newest_checkpoint_falls_back_to_the_previous_one(tmp_path: Path) -> None:
    run_ranks(2, _save_steps, str(tmp_path))
    victim = tmp_path / "step-000002" / "model-r00001.pt"
    raw = bytearray(victim.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    victim.write_bytes(bytes(raw))
    for step, skipped in run_ranks(2, _resume, str(tmp_path), True):
        assert step == 1
        assert len(skipped) == 1 and str(victim) in skipped[0] and "corrupt" in skipped[0]
    for kind, msg in run_ranks(2, _resume, str(tmp_path), False):  # --no-checkpoint-fallback
        assert kind == "CorruptCheckpointError" and str(victim) in msg


def test_resume_under_another_schedule_is_refused_unless_allowed(tmp_path: Path) -> None:
    run_ranks(2, _save_steps, str(tmp_path))
    for kind, msg in run_ranks(2, _resume, str(tmp_path), True, 8):
        assert kind == "CheckpointError"
        assert "--steps 4" in msg and "--steps 8" in msg and "--allow-schedule-change" in msg
    assert [r[0] for r in run_ranks(2, _resume, str(tmp_path), True, 8, True)] == [2, 2]


def test_a_locked_checkpoint_directory_is_refused(tmp_path: Path) -> None:
    fd = io.lock_dir(tmp_path)
    try:
        pid = os.fork()
        if pid == 0:  # another process = another run
            try:
                io.lock_dir(tmp_path)
                code = 0
            except CheckpointError as err:
                code = 7 if f"pid {os.getppid()}" in str(err) and "in use by another run" in str(err) else 1
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 7
    finally:
        os.close(fd)
    os.close(io.lock_dir(tmp_path))  # released with its holder: free again
