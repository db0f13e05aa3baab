"""Split-backward and other non-1F1B schedules on heterogeneous plans: parity with one device, the
traced op order equals the registry's, and the measured in-flight peak equals the predicted one."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from _harness import TIMEOUT, F, S, batches, make_plan, run_ranks
from test_parity import check

from hethub.comm.factory import make_communicator
from hethub.plan import Plan
from hethub.runtime.trainer import Trainer
from hethub.schedules import get_schedule

SPLIT = ["zb-h1"]


def _hetero(schedule: str) -> Plan:
    """Unequal stages, replicas with 3 and 1 micro-batches, a TP-2 stage after a TP-1 one, an
    emulated slow kind, and a recomputed later stage (its split backward re-runs the forward)."""
    plan = make_plan([(2, 3, [(F, 1, 1), (S, 2, 3), (F, 1, 2)]), (2, 1, [(S, 1, 4), (F, 1, 2)])], schedule=schedule)
    p0 = plan.pipelines[0]
    stages = (p0.stages[0], p0.stages[1], replace(p0.stages[2], recompute=True))
    return replace(plan, pipelines=(replace(p0, stages=stages), plan.pipelines[1])).validate()


@pytest.fixture(autouse=True, params=["auto", "force"])
def bridge(request, monkeypatch):
    monkeypatch.setenv("HETHUB_BRIDGE", request.param)
    return request.param


@pytest.mark.parametrize("schedule", SPLIT)
def test_parity_on_heterogeneous_plan(schedule: str) -> None:
    check(_hetero(schedule))


def _trace_worker(rank: int, plan: Plan, data: list[torch.Tensor]) -> dict:
    comm = make_communicator(plan=plan, rank=rank, timeout=TIMEOUT)
    trainer = Trainer(plan, rank=rank, comm=comm)
    _, trace = trainer.forward_backward(data[0])
    st = trainer.place.stage
    return {"stage": st.stage, "num_stages": st.num_stages,
            "m": trainer.place.num_micro_batches, "ops": [(e["op"], e["mb"]) for e in trace.events],
            "max_in_flight": trace.max_in_flight}


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", *SPLIT])
def test_traced_op_order_and_in_flight_match_the_registry(schedule: str, bridge: str) -> None:
    if bridge == "force" and schedule != SPLIT[0]:
        pytest.skip("the op order does not depend on the transport; one bridged case suffices")
    plan = make_plan([(2, 5, [(F, 1, 1), (S, 1, 2), (F, 1, 1), (S, 1, 2)]), (2, 2, [(S, 2, 4), (F, 1, 2)])],
                     schedule=schedule)
    sched = get_schedule(schedule)
    for r in run_ranks(plan.world_size, _trace_worker, plan, batches(plan, steps=1)):
        want = sched.ops(stage=r["stage"], num_stages=r["num_stages"], num_micro_batches=r["m"])
        assert r["ops"] == [(o.kind, o.micro_batch) for o in want], r
        assert r["max_in_flight"] == sched.in_flight(stage=r["stage"], num_stages=r["num_stages"],
                                                     num_micro_batches=r["m"]), r
