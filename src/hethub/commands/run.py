"""`hethub train` (a local torchrun launch of a plan) and `hethub demo` (the built-in local default)."""

from __future__ import annotations

import argparse

from hethub.argtypes import positive_int
from hethub.runtime import train_config
from hethub.runtime.train_args import add_train_arguments


def cmd_train(args: argparse.Namespace) -> int:
    import tempfile
    from pathlib import Path

    from hethub.errors import SpecError, require_extra

    require_extra("torch", what="'hethub train'")  # the ranks are torchrun's processes, not this one
    from hethub.plan import Plan
    from hethub.predict.fit import check_memory_fit
    from hethub.predict.predictor import predict
    from hethub.runtime.host_check import check_host
    from hethub.runtime.launch_checks import check_before_launch
    from hethub.runtime.train_args import parse_rank_args, train_argv

    extra = train_argv(args)  # the ranks' flags (with --config, which the ranks read too)
    plan_path, steps, metrics = args.plan, args.steps, args.metrics
    if args.config:  # the config's launcher part: model folder, plan; the ranks read the rest
        from hethub.commands.launch_config import prepare_launch
        from hethub.runtime.train_args import rank_parser

        train_config.defaults_from(rank_parser(), args.config)  # its types, before any planning
        got = prepare_launch(args.config)
        plan_path = plan_path or got["plan"]
        steps = steps or got["steps"]
        metrics = metrics or got["metrics"]
    if not plan_path:
        raise SpecError("hethub train needs --plan (or --config with a [plan] section). Fix: pass one.")
    # Everything that can be checked here is, once, before any rank starts: the ranks' own argument
    # parsing (config file included), the plan, its memory, this host's devices, the plan's sharding,
    # outputs and inputs (runtime/launch_checks.py), the checkpoint lock and the run in that folder.
    rank_args = parse_rank_args(["--plan", str(plan_path), *(["--steps", str(steps)] if steps else []),
                                 *(["--metrics", str(metrics)] if metrics else []), *extra])
    plan = Plan.load(plan_path)
    pred = predict(plan)
    check_memory_fit(plan, pred)
    check_host(plan, pred, plan_path=str(plan_path))
    check_before_launch(plan, rank_args, plan_path=str(plan_path))
    if rank_args.resume and rank_args.resume != "auto":
        from hethub.runtime.checkpoint_io import resolve

        resolve(rank_args.resume)
    if rank_args.checkpoint_dir:
        from hethub.runtime.checkpoint_runs import claim, resumes_root

        root = Path(rank_args.checkpoint_dir)
        _check_not_locked(root)
        claim(root, resume=resumes_root(rank_args.resume, root), start_over=rank_args.start_over, dry_run=True)
    from hethub.runtime.launch import launch_local
    from hethub.schedules import DEFAULT_P2P

    if plan.p2p != DEFAULT_P2P:
        print(f"note: training.p2p = {plan.p2p!r} describes another runtime's sends; hethub's runtime sends "
              f"{DEFAULT_P2P} (the field changes predictions only)", flush=True)
    print(f"launching {plan.world_size} local ranks for {rank_args.steps} steps (torchrun --standalone)", flush=True)
    with tempfile.TemporaryDirectory(prefix="hethub-errors-") as errors:
        proc = launch_local(plan_path, nproc=plan.world_size, steps=rank_args.steps, metrics=rank_args.metrics,
                            extra_args=extra, error_dir=errors)
        if getattr(proc, "signal", None) is not None:  # a LocalRun; stand-ins in tests may be plain
            return _stopped_by(proc.signal, root=rank_args.checkpoint_dir)
        if proc.returncode != 0 and not _finished_anyway(Path(errors), world=plan.world_size,
                                                         returncode=proc.returncode):
            raise _rank_failure(Path(errors), proc.returncode, signalled=getattr(proc, "signalled", {}))
    if rank_args.metrics:
        print(f"metrics written to {rank_args.metrics}")
    return 0


def _check_not_locked(root) -> None:
    import os

    from hethub.runtime.checkpoint_io import LOCK, lock_dir

    if not (root / LOCK).exists():
        return
    os.close(lock_dir(root))  # raises CheckpointError naming the holder; else released at once


def _stopped_by(signum: int, *, root: str | None) -> int:
    """The run was stopped by a signal to this launcher: say so, check the checkpoint lock is free,
    and exit 128 + the signal's number (the shell's convention: 143 SIGTERM, 130 SIGINT, 129 SIGHUP)."""
    import signal
    import sys
    from pathlib import Path

    name = signal.Signals(signum).name
    lock = ""
    if root:
        from hethub.errors import CheckpointError

        try:
            _check_not_locked(Path(root))
            lock = f"; the lock on {root} is released (resume with --resume auto)"
        except CheckpointError as err:
            lock = f"; but {err}"
    print(f"hethub train: stopped by {name}: torchrun and every rank were stopped{lock}", file=sys.stderr,
          flush=True)
    return 128 + signum


