"""Point-to-point buffers stay bounded on a traced run: on every rank, the send and receive buffers
alive at once (distinct storages, weakly tracked by the executor: ``StepTrace.max_p2p_buffers``)
never exceed the schedule's in-flight count plus one, whatever the number of micro-batches, and
their bytes are the memory model's point-to-point term (``predict/memory/p2p.py``) on each stage's
busiest rank. A send buffer kept until the step ends, or a sent output kept until its backward,
would grow with the micro-batches (8 here) and fail both."""

from __future__ import annotations

import pytest
import torch
from _harness import TIMEOUT, F, S, batches, make_plan, run_ranks

from hethub.comm.factory import make_communicator
from hethub.plan import Plan
from hethub.predict.predictor import predict
from hethub.runtime.trainer import Trainer


def _worker(rank: int, plan: Plan, data: list[torch.Tensor]) -> dict:
    comm = make_communicator(plan=plan, rank=rank, timeout=TIMEOUT)
    trainer = Trainer(plan, rank=rank, comm=comm)
    _, trace = trainer.forward_backward(data[0])
    st = trainer.place.stage
    return {"stage": (st.pipeline, st.stage), "tp_rank": trainer.place.tp_rank, "in_flight": trace.max_in_flight,
            "buffers": trace.max_p2p_buffers, "bytes": trace.max_p2p_bytes}


def _plan(schedule: str) -> Plan:
    # A TP-1 -> TP-2 hop (whole tensors to both ranks) and a TP-2 -> TP-2 split hop (slices).
    return make_plan([(1, 8, [(F, 1, 2), (S, 2, 2), (F, 2, 2)])], schedule=schedule)


# Interleaved stages release their sends when complete, not before the next op (runtime/p2p.py):
# their count depends on timing, so they are not in this test.
@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "zb-h1"])
def test_live_p2p_buffers_are_bounded_and_predicted(schedule: str) -> None:
    plan = _plan(schedule)
    predicted = {(s.pipeline, s.stage): s.memory.p2p_buffers_bytes for s in predict(plan).stages}
    res = run_ranks(plan.world_size, _worker, plan, batches(plan, steps=1))
    for r in res:
        assert 1 <= r["buffers"] <= min(2, r["in_flight"] + 1), r
        assert r["bytes"] <= predicted[r["stage"]], r
        if r["tp_rank"] == 0:
            assert r["bytes"] == predicted[r["stage"]], r
