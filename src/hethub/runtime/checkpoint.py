"""Save and load a training run's state per parameter name, so any plan can resume any checkpoint.

State is stored by full-model parameter name as *full* tensors (TP shards gathered within the
stage's TP group; a ZeRO-1 run's optimizer slices all-gathered among their owners first), each
written once: by the lowest rank holding it (DP replicas and a tied head
hold identical copies; AdamW is element-wise, so their optimizer state is identical too). Loading
under any plan — other stage splits, TP/DP degrees or kinds — is then "every rank slices what it
holds". Beside tensors a checkpoint records the step (which fixes the LR schedule position and,
since batches are a pure function of the step, the data position), the model shape it fits, the
plan it was saved under, and every rank's RNG state. Files, atomicity and checksums:
``checkpoint_io``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hethub.errors import CheckpointError
from hethub.layout import unit_of
from hethub.runtime import checkpoint_io as io
from hethub.runtime import checkpoint_runs as runs
from hethub.runtime.tensor_parallel import shard
from hethub.runtime.trainer import Trainer

_OPT_KEYS = ("exp_avg", "exp_avg_sq")
# Encoded in one all-reduce(max) so that every rank can name the bad file, not only the one that read it.
_PROBLEMS = ("is missing", "has a different size than the manifest says",
             "does not match its sha256 checksum in the manifest")


@dataclass(frozen=True)
class Resumed:
    step: int  # optimizer steps already done = the next step to run
    path: Path
    resharded: bool  # saved under a different plan (RNG states then stay as they are)


def owner_rank(trainer: Trainer, name: str) -> int:
    """The one rank that writes parameter ``name``: the lowest rank among all its holders."""
    return min(r for st in trainer.topo.unit_holders[unit_of(name)] for r in st.ranks)


def full_tensor(trainer: Trainer, name: str, t: torch.Tensor) -> torch.Tensor:
    """The full tensor of a TP-sharded parameter (or its optimizer state); collective over the TP group.
    Not a copy when unsharded: :func:`_to_host` makes the snapshot's own copy."""
    dim, ranks = trainer.model.shard_dim(name), trainer.place.tp_group
    if dim is None or len(ranks) == 1:
        return t.detach()
    # all_gather concatenates in ascending rank order; TP rank order is the stage's device order.
    parts = trainer.comm.all_gather(t.detach().contiguous(), group=ranks, dim=dim).chunk(len(ranks), dim=dim)
    by_rank = dict(zip(sorted(ranks), parts, strict=True))
    return torch.cat([by_rank[r] for r in ranks], dim=dim)


def _to_host(t: torch.Tensor, buffers: dict[str, torch.Tensor] | None, key: str) -> torch.Tensor:
    """A host copy of ``t`` that later training steps cannot change. From an accelerator the copy is
    queued on the current stream without waiting (``Snapshot.ready`` waits for it) into page-locked
    memory, reused from ``buffers`` across saves when the shape matches."""
    if t.device.type == "cpu":
        return t.detach().clone()
    out = buffers.get(key) if buffers is not None else None
    if out is None or out.shape != t.shape or out.dtype != t.dtype:
        try:
            out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        except RuntimeError:  # no page-locked memory for this device type: a plain host tensor
            out = torch.empty(t.shape, dtype=t.dtype)
        if buffers is not None:
            buffers[key] = out
    out.copy_(t.detach(), non_blocking=True)
    return out


@dataclass
class Snapshot:
    """This rank's part of checkpoint ``step`` in host memory: everything the writer needs, nothing the
    training loop changes afterwards (so the files can be written while training goes on)."""

    step: int
    tensors: dict[str, torch.Tensor]  # "param:NAME", "exp_avg:NAME", "exp_avg_sq:NAME", "step:NAME"
    shapes: dict[str, dict[str, Any]]  # the manifest's "tensors" entries of the parameters this rank writes
    rng: dict[str, torch.Tensor]
    fence: Any = None  # an accelerator event after the device-to-host copies; None on CPU

    def ready(self) -> None:
        """Wait until the device-to-host copies have landed (any thread may call it)."""
        if self.fence is not None:
            self.fence.synchronize()