def _finished_anyway(errors, *, world: int, returncode: int) -> bool:
    """True when every rank passed the final barrier (its ``rank-N.done`` marker) and none reported
    an error: the failing exit came from a process's teardown, after the checkpoint and metrics were
    written. Say so instead of failing the finished run."""
    import sys

    from hethub.runtime.train_args import done_marker

    done = all(done_marker(errors, r).is_file() for r in range(world))
    if not done or any(errors.glob("rank-*.json")):
        return False
    print(f"hethub train: warning: every rank finished training, then a rank process exited with code "
          f"{returncode} while shutting down (its output is above); the run's outputs are complete.",
          file=sys.stderr, flush=True)
    return True


# What a rank killed by a signal most likely met (the signal is all torchrun saw).
_SIGNAL_CAUSES = {"SIGKILL": "most likely the kernel's out-of-memory killer (see `dmesg`), or a kill -9",
                  "SIGSEGV": "a crash in native code (a driver, an extension)",
                  "SIGBUS": "a bad memory access, e.g. a memory-mapped file truncated underneath",
                  "SIGABRT": "an abort in native code (its message is above)",
                  "SIGTERM": "something stopped it (a scheduler's time limit, a kill)"}


def _rank_failure(errors, returncode: int, *, signalled: dict[int, int] | None = None):
    """One error for the whole job: a rank killed by a signal first (named, with its likely cause: the
    others' errors then only follow from it), each distinct rank message once with the ranks that
    raised it, and the exit code of the first (lowest) failing rank; a rank that died without one: exit 1."""
    import json
    import signal

    from hethub.errors import HethubError

    killed = []
    for rank, signum in sorted((signalled or {}).items()):
        try:
            name = signal.Signals(signum).name
        except ValueError:
            name = f"signal {signum}"
        cause = _SIGNAL_CAUSES.get(name, "")
        killed.append(f"rank {rank} was killed by {name} (signal {signum})" + (f": {cause}" if cause else ""))
    reports = []
    for f in sorted(errors.glob("rank-*.json")):
        try:
            reports.append(json.loads(f.read_text(encoding="utf-8")))
        except (OSError, ValueError):
            continue
    if killed:
        err = HethubError("; ".join(killed) + ". The other ranks then stopped (their connection to it was "
                          "reset). Fix: if memory ran out, a plan with less memory per process (more stages or "
                          "recomputation, a smaller micro-batch) or fewer processes on this host.")
        return err
    if not reports:
        err = HethubError(f"training exited with code {returncode}: a rank stopped without a hethub error (its "
                          "output is above). Fix: read the first error the ranks printed.")
        return err
    reports.sort(key=lambda r: int(r["rank"]) if str(r["rank"]).isdigit() else 1 << 30)
    by_message: dict[str, list[str]] = {}
    for r in reports:
        by_message.setdefault(r["message"], []).append(str(r["rank"]))
    lines = [msg + ("" if len(by_message) == 1 else f" (rank {', '.join(ranks)})")
             for msg, ranks in by_message.items()]
    err = HethubError("\n".join(lines))
    err.exit_code = int(reports[0]["exit_code"])
    return err


def cmd_demo(args: argparse.Namespace) -> int:
    from hethub.demo import DemoConfig, run_demo
    from hethub.errors import require_extra

    require_extra("torch", what="'hethub demo'")

    given = {"cluster": args.cluster, "steps": args.steps, "out_dir": args.out}
    run_demo(DemoConfig(**{k: v for k, v in given.items() if v is not None}))
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    sp = sub.add_parser("train", help="train a plan with local processes (torchrun underneath)",
                        description="Train a plan on this machine: one local process per device of the plan, "
                                    "started by torchrun --standalone. Arguments are checked, and the host is "
                                    "checked against the plan's devices, before any rank starts.",
                        epilog="examples:\n  hethub train --plan local.json --steps 20 --metrics run.jsonl --trace\n"
                               "  hethub train --config examples/train/finetune-small.toml\n"
                               "  hethub train --plan local.json --steps 100 --checkpoint-dir ckpt "
                               "--checkpoint-every 20 --resume auto\n"
                               "exit codes: docs/cli.md (a rank's error keeps its code, e.g. 7 for a checkpoint)",
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    sp.add_argument("--plan", help="plan JSON written by 'hethub plan' (required unless --config gives one)")
    add_train_arguments(sp)
    train_config.add_arguments(sp)
    # Unset unless given: a --config file's train.steps / logging.metrics fill them, else the ranks' defaults.
    sp.set_defaults(func=cmd_train, steps=None, metrics=None)

    sp = sub.add_parser("demo", help="plan and train a small model on local CPU ranks (the built-in default)")
    sp.add_argument("--cluster", default=None, help="a local emulation cluster TOML (default: "
                    "examples/clusters/demo-cpu.toml, embedded copy)")
    # Defaults live in hethub.demo.DemoConfig (not imported here: the planner loads only when it runs).
    sp.add_argument("--steps", type=positive_int, default=None,
                    help="training steps of each plan (default 10); the first 2 are left out of the measured median")
    sp.add_argument("--out", default=None, help="where plans, metrics and the report go (default runs/demo)")
    sp.set_defaults(func=cmd_demo)
