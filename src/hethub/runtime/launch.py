"""Run a plan on this machine: ``torchrun --standalone --nproc-per-node N -m hethub.train`` as a subprocess,
or (``launch_forked``) the same ``hethub.train`` ranks forked from this process.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import hethub
from hethub.runtime.supervise import SHUTDOWN_GRACE_S, AgentReport, Supervisor, agent_noise_filter

__all__ = ["LocalRun", "agent_noise_filter", "launch_forked", "launch_local", "torchrun_command"]


def torchrun_command(plan_path: str | Path, *, nproc: int, steps: int, metrics: str | Path | None = None,
                     extra_args: Sequence[str] = ()) -> list[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "hethub.train", "--plan", str(plan_path), "--steps", str(steps)]
    if metrics is not None:
        cmd += ["--metrics", str(metrics)]
    return cmd + list(extra_args)


def launch_local(plan_path: str | Path, *, nproc: int, steps: int, metrics: str | Path | None = None,
                 extra_args: Sequence[str] = (), capture: bool = False,
                 timeout_s: float | None = None, error_dir: str | Path | None = None,
                 grace_s: float = SHUTDOWN_GRACE_S) -> LocalRun:
    """Train ``plan_path`` with ``nproc`` local processes; returns the finished torchrun process.

    One thread per rank (OMP_NUM_THREADS=1 unless set): ranks share the machine's cores, and
    oversubscribed OpenMP pools slow everyone down. The package's own source directory is put on
    PYTHONPATH so an uninstalled checkout works too. With ``error_dir`` the ranks leave their hethub
    errors there (``hethub.train.report_rank_error``) for the caller to print once, and torchrun's own
    report of a failed worker (its ChildFailedError traceback and agent log lines) is left out of
    stderr, its ranks killed by a signal kept (``LocalRun.signalled``); and torchrun runs under a
    :class:`Supervisor`: SIGTERM, SIGINT and SIGHUP to this process stop the whole run.
    """
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    src = str(Path(hethub.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join([src, *filter(None, [env.get("PYTHONPATH")])])
    cmd = torchrun_command(plan_path, nproc=nproc, steps=steps, metrics=metrics, extra_args=extra_args)
    if error_dir is None or capture:
        if error_dir is not None:
            env["HETHUB_ERROR_DIR"] = str(error_dir)
        done = subprocess.run(cmd, env=env, text=True, capture_output=capture, timeout=timeout_s, check=False)
        return LocalRun(cmd, done.returncode, done.stdout, done.stderr)
    env["HETHUB_ERROR_DIR"] = str(error_dir)
    report = AgentReport()
    # Its own session: a signal meant for this launcher (a terminal's Ctrl-C, a scheduler's SIGTERM to
    # our pid) reaches torchrun only through the supervisor, which also makes sure it ends.
    with subprocess.Popen(cmd, env=env, text=True, stderr=subprocess.PIPE, start_new_session=True) as proc, \
            Supervisor(proc, error_dir=Path(error_dir), grace_s=grace_s) as sup:
        assert proc.stderr is not None
        for line in agent_noise_filter(proc.stderr, report=report):
            sys.stderr.write(line)
            sys.stderr.flush()
        code = proc.wait(timeout=timeout_s)
    return LocalRun(cmd, code, signal=sup.signum, signalled=report.signalled)


class LocalRun(subprocess.CompletedProcess):
    """torchrun's finished process, plus how the run ended: ``signal``, the signal this launcher got
    and forwarded (None if none); ``signalled``, {rank: signal number} of ranks torchrun saw killed."""

    def __init__(self, args: Any, returncode: int, stdout: Any = None, stderr: Any = None, *,
                 signal: int | None = None, signalled: dict[int, int] | None = None) -> None:
        super().__init__(args, returncode, stdout, stderr)
        self.signal = signal
        self.signalled = signalled or {}


def _forked_rank(rank: int, world: int, port: int, argv: list[str], quiet: bool) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if quiet:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
    import runpy

    # What torchrun's `-m hethub.train` runs (the entry point settles the plan, then the runtime);
    # its __main__ ends the process. A copy imported before the fork would only draw runpy's warning.
    sys.modules.pop("hethub.train", None)
    sys.argv = ["hethub.train", *argv]
    code = 1
    try:
        runpy.run_module("hethub.train", run_name="__main__")
    except SystemExit as stop:  # argparse's usage errors
        code = stop.code if isinstance(stop.code, int) else 1
    finally:
        sys.stdout.flush()
        os._exit(code)  # skip exit handlers inherited from the parent through fork


def launch_forked(plan_path: str | Path, *, nproc: int, steps: int, metrics: str | Path | None = None,
                  extra_args: Sequence[str] = (), quiet: bool = True, timeout_s: float = 600.0) -> list[int]:
    """``hethub.train`` on ``nproc`` ranks forked from this process; returns each rank's exit code.

    The ranks run exactly the code torchrun would start, without torchrun's agent and without
    importing torch again: a rank starts in ~0.1 s instead of seconds, which is what benchmarks that
    run many short jobs need. No restarts; a rank still alive after ``timeout_s`` is killed (-9).
    Ranks inherit this process's state: call it before this process starts thread pools of its own.
    """
    import multiprocessing as mp

    from hethub.comm.local_ranks import free_port

    argv = torchrun_command(plan_path, nproc=nproc, steps=steps, metrics=metrics, extra_args=extra_args)
    argv = argv[argv.index("hethub.train") + 1:]
    ctx = mp.get_context("fork")
    port = free_port()
    procs = [ctx.Process(target=_forked_rank, args=(r, nproc, port, argv, quiet)) for r in range(nproc)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    for p in procs:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join()
    return [p.exitcode if p.exitcode is not None else -9 for p in procs]
