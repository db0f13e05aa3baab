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

import hethub


def torchrun_command(plan_path: str | Path, *, nproc: int, steps: int, metrics: str | Path | None = None,
                     extra_args: Sequence[str] = ()) -> list[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "hethub.train", "--plan", str(plan_path), "--steps", str(steps)]
    if metrics is not None:
        cmd += ["--metrics", str(metrics)]
    return cmd + list(extra_args)


def launch_local(plan_path: str | Path, *, nproc: int, steps: int, metrics: str | Path | None = None,
                 extra_args: Sequence[str] = (), capture: bool = False,
                 timeout_s: float | None = None) -> subprocess.CompletedProcess[str]:
    """Train ``plan_path`` with ``nproc`` local processes; returns the finished torchrun process.

    One thread per rank (OMP_NUM_THREADS=1 unless set): ranks share the machine's cores, and
    oversubscribed OpenMP pools slow everyone down. The package's own source directory is put on
    PYTHONPATH so an uninstalled checkout works too.
    """
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    src = str(Path(hethub.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join([src, *filter(None, [env.get("PYTHONPATH")])])
    cmd = torchrun_command(plan_path, nproc=nproc, steps=steps, metrics=metrics, extra_args=extra_args)
    return subprocess.run(cmd, env=env, text=True, capture_output=capture, timeout=timeout_s, check=False)


def _forked_rank(rank: int, world: int, port: int, argv: list[str], quiet: bool) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if quiet:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
    from hethub.runtime.train import main

    code = 1
    try:
        code = main(argv)
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
