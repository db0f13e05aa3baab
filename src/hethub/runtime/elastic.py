"""Running under torchrun's elastic agent: re-planning when fewer devices come back, fault injection.

Restarts themselves are torchrun's (``--max-restarts``): it kills the surviving workers of a failed
attempt and starts them all again; ``hethub.train --resume auto`` makes the new workers continue from
the newest committed checkpoint. What torchrun cannot do is fit the plan to fewer devices: with
``--nnodes MIN:MAX`` an attempt may start with a smaller WORLD_SIZE. With ``--replan-on-shrink``,
hethub then plans the same model and global batch for the surviving devices, taken to be those of
ranks 0..WORLD_SIZE-1 of the old plan (torchrun numbers ranks node by node and cannot say *which*
machine left), saves that plan next to the checkpoints and resumes under it:
checkpoints are stored per parameter, so any plan can load them. The planning itself is the
planner's (:mod:`hethub.search.replan`); this module only runs it on rank 0 and shares the result.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from hethub.comm.communicator import Communicator
from hethub.errors import HethubError, RuntimeSetupError
from hethub.plan import Plan

FAULT_ENV = "HETHUB_FAULT_INJECT"


def replan_path(root: Path, world_size: int) -> Path:
    return Path(root) / f"plan-world{world_size}.json"


def shrunk_plan(plan: Plan, *, world_size: int, comm: Communicator, root: Path) -> Plan:
    """Collective: the plan to run when the job came back with ``world_size`` < plan.world_size ranks.

    Rank 0 plans (or reuses the plan an earlier attempt saved for this size) and saves it to
    ``root/plan-world{N}.json``; every rank then reads that file, so all run the same plan even if
    planning were not deterministic.
    """
    path = replan_path(root, world_size)
    failed = 0
    if comm.rank == 0:
        try:
            if not _usable(path, plan):
                from hethub.emulation.host import host_model
                from hethub.search.replan import replan  # the planner: only re-planning needs it

                new = replan(plan, world_size=world_size, host=host_model(plan.cluster))
                path.parent.mkdir(parents=True, exist_ok=True)
                tmp = path.with_suffix(".json.tmp")
                new.save(tmp)
                os.replace(tmp, path)
        except (HethubError, OSError) as err:
            print(f"hethub.train: error: {err}", flush=True)
            failed = 1
    flag = torch.tensor([failed], dtype=torch.int64)
    comm.all_reduce(flag, op="max")  # doubles as the barrier before the others read the file
    if int(flag):
        raise RuntimeSetupError(f"re-planning for {world_size} devices failed on rank 0 (its message says why). "
                                f"Fix: relaunch with {plan.world_size} processes or pass a plan for {world_size}.")
    return Plan.load(path)


def _usable(path: Path, plan: Plan) -> bool:
    if not path.is_file():
        return False
    try:
        old = Plan.load(path)
    except HethubError:
        return False
    return old.model == plan.model and old.global_batch == plan.global_batch and old.seq_len == plan.seq_len


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
