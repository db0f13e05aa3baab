"""Running under torchrun's elastic agent: process groups that survive restarts, fault injection.

Restarts themselves are torchrun's (``--max-restarts``): it kills the surviving workers of a failed
attempt and starts them all again; ``hethub.train --resume auto`` makes the new workers continue from
the newest committed checkpoint. Fitting the plan to fewer devices when an attempt starts smaller
(``--replan-on-shrink``) is the entry point's, before the runtime starts
(:mod:`hethub.commands.replan`): the runtime is handed a plan that matches its world.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from hethub.errors import RuntimeSetupError

FAULT_ENV = "HETHUB_FAULT_INJECT"


# ---- process group per attempt --------------------------------------------------------------------
def init_process_group(backend: str, *, timeout: timedelta) -> None:
    """``dist.init_process_group`` that is safe across torchrun restarts.

    Under torchrun the workers' store is the agent's, which outlives a failed attempt (torch 2.13).
    Gloo publishes each rank's address under the same keys in every attempt, so a restarted rank could
    read the address of a dead predecessor and fail with "connectFullMesh ... Connection refused"
    (seen here in about one restart of three). Prefixing the store with the attempt number keeps every
    attempt's keys apart.
    """
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if restart is None or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        dist.init_process_group(backend, timeout=timeout)
        return
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False,
                          timeout=timeout)
    dist.init_process_group(backend, store=dist.PrefixStore(f"hethub/attempt-{restart}", store), rank=rank,
                            world_size=world, timeout=timeout)


# ---- fault injection (tests) ----------------------------------------------------------------------
@dataclass(frozen=True)
class Fault:
    rank: int
    step: int


def parse_fault(text: str) -> Fault:
    """``"rank=1,step=3"``."""
    try:
        kv = dict(part.split("=", 1) for part in text.split(","))
        return Fault(rank=int(kv["rank"]), step=int(kv["step"]))
    except (KeyError, ValueError):
        raise RuntimeSetupError(f"{FAULT_ENV}={text!r} is malformed. Fix: write it as rank=R,step=S.") from None


def maybe_inject_fault(*, rank: int, step: int, env: Mapping[str, str] = os.environ) -> None:
    """SIGKILL this process before ``step`` if ``HETHUB_FAULT_INJECT`` names this rank and step.

    Only in the first attempt (torchrun's TORCHELASTIC_RESTART_COUNT unset or 0), so the restarted
    job runs through: that is what the elastic test checks.
    """
    text = env.get(FAULT_ENV)
    if not text or env.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return
    fault = parse_fault(text)
    if fault.rank == rank and fault.step == step:
        print(f"hethub.train: {FAULT_ENV}: rank {rank} kills itself before step {step}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