def _fail_together(trainer: Trainer, code: int) -> int:
    """Max of ``code`` over all ranks: a failure on one rank stops every rank instead of hanging them."""
    flag = torch.tensor([code], dtype=torch.int64)
    trainer.comm.all_reduce(flag, op="max")
    return int(flag)


def _share_text(trainer: Trainer, text: str, *, max_bytes: int = 1024) -> str:
    """Collective: the one non-empty ``text`` among the ranks, on every rank (so each names the cause)."""
    buf = torch.zeros(max_bytes, dtype=torch.int32)
    raw = text.encode("utf-8")[:max_bytes]
    if raw:
        buf[:len(raw)] = torch.tensor(list(raw), dtype=torch.int32)
    trainer.comm.all_reduce(buf, op="max")
    return bytes(buf[buf > 0].tolist()).decode("utf-8", "replace")


def _raise_if_failed(trainer: Trainer, error: str, *, root: Path, step: int) -> None:
    """Collective (also a barrier): if any rank failed to write, every rank raises CheckpointError and
    rank 0 removes the unfinished ``step-N.tmp/`` (on a full disk it holds the space the next try needs)."""
    failed = _fail_together(trainer, trainer.rank + 1 if error else 0)
    if not failed:
        return
    error = _share_text(trainer, error if trainer.rank == failed - 1 else "")
    tmp = root / (io.step_dir_name(step) + ".tmp")
    if trainer.rank == 0:
        io.discard_tmp(root, step)
    prev = io.latest_dir(root)
    kept = f"the previous checkpoint {prev} is kept" if prev is not None else "no earlier checkpoint exists"
    raise CheckpointError(f"writing checkpoint '{tmp}' failed on rank {failed - 1}"
                          + (f": {error}" if error else " (see its message)")
                          + f"; the unfinished save was removed and {kept}. Fix: free space on (or fix the "
                          "permissions of) --checkpoint-dir, then resume with --resume auto.")


def begin_save(trainer: Trainer, *, root: Path, step: int) -> None:
    """Collective (also the barrier): rank 0 makes an empty ``step-N.tmp/`` before anyone writes into it."""
    error = ""
    if trainer.rank == 0:
        try:
            io.prepare_tmp(root, step)
        except OSError as err:
            error = f"{err}"
    _raise_if_failed(trainer, error, root=root, step=step)


def full_states(trainer: Trainer) -> Iterator[tuple[str, dict[str, torch.Tensor]]]:
    """Collective (every rank iterates to the end): each of this rank's parameters by full-model name,
    as full-size tensors: ``param`` (the fp32 master where one is kept) and, once AdamW has stepped,
    ``exp_avg``, ``exp_avg_sq`` and ``step``. TP shards are gathered within the stage and a sharded
    optimizer's slices within their owners, so the result is the same under any plan: what a
    checkpoint stores and what a live layer move carries (runtime/rebalance.py)."""
    # A sharded optimizer's slices, all-gathered into each parameter's local state (collective), so
    # the result holds the same full tensors whatever the sharding.
    states = trainer.zero.gather_state(trainer.optimizer) if trainer.zero is not None else None
    for name, p in sorted(trainer.model.named_parameters()):
        if states is not None:
            st = states.get(name, {})
        else:  # what AdamW steps: the parameter, or its fp32 master in mixed precision (runtime/precision.py)
            master = trainer.masters.of(p) if trainer.masters is not None else p
            st = trainer.optimizer.state.get(master, {}) | ({"param": master} if master is not p else {})
        # fp32 masters (mixed precision) are taken, not their 16-bit rounding.
        full = ({"param": full_tensor(trainer, name, st.get("param", p))}
                | {k: full_tensor(trainer, name, st[k]) for k in _OPT_KEYS if k in st})
        if "step" in st:
            full["step"] = st["step"]
        yield name, full


