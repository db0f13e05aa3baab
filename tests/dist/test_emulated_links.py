"""Emulated slow links: a 2-stage plan's measured step time follows its predicted one as the link
between the stages slows (three speeds, 4x apart). Ordering and a generous factor only: the box is
shared, so nothing here asserts a timing tightly."""

from __future__ import annotations

import time

import torch
from _harness import OPTIM, SEQ, SPEC, TIMEOUT, _kind, batches, run_ranks

from hethub.comm.factory import make_communicator
from hethub.plan import Pipeline, Plan, Stage
from hethub.predict.predictor import predict
from hethub.runtime.emulated_links import EmulatedLinks, emulated_links_of
from hethub.runtime.trainer import Trainer, TrainerConfig
from hethub.spec.cluster import Cluster, EmulationHost, Link, NodeGroup

MBS, M = 2, 4
ACT_BYTES = MBS * SEQ * SPEC.hidden_size * 4  # one micro-batch's fp32 activations
REPS = 3
TRANSFER_S = (0.01, 0.04, 0.16)  # 4x apart: the gaps dwarf this shared box's noise (tens of ms)


def _plan(transfer_s: float) -> Plan:
    link = Link(ACT_BYTES / transfer_s, 0.0)
    cluster = Cluster(name="links", kinds={"cpu-fast": _kind("cpu-fast")}, groups=(NodeGroup("cpu-fast", 2, 1),),
                      inter_node=link, cross_kind=link, host=EmulationHost(cores=2, links=True))
    stages = (Stage(kind="cpu-fast", devices=(0,), layers=(0, 3), embedding=True, head=False),
              Stage(kind="cpu-fast", devices=(1,), layers=(3, 6), embedding=False, head=True))
    pipe = Pipeline(micro_batch_size=MBS, num_micro_batches=M, stages=stages)
    return Plan(model=SPEC, cluster=cluster, global_batch=MBS * M, seq_len=SEQ, pipelines=(pipe,),
                schedule="1f1b", precision="fp32").validate()


def _worker(rank: int, plans: list[Plan], data: list[torch.Tensor]) -> list[float]:
    """The fastest of REPS steps at each link speed (outside load only ever adds time); the speeds take
    turns, so a burst of load on the box hits them alike. One world for all speeds: only the link changes."""
    comm = make_communicator(plan=plans[0], rank=rank, timeout=TIMEOUT)
    trainer = Trainer(plans[0], rank=rank, comm=comm, cfg=TrainerConfig(optim=OPTIM))
    links = trainer.executor.comm
    assert isinstance(links, EmulatedLinks)
    trainer.train_step(data[0], step=0)  # warm-up
    best = [float("inf")] * len(plans)
    for rep in range(REPS):
        for k, plan in enumerate(plans):
            links.link_of = emulated_links_of(plan.cluster, plan.devices)
            links.arrived_s.clear()
            comm.barrier()
            t0 = time.perf_counter()
            trainer.train_step(data[1], step=1 + rep * len(plans) + k)
            best[k] = min(best[k], time.perf_counter() - t0)
    assert links.delayed_s > 0  # the emulation did hold messages back
    return best


def test_measured_and_predicted_step_time_move_together_as_the_link_slows() -> None:
    plans = [_plan(t) for t in TRANSFER_S]
    out = run_ranks(2, _worker, plans, batches(plans[0], steps=2))
    measured = [max(r[k] for r in out) for k in range(len(plans))]
    predicted = [predict(plan).step_time_s for plan in plans]
    print("transfer_s", TRANSFER_S, "predicted", predicted, "measured", measured)
    assert predicted[0] < predicted[1] < predicted[2]
    assert measured[0] < measured[1] < measured[2]
    # The link's share of the step: the slowdown from the fastest to the slowest link, measured
    # against predicted, within a factor of two either way.
    ratio = (measured[2] - measured[0]) / (predicted[2] - predicted[0])
    assert 0.5 < ratio < 2.0, ratio
