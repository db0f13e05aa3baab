"""Run a function on N gloo ranks of this host, as forked (or spawned) processes.

Used by the link benchmark, the TP profiler, the GPU demo script and the multi-rank tests. Forking
from a parent that already imported torch starts a rank in ~0.05 s, against seconds for torchrun.
"""

from __future__ import annotations

import os
import pickle
import socket
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(rank: int, world: int, port: int, threads: int, collective_timeout_s: float,
           fn: Callable[..., Any], args: tuple[Any, ...], q: Any) -> None:
    torch.set_num_threads(threads)  # first: a forked child inheriting a used OpenMP pool can hang
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=collective_timeout_s))
        try:
            # Plain pickle copies tensors by value: torch's queue pickler would hand over shared
            # memory that vanishes when this child exits before the parent reads it.
            q.put((rank, True, pickle.dumps(fn(rank, *args))))
        finally:
            dist.destroy_process_group()
    except BaseException:
        q.put((rank, False, traceback.format_exc()))
    q.close()
    q.join_thread()
    os._exit(0)  # skip the parent's exit handlers (pytest's, say) inherited through fork


def run_local_ranks(world: int, fn: Callable[..., Any], *args: Any, timeout_s: float = 300.0,
                    collective_timeout_s: float = 300.0, threads: int = 1, start_method: str = "fork",
                    error: type[Exception] = RuntimeError) -> list[Any]:
    """``fn(rank, *args)`` on ``world`` gloo ranks; results by rank, raising `error` on any failure.

    `timeout_s` bounds the wait for each result, `collective_timeout_s` each collective, so a bug
    fails fast instead of hanging. Use ``start_method="spawn"`` when ranks use CUDA, which cannot
    be re-initialised in a forked child.
    """
    ctx = mp.get_context(start_method)
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_child, args=(r, world, port, threads, collective_timeout_s, fn, args, q),
                         daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors = []
    try:
        for _ in range(world):
            rank, ok, val = q.get(timeout=timeout_s)
            (results.__setitem__(rank, pickle.loads(val)) if ok else errors.append(f"rank {rank}:\n{val}"))
    except Exception as err:  # queue.Empty: some rank hung
        errors.append(f"ranks {sorted(set(range(world)) - set(results))} gave no result ({type(err).__name__})")
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.terminate()  # only our own hung child
            p.join(timeout=5)
    if errors:
        raise error("\n".join(errors))
    return [results[r] for r in range(world)]