def snapshot(trainer: Trainer, step: int, *, buffers: dict[str, torch.Tensor] | None = None) -> Snapshot:
    """Collective: this rank's share of the checkpoint, copied to host memory. TP shards are gathered
    within their stage and a sharded optimizer's slices within their owners (every rank takes part);
    each parameter is then kept by its one writer, the lowest rank holding it."""
    rank = trainer.rank
    owned: dict[str, torch.Tensor] = {}
    shapes: dict[str, dict[str, Any]] = {}
    for name, full in full_states(trainer):
        if owner_rank(trainer, name) != rank:
            continue
        owned |= {f"{k}:{name}": _to_host(v, buffers, f"{k}:{name}") for k, v in full.items()}
        shapes[name] = {"shape": list(full["param"].shape), "dtype": str(full["param"].dtype).removeprefix("torch."),
                        "optim": "step" in full}
    rng = {"cpu": torch.get_rng_state()} | ({"cuda": torch.cuda.get_rng_state()}
                                           if trainer.device.type == "cuda" else {})
    fence = None
    if trainer.device.type != "cpu":
        fence = torch.Event(device=trainer.device)
        fence.record()
    return Snapshot(step=step, tensors=owned, shapes=shapes, rng=rng, fence=fence)


def write_snapshot(snap: Snapshot, *, root: Path, rank: int) -> tuple[dict[str, dict[str, Any]], str]:
    """Write this rank's files of ``snap`` into ``step-N.tmp/`` (fsynced, with their sha256): file I/O
    only, no collective, so a background thread may run it. Returns the files' manifest entries and
    the error ('' if none): a failure is reported to every rank at the commit, not raised here."""
    tmp = root / (io.step_dir_name(snap.step) + ".tmp")
    files: dict[str, dict[str, Any]] = {}
    try:
        snap.ready()
        if snap.tensors:
            fname = f"model-r{rank:05d}.pt"
            files[fname] = dataclasses.asdict(io.save_tensors(tmp / fname, snap.tensors))
            for v in snap.shapes.values():
                v["file"] = fname
        files[f"rng-r{rank:05d}.pt"] = dataclasses.asdict(io.save_tensors(tmp / f"rng-r{rank:05d}.pt", snap.rng))
    except OSError as err:
        return files, f"{err}"
    except Exception as err:  # any other failure too: reported on every rank at the commit, never a hang
        return files, f"{type(err).__name__}: {err}"
    return files, ""


def commit_save(trainer: Trainer, snap: Snapshot, files: dict[str, dict[str, Any]], error: str, *, root: Path,
                keep: int, meta: dict[str, Any] | None, run: str | None) -> Path:
    """Collective, once every rank has written (or failed to write) its files: every rank raises
    CheckpointError if one failed; else rank 0 writes the manifest, publishes ``step-N/`` and prunes
    the run's older checkpoints. Nobody runs on before the checkpoint is committed."""
    step = snap.step
    step_failed = functools.partial(_raise_if_failed, trainer, root=root, step=step)
    step_failed(error)
    gathered = trainer.comm.gather_objects((files, snap.shapes), dst=0)
    if gathered is not None:
        plan = trainer.plan
        manifest = {
            "format": io.FORMAT, "version": io.VERSION, "step": step, "run": run,
            "data": {"next_step": step, "next_sequence": step * plan.global_batch},
            "model": plan.model.to_dict(), "global_batch": plan.global_batch, "seq_len": plan.seq_len,
            "world_size": plan.world_size, "plan": plan.to_dict(), "seed": trainer.cfg.seed,
            "optim": dataclasses.asdict(trainer.cfg.optim), "meta": meta or {},
            "files": {f: e for fs, _ in gathered for f, e in fs.items()},
            "tensors": {n: s for _, ss in gathered for n, s in ss.items()},
            "rng": {str(r): f"rng-r{r:05d}.pt" for r in range(plan.world_size)},
        }
        try:
            io.commit(root, step, manifest)
            io.prune(root, keep=keep, steps=runs.run_steps(root, run))
        except OSError as err:
            error = f"{err}"
    step_failed(error)
    return root / io.step_dir_name(step)


