"""Checkpoints that do not stall training: the files are written by a background thread while the
next steps run; training waits only for the collectives and the device-to-host copy.

A save has three parts (``checkpoint.py``):

1. ``snapshot`` (every rank, on the training thread): TP shards and ZeRO slices gathered, each
   writer's tensors copied to host memory (page-locked and queued on the stream from an
   accelerator, so even the copy overlaps the next step's work). The training stall is this part.
2. ``write_snapshot`` (a background thread per rank): ``torch.save`` into ``step-N.tmp/``, fsync,
   sha256. File I/O only: no collective ever runs off the training thread, so the communicator's
   ordering (NCCL's rule that every rank issues collectives in one order) is never at risk.
3. ``commit_save`` (every rank, on the training thread): once every rank's writer has finished —
   agreed by one small all-reduce that ``poll`` runs after each step while a save is in flight — a
   failure anywhere raises CheckpointError on every rank, else rank 0 writes the manifest and
   renames the directory into place. A crash before that leaves only ``step-N.tmp/``, which is never
   read: an unfinished save never looks complete.

Why not ``torch.distributed.checkpoint.async_save``: it writes DCP's own layout (``.distcp`` files
and a ``.metadata`` index) for DTensor/ShardedTensor state dicts. hethub's checkpoint is full tensors
by parameter name, one file per writer rank, with a manifest of sha256 checksums published by one
atomic rename; its stage models hold plain tensors (a TP shard is a slice, not a DTensor), and DCP
checksums nothing and writes in place. So the same files are written by our own background writer.

One save at a time: a new save (and the end of the run) first waits for the previous one to commit.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from hethub.runtime.checkpoint import Snapshot, begin_save, commit_save, snapshot, write_snapshot
from hethub.runtime.trainer import Trainer


@dataclass
class _InFlight:
    snap: Snapshot
    meta: dict[str, Any]
    future: Future
    started_s: float  # perf_counter when its files started being written
    stall_s: float  # what its save() call cost the training thread


@dataclass
class SaveRecord:
    """One committed save, as the training thread experienced it."""

    path: Path
    step: int
    stall_s: float  # training thread blocked: snapshot (+ the write itself when synchronous) + commit
    write_s: float  # from the snapshot to the commit (background when asynchronous)
    bytes: int


@dataclass
class CheckpointSaver:
    """Saves of one run into ``root`` (collective calls: every rank makes the same calls in the same
    steps). ``asynchronous=False`` writes on the training thread (the files exist when ``save`` returns)."""

    trainer: Trainer
    root: Path
    keep: int = 3
    run: str | None = None
    asynchronous: bool = True
    records: list[SaveRecord] = field(default_factory=list)
    _pending: _InFlight | None = None
    _buffers: dict[str, torch.Tensor] = field(default_factory=dict)
    _pool: ThreadPoolExecutor | None = None

    def save(self, step: int, *, meta: dict[str, Any] | None = None) -> Path | None:
        """Start checkpoint ``step`` (after ``step`` optimizer steps); returns its path when it is
        already committed (synchronous), else None (``poll``/``wait`` commit it)."""
        self.wait()
        t0 = time.perf_counter()
        begin_save(self.trainer, root=self.root, step=step)
        snap = snapshot(self.trainer, step, buffers=self._buffers)
        if not self.asynchronous:
            files, error = write_snapshot(snap, root=self.root, rank=self.trainer.rank)
            return self._commit(snap, meta or {}, files, error, started_s=t0, stall_s=0.0, t0=t0)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hethub-ckpt")
        future = self._pool.submit(write_snapshot, snap, root=self.root, rank=self.trainer.rank)
        self._pending = _InFlight(snap=snap, meta=meta or {}, future=future, started_s=t0,
                                  stall_s=time.perf_counter() - t0)
        return None

    def poll(self) -> Path | None:
        """Collective while a save is in flight (call it after every step): commit the save if every
        rank's writer has finished, else return at once. Returns the committed path, or None."""
        if self._pending is None:
            return None
        flag = torch.tensor([0 if self._pending.future.done() else 1], dtype=torch.int64)
        self.trainer.comm.all_reduce(flag, op="max")
        if int(flag):
            return None
        return self.wait()

    def wait(self) -> Path | None:
        """Collective: block until the save in flight (if any) is written everywhere, then commit it."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        t0 = time.perf_counter()
        files, error = pending.future.result()
        return self._commit(pending.snap, pending.meta, files, error, started_s=pending.started_s,
                            stall_s=pending.stall_s, t0=t0)

    def close(self) -> None:
        """Commit what is in flight and stop the writer thread."""
        try:
            self.wait()
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None

    def _commit(self, snap: Snapshot, meta: dict[str, Any], files: dict[str, dict[str, Any]], error: str, *,
                started_s: float, stall_s: float, t0: float) -> Path:
        path = commit_save(self.trainer, snap, files, error, root=self.root, keep=self.keep, meta=meta, run=self.run)
        now = time.perf_counter()
        size = sum(int(e.get("bytes", 0)) for e in files.values())
        rec = SaveRecord(path=path, step=snap.step, stall_s=stall_s + (now - t0), write_s=now - started_s, bytes=size)
        self.records.append(rec)
        return path
