"""Interleaved 1F1B (virtual stages) on heterogeneous plans: parity with one device, the traced op
order equals the registry's, and the measured in-flight peak equals the predicted one."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from _harness import TIMEOUT, F, S, batches, make_plan, run_ranks
from test_parity import check

from hethub.comm.factory import make_communicator
from hethub.plan import Plan, interleave
from hethub.runtime.trainer import Trainer
from hethub.schedules import get_schedule


def _hetero() -> Plan:
    """Pipeline 0: a TP-1 stage on the fast kind and a TP-2 stage on the emulated slow kind, two
    unequal chunks each (layers 0 | 1-2 | 3-4 | 5 in virtual-stage order; the last stage's two TP
    ranks send chunk 0's output back to the one rank of the first stage), 3 micro-batches (not a
    multiple of 2). Pipeline 1: one chunk per stage (1F1B), 1 micro-batch: v differs between them."""
    plan = make_plan([(2, 3, [(F, 1, 3), (S, 2, 3)]), (2, 1, [(S, 1, 4), (F, 1, 2)])], schedule="interleaved")
    p0 = interleave(plan.pipelines[0], [[1, 2], [2, 1]])
    return replace(plan, pipelines=(p0, plan.pipelines[1])).validate()


@pytest.fixture(autouse=True, params=["auto", "force"])
def bridge(request, monkeypatch):
    monkeypatch.setenv("HETHUB_BRIDGE", request.param)
    return request.param


def test_parity_on_heterogeneous_plan() -> None:
    plan = _hetero()
    assert [p.virtual_stages for p in plan.pipelines] == [2, 1]
    assert plan.pipelines[0].stages[1].layer_ranges == ((1, 3), (5, 6))
    check(plan)


def test_parity_three_stages_recompute(bridge: str) -> None:
    if bridge == "force":
        pytest.skip("the bridge is covered by the heterogeneous plan")
    # 3 stages x 2 chunks of one layer each, 4 micro-batches, a recomputed middle stage.
    plan = make_plan([(1, 4, [(F, 1, 2), (S, 1, 2), (F, 1, 2)])], schedule="interleaved")
    pipe = interleave(plan.pipelines[0], [[1, 1], [1, 1], [1, 1]])
    pipe = replace(pipe, stages=(pipe.stages[0], replace(pipe.stages[1], recompute=True), pipe.stages[2]))
    check(replace(plan, pipelines=(pipe,)).validate())


def _trace_worker(rank: int, plan: Plan, data: list[torch.Tensor]) -> dict:
    comm = make_communicator(plan=plan, rank=rank, timeout=TIMEOUT)
    trainer = Trainer(plan, rank=rank, comm=comm)
    _, trace = trainer.forward_backward(data[0])
    st = trainer.place.stage
    return {"stage": st.stage, "num_stages": st.num_stages, "chunks": st.num_chunks,
            "m": trainer.place.num_micro_batches,
            "ops": [(e["op"], e["mb"], e.get("chunk", 0)) for e in trace.events],
            "max_in_flight": trace.max_in_flight}


def test_traced_op_order_and_in_flight_match_the_registry(bridge: str) -> None:
    if bridge == "force":
        pytest.skip("the op order does not depend on the transport")
    # 4 stages x 2 chunks, 5 micro-batches (first group 5: warm-ups 11, 9, 7, 5; the first chunk holds
    # only the embedding, the last only the head); 2 stages x 3 chunks with m = p = 2 (Megatron's
    # all-warm-up case).
    plan = make_plan([(1, 5, [(F, 1, 1), (S, 1, 2), (F, 1, 2), (S, 1, 1)]), (1, 2, [(S, 1, 3), (F, 1, 3)])],
                     schedule="interleaved")
    p0 = interleave(plan.pipelines[0], [[0, 1], [1, 1], [1, 1], [1, 0]])
    p1 = interleave(plan.pipelines[1], [[1, 1, 1], [1, 1, 1]])
    plan = replace(plan, pipelines=(p0, p1)).validate()
    seen = set()
    for r in run_ranks(plan.world_size, _trace_worker, plan, batches(plan, steps=1)):
        sched = get_schedule("interleaved", chunks=r["chunks"])
        want = sched.ops(stage=r["stage"], num_stages=r["num_stages"], num_micro_batches=r["m"])
        assert r["ops"] == [tuple(o) for o in want], r
        assert r["max_in_flight"] == sched.in_flight(stage=r["stage"], num_stages=r["num_stages"],
                                                     num_micro_batches=r["m"]), r
        seen.add((r["chunks"], r["max_in_flight"]))
    assert {c for c, _ in seen} == {2, 3}