def save_checkpoint(trainer: Trainer, *, root: str | Path, step: int, keep: int = 3,
                    meta: dict[str, Any] | None = None, run: str | None = None) -> Path:
    """Collective: write ``root/step-NNNNNN/`` for ``step`` optimizer steps done, synchronously (training
    waits for the files); returns its path. ``CheckpointSaver`` writes in the background instead."""
    root = Path(root)
    begin_save(trainer, root=root, step=step)
    snap = snapshot(trainer, step)
    files, error = write_snapshot(snap, root=root, rank=trainer.rank)
    return commit_save(trainer, snap, files, error, root=root, keep=keep, meta=meta, run=run)


_HELD_LOCKS: list[int] = []  # descriptors of held root locks: released when this process ends


def claim_root(trainer: Trainer, root: Path, *, resume: bool, start_over: bool) -> runs.Claim:
    """Collective: rank 0 locks ``root`` for this process's life and claims it for this run
    (``checkpoint_runs.claim``: a root of another run is refused unless resumed or started over);
    every rank gets the run id, or the same CheckpointError."""
    problem, claim = "", None
    if trainer.rank == 0:
        try:
            _HELD_LOCKS.append(io.lock_dir(root))
            claim = runs.claim(root, resume=resume, start_over=start_over)
        except (CheckpointError, OSError) as err:
            problem = str(err)
    problem = _share_text(trainer, problem, max_bytes=2048)
    if problem:
        raise CheckpointError(problem)
    run = _share_text(trainer, claim.run if claim is not None else "")
    return claim if claim is not None else runs.Claim(run=run, resumed_run=resume)


def _check_compatible(trainer: Trainer, manifest: dict[str, Any], step_dir: Path) -> None:
    """Plan-independent checks (same result on every rank: no collective needed)."""
    plan, where = trainer.plan, step_dir / io.MANIFEST
    saved, now = dict(manifest["model"]), plan.model.to_dict()
    saved.pop("name", None)
    diff = [k for k in sorted(set(saved) | set(now) - {"name"}) if saved.get(k) != now.get(k)]
    if diff:
        k = diff[0]
        raise CheckpointError(f"{where}: the checkpoint is of a different model: '{k}' is {saved.get(k)!r} there "
                              f"but {now.get(k)!r} in plan's model {plan.model.name!r}. Fix: resume with a plan for "
                              "the model the checkpoint was trained with.")
    if manifest.get("global_batch") != plan.global_batch or manifest.get("seq_len") != plan.seq_len:
        raise CheckpointError(f"{where}: the checkpoint was trained with global_batch={manifest.get('global_batch')}, "
                              f"seq_len={manifest.get('seq_len')}; the plan has {plan.global_batch}, {plan.seq_len}. "
                              "Fix: resume under a plan with the same global batch and sequence length (the data "
                              "position and the loss scale depend on them).")


# The LR schedule's settings, with the flag that sets each: a resume under other values changes the LR
# curve from the checkpoint's step on (the schedule is rebuilt from the step, not stored).
_SCHEDULE_FLAGS = {"total_steps": "--steps", "warmup_steps": "--warmup-steps", "lr": "--lr",
                   "min_lr_ratio": "--min-lr-ratio"}


