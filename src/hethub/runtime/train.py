"""One training rank: ``torchrun --nproc-per-node N -m hethub.train --plan plan.json ...`` (the entry
point, ``hethub.train``, settles the plan and hands it here).

Takes the plan from the entry point, checks the launch matches it (WORLD_SIZE == plan.world_size),
initialises torch.distributed, builds this rank's stage and trains. The last stage's TP-rank-0 of
pipeline 0 prints one line per step and, with ``--metrics FILE``, appends one JSON object per step
(schema in ``hethub.runtime.metrics``). Checkpoints, ``--resume`` and elastic restarts: docs/reliability.md.
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import os
import sys
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import NoReturn

import torch
import torch.distributed as dist

from hethub.comm.factory import make_communicator
from hethub.errors import HethubError, RuntimeSetupError
from hethub.plan import Plan
from hethub.progress import progress
from hethub.runtime import run_extras
from hethub.runtime.checkpoint import Resumed, claim_root, load_newest_valid
from hethub.runtime.checkpoint_io import latest_dir
from hethub.runtime.checkpoint_runs import resumes_root
from hethub.runtime.checkpoint_saver import CheckpointSaver
from hethub.runtime.devices import (
    activate,
    device_types_of_kinds,
    placement_summary,
    plan_placement,
    world_backend,
)
from hethub.runtime.elastic import init_process_group, maybe_inject_fault
from hethub.runtime.optim import OptimConfig
from hethub.runtime.rebalance import LiveRebalance
from hethub.runtime.stack_check import check_rank_stack
from hethub.runtime.train_args import done_marker, parse_rank_args
from hethub.runtime.trainer import Trainer, TrainerConfig


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The flags (hethub.runtime.train_args, shared with the 'hethub train' launcher), checked."""
    return parse_rank_args(argv)


def _env_int(name: str) -> int:
    v = os.environ.get(name)
    if v is None:
        raise RuntimeSetupError(f"environment variable {name} is not set: this module runs under torchrun. Fix: "
                                "torchrun --nproc-per-node N -m hethub.train --plan plan.json")
    return int(v)


# (args, world_size=, rank=) -> the plan this rank runs; called before any process group exists.
PlanOf = Callable[..., Plan]


