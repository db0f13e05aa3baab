"""Run a plan on this machine: ``torchrun --standalone --nproc-per-node N -m hethub.train`` as a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
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
