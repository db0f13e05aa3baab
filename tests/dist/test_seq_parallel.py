"""Sequence and context parallelism train exactly like one device (fp32, within 1e-5: loss and
gradients of step 0, parameters after 3 AdamW steps with clipping active), through the real Trainer
and pipeline executor: SP on TP-2 stages beside TP 1 and beside each other (stage messages as
sequence slices), CP 2 across two stages, CP 4, and TP 2 with SP inside CP 2; and a short CP run
whose loss falls."""

from __future__ import annotations

from dataclasses import replace

from _harness import CLUSTER, SPEC, F, S, make_plan, run_ranks, warm_imports
from test_parity import check

from hethub.comm.factory import make_communicator
from hethub.layout import build_topology
from hethub.plan import Pipeline, Plan, Stage
from hethub.runtime.optim import OptimConfig
from hethub.runtime.trainer import Trainer, TrainerConfig

warm_imports()


def _with_sp(plan: Plan, flags: list[list[bool]]) -> Plan:
    pipes = tuple(replace(p, stages=tuple(replace(s, sequence_parallel=f) for s, f in zip(p.stages, fs, strict=True)))
                  for p, fs in zip(plan.pipelines, flags, strict=True))
    return replace(plan, pipelines=pipes).validate()


def cp_plan(pipelines: list[tuple[int, int, list[tuple[str, int, int, int, bool]]]], *, seq_len: int = 16) -> Plan:
    """``pipelines``: (micro-batch size, micro-batches, [(kind, tp, cp, layers, sequence_parallel), ...])."""
    free = {k: [d.id for d in CLUSTER.devices_of_kind(k)] for k in CLUSTER.kind_names}
    out = []
    for mbs, m, stages in pipelines:
        start, built = 0, []
        for i, (kind, tp, cp, n, sp) in enumerate(stages):
            devs, free[kind] = tuple(free[kind][:tp * cp]), free[kind][tp * cp:]
            built.append(Stage(kind=kind, devices=devs, layers=(start, start + n), embedding=i == 0,
                               head=i == len(stages) - 1, cp=cp, sequence_parallel=sp))
            start += n
        out.append(Pipeline(mbs, m, tuple(built)))
    return Plan(model=SPEC, cluster=CLUSTER, global_batch=sum(p.num_samples for p in out), seq_len=seq_len,
                pipelines=tuple(out), precision="fp32").validate()


def test_sp_tp2_beside_tp1_with_uneven_replicas() -> None:
    # SP TP 2 -> TP 1: the SP stage gathers its slices before sending; the gradient comes back as its slice.
    plan = _with_sp(make_plan([(2, 3, [(F, 2, 4), (S, 1, 2)]), (2, 1, [(S, 1, 6)])]), [[True, False], [False]])
    topo = build_topology(plan)
    sender = topo.place(topo.stages[0].ranks[0])
    assert sender.hop_out.source_gathers and sender.hop_grad_in.piece == "seq"
    check(plan)


def test_sp_stages_send_their_sequence_slices() -> None:
    # SP TP 2 -> SP TP 2: each rank sends its own slice to its peer, nobody gathers.
    plan = _with_sp(make_plan([(2, 2, [(F, 2, 3), (S, 2, 3)])]), [[True, True]])
    topo = build_topology(plan)
    for r in topo.stages[0].ranks:
        hop = topo.place(r).hop_out
        assert (hop.piece, hop.source_gathers, hop.dest_gathers, hop.parts) == ("seq", False, False, 2)
    check(plan)


def test_cp2_across_two_stages() -> None:
    check(cp_plan([(2, 2, [(F, 1, 2, 3, False), (S, 1, 2, 3, False)])]))


def test_cp4() -> None:
    check(cp_plan([(2, 2, [(F, 1, 4, 6, False)])]))


def test_tp2_sp_inside_cp2() -> None:
    check(cp_plan([(2, 2, [(F, 2, 2, 6, True)])]))


def _train(rank: int, plan: Plan, steps: int) -> list[float]:
    import torch

    comm = make_communicator(plan=plan, rank=rank)
    trainer = Trainer(plan, rank=rank, comm=comm, cfg=TrainerConfig(optim=OptimConfig(lr=3e-3, warmup_steps=1,
                                                                                       total_steps=steps)))
    g = torch.Generator().manual_seed(7)
    fixed = torch.randint(0, plan.model.vocab_size, (plan.global_batch, plan.seq_len + 1), generator=g)
    losses = []
    for _ in range(steps):
        loss, _ = trainer.forward_backward(fixed)
        trainer.sync_grads()
        trainer.clip_and_update()
        losses.append(loss)
    return losses


def test_cp2_long_sequence_loss_falls() -> None:
    """A tiny model at its longest sequence (32 tokens) split over 2 CP ranks learns a fixed batch."""
    plan = cp_plan([(2, 1, [(F, 1, 2, 6, False)])], seq_len=32)
    losses = run_ranks(2, _train, plan, 8)
    assert losses[0] == losses[1]  # every rank reports the same global loss
    assert losses[0][-1] < 0.9 * losses[0][0], losses[0]
