"""Data-parallel gradient buckets are reduced while the last micro-batch's backward runs
(runtime/grad_buffer.py), read from each rank's step trace: the order of its events, not their
durations. With overlap, some bucket's reduction starts before the rank's last backward op (B, or W
under ZB-H1) ends, and buckets start in bucket order; without, none starts before it ends. Parity with
one device under small buckets is tests/dist/test_parity.py's (and test_zero.py's for ZeRO-1)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from _harness import OPTIM, TIMEOUT, F, S, batches, make_plan, run_ranks

from hethub.comm.factory import make_communicator
from hethub.plan import Plan
from hethub.predict.predictor import with_shard_weights
from hethub.runtime.trainer import Trainer, TrainerConfig

BUCKET_ELEMS = 4096  # several buckets per replica of the t6 model


def _worker(rank: int, plan: Plan, data: torch.Tensor, overlap: bool) -> dict:
    comm = make_communicator(plan=plan, rank=rank, timeout=TIMEOUT)
    cfg = TrainerConfig(optim=OPTIM, grad_bucket_elems=BUCKET_ELEMS, overlap_grad_reduce=overlap)
    trainer = Trainer(plan, rank=rank, comm=comm, cfg=cfg)
    _, trace = trainer.forward_backward(data)
    trainer.sync_grads()
    sync, timer = trainer.grad_sync, trainer.timer
    starts = [(k, timer.seconds(sync.t0, a)) for k, a, _ in sync.reductions]
    return {"starts": starts, "buckets": len(sync.buffer.buckets),
            "last_backward_end_s": max(e["end_s"] for e in trace.events if e["op"] in ("B", "W"))}


def _plan(schedule: str, *, sharded: bool) -> Plan:
    # Uneven replicas (3 and 1 micro-batches) of two kinds; two stages each under ZB-H1, so that a
    # stage's weight gradients come in W.
    stages = [[(F, 1, 6)], [(S, 1, 6)]] if schedule == "1f1b" else [[(F, 1, 3), (F, 1, 3)], [(S, 1, 2), (S, 1, 4)]]
    plan = make_plan([(2, 3, stages[0]), (2, 1, stages[1])], schedule=schedule)
    return with_shard_weights(replace(plan, optimizer_sharding="zero1").validate()) if sharded else plan


@pytest.mark.parametrize(("schedule", "sharded"), [("1f1b", False), ("zb-h1", False), ("1f1b", True)])
def test_buckets_start_before_the_last_backward_ends(schedule: str, sharded: bool) -> None:
    plan = _plan(schedule, sharded=sharded)
    res = run_ranks(plan.world_size, _worker, plan, batches(plan, steps=1)[0], True)
    for r in res:
        assert r["buckets"] > 2, r
        assert [k for k, _ in r["starts"]] == sorted(k for k, _ in r["starts"]), "buckets start in bucket order"
        early = [k for k, t in r["starts"] if t < r["last_backward_end_s"]]
        assert early, f"no bucket reduction started inside the last backward: {r}"


def test_without_overlap_every_bucket_starts_after_the_backward() -> None:
    plan = _plan("1f1b", sharded=False)
    res = run_ranks(plan.world_size, _worker, plan, batches(plan, steps=1)[0], False)
    for r in res:
        assert len(r["starts"]) == r["buckets"] > 2
        assert all(t >= r["last_backward_end_s"] for _, t in r["starts"]), r