def run(args: argparse.Namespace, *, plan_of: PlanOf) -> None:
    world, rank = _env_int("WORLD_SIZE"), _env_int("RANK")
    plan = plan_of(args, world_size=world, rank=rank)
    if world != plan.world_size:
        raise RuntimeSetupError(f"the job has WORLD_SIZE={world} processes but plan {args.plan} needs "
                                f"{plan.world_size} (one per device). Fix: launch with --nproc-per-node "
                                f"{plan.world_size} (or nodes x nproc = {plan.world_size}).")
    # Each rank on its kind's device (catalog device_type, index from the node layout). A torch or
    # extension of the wrong version, a missing package or device stops here, before any process
    # group, naming the rank and the kind.
    check_rank_stack(plan, rank)
    placement = plan_placement(plan, rank)
    activate(placement)
    init_process_group(world_backend(plan), timeout=timedelta(seconds=args.timeout_s))
    try:
        timeout = timedelta(seconds=args.timeout_s)
        comm = make_communicator(plan=plan, rank=rank, timeout=timeout, device_types=device_types_of_kinds(plan))
        if rank == 0:
            print("hethub.train: placement and groups\n" + placement_summary(plan, getattr(comm, "describe", None)
                                                                              and comm.describe()), flush=True)
        warmup = args.warmup_steps if args.warmup_steps is not None else max(1, args.steps // 10)
        optim = OptimConfig(lr=args.lr, min_lr_ratio=args.min_lr_ratio, warmup_steps=warmup,
                            total_steps=args.steps, weight_decay=args.weight_decay, grad_clip=args.grad_clip)
        device = placement.device
        # Each rank trains in its kind's precision (runtime/precision.py: kind_precision).
        cfg = TrainerConfig(optim=optim, seed=args.seed, device=str(device), trace=args.trace,
                            grad_bucket_elems=args.grad_bucket_elems,
                            overlap_grad_reduce=not args.no_overlap_grad_reduce, compile=args.compile)
        trainer = Trainer(plan, rank=rank, comm=comm, cfg=cfg)
        extras = run_extras.setup(args, trainer)  # initial weights, data, evaluation, TensorBoard
        source = extras.source
        saver = _claim_checkpoints(args, trainer)
        resumed = _resume(args, trainer)
        start = resumed.step if resumed is not None else 0
        extras.check_resume(resumed)
        if start >= args.steps and rank == trainer.topo.log_rank:
            print(f"hethub.train: the checkpoint is at step {start} = --steps {args.steps}: the run is already "
                  "complete, nothing to do.", flush=True)
        out = Path(args.metrics) if args.metrics else None
        if out is not None and rank == trainer.topo.log_rank:
            out.parent.mkdir(parents=True, exist_ok=True)
            _keep_records_before(out, start)
        logs = rank == trainer.topo.log_rank
        # A bar on a terminal; elsewhere the per-step lines below are the log (with rate), so the
        # bar's own periodic lines go to a sink.
        bar = progress(args.steps - start, desc="train", unit="steps",
                       stream=sys.stderr if logs and sys.stderr.isatty() else io.StringIO())
        rebalance = LiveRebalance.from_args(args, trainer)  # docs/rebalance.md
        for step in range(start, args.steps):
            maybe_inject_fault(rank=rank, step=step)
            rebalance.before_step(step)
            rec = trainer.train_step(source.global_batch_at(step), step=step)
            # A change applies at this step boundary on every rank; a save in flight commits first.
            rebalance.after_step(step, rec, before_change=saver and (lambda: _saved(saver.wait(), saver, trainer)))
            extras.after_step(step, rec)
            if saver is not None:
                _saved(saver.poll(), saver, trainer)  # commits a background save once every rank wrote it
                if args.checkpoint_every and (step + 1) % args.checkpoint_every == 0 and step + 1 < args.steps:
                    _saved(saver.save(step + 1, meta=extras.meta), saver, trainer)
            if rec is None:
                continue
            emu = " (emulated kinds: " + ", ".join(k for k, v in rec["kinds"].items() if v["emulated"]) + ")" \
                if rec["emulated"] else ""
            bar.update()
            bar.note(f"loss {rec['loss']:.4f}, {rec['tokens_per_s']:,.0f} tok/s")
            if not bar.is_bar:
                print(f"step {step:5d}  loss {rec['loss']:.4f}  step {rec['step_time_s'] * 1e3:8.1f} ms  "
                      f"{rec['tokens_per_s']:10.0f} tok/s{emu}", flush=True)
            if out is not None:
                with out.open("a", encoding="utf-8") as f:
                    f.write(json.dumps(rec) + "\n")
        bar.close()
        if saver is not None:
            if start < args.steps:
                saver.save(args.steps, meta=extras.meta)
            _saved(saver.wait(), saver, trainer)
            saver.close()
        extras.finish(trained=start < args.steps)
        # Tear down only once every rank is done: a rank leaving while a peer's last gloo transfer
        # is in flight can abort that peer (seen rarely as "terminate called without an active
        # exception").
        comm.barrier()
        _mark_done(rank)
    finally:
        dist.destroy_process_group()


def _mark_done(rank: int) -> None:
    """Under ``hethub train`` (HETHUB_ERROR_DIR set): leave ``rank-N.done`` once every rank has
    finished training (after the final barrier), so the launcher can tell a process that aborted in
    its teardown, with every output written, from one that failed."""
    folder = os.environ.get("HETHUB_ERROR_DIR")
    if folder:
        try:
            done_marker(folder, rank).touch()
        except OSError:
            pass  # the launcher then treats a failing exit as a failure, the safe side


def _claim_checkpoints(args: argparse.Namespace, trainer: Trainer) -> CheckpointSaver | None:
    """Lock --checkpoint-dir for this run and claim it (a root of another run is refused unless this
    run resumes it or starts over: runtime/checkpoint_runs.py); the saver that writes the run's checkpoints."""
    if not args.checkpoint_dir:
        return None
    root = Path(args.checkpoint_dir)
    claim = claim_root(trainer, root, resume=resumes_root(args.resume, root), start_over=args.start_over)
    if trainer.rank == 0:
        if claim.moved_to is not None:
            print(f"hethub.train: --start-over: the earlier run's checkpoints were moved to {claim.moved_to}",
                  flush=True)
        print(f"hethub.train: run {claim.run} ({'continued' if claim.resumed_run else 'new'}), checkpoints in "
              f"{root}", flush=True)
    return CheckpointSaver(trainer, root=root, keep=args.keep_checkpoints, run=claim.run,
                           asynchronous=not args.checkpoint_sync)


def _saved(path: Path | None, saver: CheckpointSaver, trainer: Trainer) -> None:
    """Rank 0 announces a committed checkpoint, with what it cost the training thread."""
    if path is None or trainer.rank != 0:
        return
    rec = saver.records[-1]
    size = sum(f.stat().st_size for f in path.iterdir() if f.is_file())
    how = (f"training stalled {rec.stall_s:.2f} s, written in the background in {rec.write_s:.2f} s"
           if saver.asynchronous else f"{rec.stall_s:.2f} s")
    print(f"hethub.train: checkpoint saved: {path} (step {rec.step}, {size / 2**20:.1f} MiB, {how})", flush=True)


def _resume(args: argparse.Namespace, trainer: Trainer) -> Resumed | None:
    """The checkpoint restored (None: start at step 0)."""
    if not args.resume:
        return None
    if args.resume == "auto":
        if latest_dir(Path(args.checkpoint_dir)) is None:
            return None  # the first attempt of an elastic job: nothing saved yet
        src = args.checkpoint_dir
    else:
        src = args.resume
    got, skipped = load_newest_valid(trainer, src, fallback=not args.no_checkpoint_fallback,
                                     allow_schedule_change=args.allow_schedule_change)
    if trainer.rank == trainer.topo.log_rank:
        for why in skipped:
            print(f"hethub.train: warning: skipping a corrupt checkpoint: {why.split(' Fix:')[0]} Resuming from "
                  f"the newest valid one instead (--no-checkpoint-fallback stops here instead).", flush=True)
        how = " (saved under another plan: resharded)" if got.resharded else ""
        print(f"hethub.train: resumed from {got.path} at step {got.step}{how}", flush=True)
    return got


def _keep_records_before(path: Path, step: int) -> None:
    """Drop metrics of steps >= ``step`` (a resumed run redoes them); start the file anew at step 0."""
    keep = []
    if step > 0 and path.is_file():
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                if json.loads(line).get("step", step) < step:
                    keep.append(line)
            except json.JSONDecodeError:
                pass  # a line cut short by the failure that made us resume
    path.write_text("".join(line + "\n" for line in keep), encoding="utf-8")


def main(argv: list[str] | None = None, *, plan_of: PlanOf) -> int:
    """``plan_of``: the entry point's settling of the plan (``hethub.train.rank_plan``)."""
    _leave_pid()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    try:
        run(parse_args(argv), plan_of=plan_of)
    except HethubError as err:
        report_rank_error(err)
        return err.exit_code
    return 0


def _leave_pid() -> None:
    """Under ``hethub train``: this rank's pid in the hand-off folder, so the launcher can make sure no
    rank outlives the run (runtime/supervise.py)."""
    folder = os.environ.get("HETHUB_ERROR_DIR")
    if folder:
        from hethub.runtime.supervise import rank_pid_file

        try:
            rank_pid_file(folder, os.environ.get("RANK", "x")).write_text(str(os.getpid()), encoding="ascii")
        except OSError:
            pass  # the launcher then relies on torchrun alone to stop this rank


def report_rank_error(err: HethubError) -> None:
    """Under ``hethub train`` (HETHUB_ERROR_DIR set) the launcher prints each distinct rank error once;
    this rank leaves its message there. Under plain torchrun every rank prints, naming itself."""
    folder = os.environ.get("HETHUB_ERROR_DIR")
    rank = os.environ.get("RANK", "?")
    if folder:
        try:
            Path(folder, f"rank-{rank}.json").write_text(json.dumps({"rank": rank, "exit_code": err.exit_code,
                                                                     "message": str(err)}), encoding="utf-8")
            return
        except OSError:
            pass  # fall through: print it ourselves
    print(f"hethub.train: error (rank {rank}): {err}", file=sys.stderr, flush=True)


def exit_rank(code: int) -> NoReturn:
    """End this rank's process with ``code``, skipping interpreter finalization.

    destroy_process_group() in run() does not stop every gloo thread: a group the communicator still
    references keeps its worker and transport threads until finalization frees it, in an order torch
    does not control, and a rank occasionally aborted there after training had completed ("terminate
    called without an active exception"). Nothing is left to write at this point (checkpoints and
    metrics are closed), so the process ends at once, as ranks forked by ``launch_forked`` do.
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