def _check_schedule(trainer: Trainer, manifest: dict[str, Any], step_dir: Path) -> None:
    saved = manifest.get("optim") or {}
    now = dataclasses.asdict(trainer.cfg.optim)
    for key, flag in _SCHEDULE_FLAGS.items():
        if key in saved and saved[key] != now[key]:
            raise CheckpointError(
                f"{step_dir / io.MANIFEST}: the checkpoint was trained with {flag} {saved[key]} (field 'optim."
                f"{key}'), this run asks for {flag} {now[key]}: resuming would change the learning-rate schedule "
                f"from step {manifest['step']} on. Fix: resume with {flag} {saved[key]}, or pass "
                "--allow-schedule-change to continue on the new schedule.")


def _param_problem(trainer: Trainer, manifest: dict[str, Any], step_dir: Path) -> str:
    """What is wrong with this rank's parameters in the manifest ('' if nothing): rank-local, so the
    caller reports it through the shared failure flag."""
    for name, p in trainer.model.named_parameters():
        entry = manifest["tensors"].get(name)
        shape = list(p.shape)
        dim = trainer.model.shard_dim(name)
        if dim is not None:
            shape[dim] *= trainer.place.stage.tp
        if entry is None or entry.get("shape") != shape or entry.get("file") not in manifest["files"]:
            return (f"{step_dir / io.MANIFEST}: parameter '{name}' is missing or has another shape "
                    f"({None if entry is None else entry.get('shape')} vs {shape})")
    return ""


def load_newest_valid(trainer: Trainer, path: str | Path, *, fallback: bool = True,
                      allow_schedule_change: bool = False) -> tuple[Resumed, list[str]]:
    """Collective: :func:`load_checkpoint` of ``path``; when ``path`` is a checkpoint root whose newest
    checkpoint is corrupt and ``fallback`` is on, the next older committed one is tried, and so on.

    Returns what was loaded and, per corrupt checkpoint passed over, its error (the caller warns).
    The fallback stays within the root's run (``checkpoint_runs``): another run's checkpoint is never
    resumed in place of a corrupt one. Every rank sees the same files and agrees on each verdict
    (load_checkpoint's checks are collective or read the same manifest), so all ranks fall back together.
    """
    first = io.resolve(path)
    root = Path(path)
    if first == root or not fallback:  # an explicit step directory: exactly that one
        return load_checkpoint(trainer, first, allow_schedule_change=allow_schedule_change), []
    run = runs.read_run_id(root)
    older = [root / io.step_dir_name(s) for s in reversed(runs.run_steps(root, run))]
    candidates = [first, *(d for d in older if d.name != first.name)]
    skipped: list[str] = []
    for i, step_dir in enumerate(candidates):
        try:
            return load_checkpoint(trainer, step_dir, allow_schedule_change=allow_schedule_change), skipped
        except io.CorruptCheckpointError as err:
            if i == len(candidates) - 1:
                raise
            skipped.append(str(err))
    raise AssertionError("unreachable: resolve() found a checkpoint")


