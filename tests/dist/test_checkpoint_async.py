"""Checkpoints written in the background (runtime/checkpoint_saver.py) on forked gloo ranks: the files
hold the state at the save while training goes on, equal to a synchronous save's; a writer failing on
one rank stops every rank at the commit; a process killed mid-write leaves nothing that looks complete."""

from __future__ import annotations

import threading
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
from _harness import OPTIM, TIMEOUT, F, batches, make_plan, run_ranks, warm_imports

from hethub.comm.communicator import Communicator
from hethub.errors import CheckpointError
from hethub.runtime import checkpoint_io as io
from hethub.runtime.checkpoint_saver import CheckpointSaver
from hethub.runtime.trainer import Trainer, TrainerConfig

CFG = TrainerConfig(optim=replace(OPTIM, total_steps=4, warmup_steps=1))
PLAN = make_plan([(2, 2, [(F, 1, 4), (F, 1, 2)])])


warm_imports()


def _step(trainer: Trainer, data: torch.Tensor) -> None:
    trainer.forward_backward(data)
    trainer.sync_grads()
    trainer.clip_and_update()


def _params(trainer: Trainer) -> dict[str, np.ndarray]:
    return {n: p.detach().numpy().copy() for n, p in trainer.model.named_parameters()}


def _saved(root: Path, step: int) -> dict[str, np.ndarray]:
    d = root / io.step_dir_name(step)
    m = io.read_manifest(d)
    out = {}
    for f in sorted(x for x in m["files"] if x.startswith("model-")):
        out |= {k: v.numpy() for k, v in io.load_verified(d, f, m).items()}
    return out


def _train_and_save(rank: int, root: str, asynchronous: bool, gate: bool) -> dict[str, np.ndarray]:
    """Step, save step 1, step again while the save is in flight (its writer held back by ``gate``
    until the next step has changed every parameter), then commit. Returns the parameters at the save."""
    trainer = Trainer(PLAN, rank=rank, comm=Communicator(timeout=TIMEOUT), cfg=CFG)
    data = batches(PLAN, steps=2)
    saver = CheckpointSaver(trainer, root=Path(root), run="r", asynchronous=asynchronous)
    _step(trainer, data[0])
    at_save = _params(trainer)
    release = threading.Event()
    if gate:
        real = io.save_tensors

        def held(path, obj):
            release.wait(30)
            return real(path, obj)

        io.save_tensors = held
    assert saver.save(1) is None if asynchronous else saver.save(1) is not None
    assert saver.poll() is None or not gate  # a held writer is not done: poll returns without committing
    _step(trainer, data[1])
    release.set()
    saver.close()
    changed = _params(trainer)
    assert all(not np.array_equal(changed[n], at_save[n]) for n in at_save)
    return at_save


def test_background_save_holds_the_state_at_the_save_and_equals_a_synchronous_one(tmp_path: Path) -> None:
    got = run_ranks(2, _train_and_save, str(tmp_path / "async"), True, True)
    run_ranks(2, _train_and_save, str(tmp_path / "sync"), False, False)
    a, s = _saved(tmp_path / "async", 1), _saved(tmp_path / "sync", 1)
    assert set(a) == set(s) and all(np.array_equal(a[k], s[k]) for k in a)
    for rank_params in got:
        for name, value in rank_params.items():
            assert np.array_equal(a[f"param:{name}"], value)
    assert io.read_manifest(tmp_path / "async" / "step-000001")["run"] == "r"


def _saved_once(rank: int, root: str) -> CheckpointSaver:
    """A trainer one step in, whose step-1 checkpoint is committed in the background."""
    trainer = Trainer(PLAN, rank=rank, comm=Communicator(timeout=TIMEOUT), cfg=CFG)
    saver = CheckpointSaver(trainer, root=Path(root), run="r")
    _step(trainer, batches(PLAN, steps=1)[0])
    saver.save(1)
    saver.wait()
    return saver


def _failing_writer(rank: int, root: str) -> str:
    saver = _saved_once(rank, root)
    if rank == 1:
        def full(path, obj):
            raise OSError(28, "No space left on device")

        io.save_tensors = full
    saver.save(2)
    try:
        saver.close()
    except CheckpointError as err:
        return str(err)
    return ""


def test_a_background_writer_failing_on_one_rank_stops_every_rank(tmp_path: Path) -> None:
    errs = run_ranks(2, _failing_writer, str(tmp_path))
    assert all("failed on rank 1" in e and "No space left on device" in e for e in errs)
    assert io.committed_steps(tmp_path) == [1] and not (tmp_path / "step-000002.tmp").exists()


def _killed_mid_write(rank: int, root: str) -> bool:
    saver = _saved_once(rank, root)
    real, wrote = io.save_tensors, threading.Event()

    def stuck(path, obj):
        entry = real(path, obj)  # one file complete on disk, then the process dies
        wrote.set()
        threading.Event().wait(60)
        return entry

    io.save_tensors = stuck
    saver.save(2)
    ok = wrote.wait(30)
    saver.trainer.comm.barrier()
    return ok  # then the harness ends the process (os._exit) with the writer mid-save, before any commit


def test_a_process_killed_during_a_background_write_leaves_the_previous_checkpoint(tmp_path: Path) -> None:
    assert run_ranks(2, _killed_mid_write, str(tmp_path)) == [True, True]
    assert io.committed_steps(tmp_path) == [1] and io.latest_dir(tmp_path).name == "step-000001"
    tmp = tmp_path / "step-000002.tmp"
    assert any(tmp.iterdir()) and not (tmp / io.MANIFEST).exists()
    assert io.resolve(tmp_path).name == "step-000001"