def load_checkpoint(trainer: Trainer, path: str | Path, *, allow_schedule_change: bool = False) -> Resumed:
    """Collective: restore parameters, AdamW state, LR schedule and RNG from ``path`` (a step directory, or a
    root whose newest checkpoint is used), under whatever plan ``trainer`` runs. Verifies every file it reads.
    A checkpoint saved under another LR schedule is refused unless ``allow_schedule_change``."""
    step_dir = io.resolve(path)
    manifest = io.read_manifest(step_dir)
    _check_compatible(trainer, manifest, step_dir)
    if not allow_schedule_change:
        _check_schedule(trainer, manifest, step_dir)
    bad_param = _param_problem(trainer, manifest, step_dir)
    if _fail_together(trainer, 1 if bad_param else 0):
        raise CheckpointError(f"{bad_param or f'{step_dir}: a parameter check failed on another rank'}; the "
                              "checkpoint does not fit this model. Fix: resume with the model it was saved with.")
    resharded = manifest.get("plan", {}).get("pipelines") != trainer.plan.to_dict()["pipelines"]
    named = dict(sorted(trainer.model.named_parameters()))
    need = sorted({manifest["tensors"][n]["file"] for n in named})
    rng_file = manifest.get("rng", {}).get(str(trainer.rank))
    if not resharded and rng_file:
        need.append(rng_file)
    order = sorted(set(manifest["files"]) | set(need))
    code = 0
    for f in need:
        problem = io.check_file(step_dir, f, manifest["files"].get(f, {}))
        if problem:
            kind = 0 if problem == "is missing" else 1 if "bytes" in problem else 2
            code = max(code, (order.index(f) + 1) * len(_PROBLEMS) + kind)
    code = _fail_together(trainer, code)
    if code:
        raise io.corrupt_error(step_dir, order[code // len(_PROBLEMS) - 1], _PROBLEMS[code % len(_PROBLEMS)])
    data: dict[str, torch.Tensor] = {}
    for f in need:
        data |= torch.load(step_dir / f, map_location="cpu", weights_only=True, mmap=True)
    load_full_state(trainer, {n: {"param": data[f"param:{n}"]}
                              | ({k: data[f"{k}:{n}"] for k in (*_OPT_KEYS, "step")}
                                 if manifest["tensors"][n].get("optim") else {}) for n in named})
    step = int(manifest["step"])
    restore_schedule(trainer, step)
    if not resharded and rng_file:
        torch.set_rng_state(data["cpu"])
        if "cuda" in data and trainer.device.type == "cuda":
            torch.cuda.set_rng_state(data["cuda"])
    return Resumed(step=step, path=step_dir, resharded=resharded)


def load_full_state(trainer: Trainer, full: Mapping[str, Mapping[str, torch.Tensor]]) -> None:
    """This rank's parameters and AdamW state from full-size tensors by name (``full_states``' form:
    ``param``, and once stepped ``exp_avg``, ``exp_avg_sq`` and ``step``), whatever the plan or the
    sharding they came from: each rank slices what it holds; a ZeRO-1 rank takes its slices
    (runtime/zero.py)."""
    tp = trainer.model.tp
    with torch.no_grad():
        for name, p in trainer.model.named_parameters():
            dim = trainer.model.shard_dim(name)
            p.copy_(shard(full[name]["param"], dim=dim, tp=tp))
            if trainer.zero is None:
                master = trainer.masters.of(p) if trainer.masters is not None else p
                if master is not p:  # the fp32 values, not the 16-bit parameter's rounding
                    master.copy_(shard(full[name]["param"], dim=dim, tp=tp))
                if "exp_avg" in full[name]:
                    trainer.optimizer.state[master] = {
                        "step": full[name]["step"].clone().to(p.device),  # fused AdamW keeps it there
                        **{k: shard(full[name][k], dim=dim, tp=tp).clone().to(p.device) for k in _OPT_KEYS}}
        if trainer.zero is not None:
            mine = {n: full[n] for n, _ in trainer.model.named_parameters()}
            stepped = [n for n, v in mine.items() if "exp_avg" in v]
            steps = int(mine[stepped[0]]["step"]) if stepped else 0  # AdamW's count (fp16 skips excluded)
            trainer.zero.load_state(trainer.optimizer, full=mine, steps=steps,
                                    shard=lambda x, name: shard(x, dim=trainer.model.shard_dim(name), tp=tp))


def restore_schedule(trainer: Trainer, step: int) -> None:
    """Put the LR schedule where it is after ``step`` optimizer steps, computing the LR exactly as
    ``LambdaLR`` does (base_lr * factor(step)) so a resumed run's LR is bit-identical. Rebuilt from the
    step rather than loaded, because param-group counts differ between plans."""
    sched = trainer.scheduler
    for g, base, fn in zip(trainer.optimizer.param_groups, sched.base_lrs, sched.lr_lambdas, strict=True):
        g["lr"] = base * fn(step)
    sched.last_epoch = step
    sched._last_lr = [g["lr"] for g in trainer.optimizer.param_groups]  # what get_last_lr() returns
