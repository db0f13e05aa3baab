"""Every heterogeneous plan trains exactly like one device: loss and gradients of step 0 and the
parameters after 3 AdamW steps (with global-norm clipping active) within 1e-5 in fp32."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch
from _harness import OPTIM, SPEC, TIMEOUT, F, S, batches, make_plan, reference, run_ranks

from hethub.comm.factory import make_communicator
from hethub.layout import build_topology
from hethub.plan import Plan
from hethub.runtime.optim import OptimConfig
from hethub.runtime.tensor_parallel import TPContext, shard
from hethub.runtime.trainer import Trainer, TrainerConfig

TOL = 1e-5
# Gradient buckets of ~4k elements: several per sync group of the t6 model, reduced while the last
# backward runs (runtime/grad_buffer.py), so every parity case covers the overlapped path.
BUCKET_ELEMS = 4096


# The forced-bridge half is the slow tier's: the fast tier trains through the forced bridge in
# test_bridge.py (p2p both ways, DP across kinds), test_zero.py, test_zero23.py,
# test_interleaved_training.py and test_split_schedules.py.
@pytest.fixture(autouse=True, params=["auto", pytest.param("force", marks=pytest.mark.slow)])
def bridge(request, monkeypatch):
    """Every parity case runs twice: native groups, and with the cross-kind bridge forced on."""
    monkeypatch.setenv("HETHUB_BRIDGE", request.param)
    return request.param


def _worker(rank: int, plan: Plan, data: list[torch.Tensor], ref: dict[str, Any], optim: OptimConfig) -> dict:
    comm = make_communicator(plan=plan, rank=rank, timeout=TIMEOUT)
    trainer = Trainer(plan, rank=rank, comm=comm, cfg=TrainerConfig(optim=optim, grad_bucket_elems=BUCKET_ELEMS))
    tp = TPContext(size=trainer.place.stage.tp, rank=trainer.place.tp_rank)

    def mine(name: str, full: torch.Tensor) -> torch.Tensor:
        return shard(full, dim=trainer.model.shard_dim(name), tp=tp)

    loss, _ = trainer.forward_backward(data[0])
    trainer.sync_grads()
    named = dict(trainer.model.named_parameters())
    grad_diff = max((p.grad - mine(n, ref["grads"][n])).abs().max().item() for n, p in named.items())
    norm = trainer.clip_and_update()
    for step in range(1, len(data)):
        trainer.train_step(data[step], step=step)
    param_diff = max((p.detach() - mine(n, ref["params"][n])).abs().max().item() for n, p in named.items())
    return {"loss": loss, "norm": norm, "grad_diff": grad_diff, "param_diff": param_diff, "names": sorted(named),
            "shapes": {n: tuple(p.shape) for n, p in named.items()}, "tp": tp.size}


def check(plan: Plan, *, optim: OptimConfig = OPTIM) -> list[dict]:
    data = batches(plan, steps=3)
    ref = reference(plan.model, data, optim=optim)
    assert ref["norms"][0] > optim.grad_clip, "clipping must be active for the test to cover it"
    res = run_ranks(plan.world_size, _worker, plan, data, ref, optim)
    assert set().union(*(r["names"] for r in res)) == set(ref["params"]), "every parameter is held somewhere"
    for r in res:
        assert abs(r["loss"] - ref["loss"]) <= TOL
        assert abs(r["norm"] - ref["norms"][0]) <= TOL * max(1.0, ref["norms"][0])
        assert r["grad_diff"] <= TOL, r
        assert r["param_diff"] <= TOL, r
    return res


SCHEDULES = pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])


@SCHEDULES
def test_two_stages_5_1_split(schedule: str) -> None:
    check(make_plan([(2, 4, [(F, 1, 5), (F, 1, 1)])], schedule=schedule))


@SCHEDULES
def test_three_stages_middle_on_emulated_slow_kind(schedule: str) -> None:
    plan = make_plan([(2, 4, [(F, 1, 2), (S, 1, 2), (F, 1, 2)])], schedule=schedule)
    assert plan.cluster.kinds[S].emulated
    check(plan)


def test_replicas_with_3_and_1_micro_batches() -> None:
    check(make_plan([(2, 3, [(F, 1, 3), (F, 1, 3)]), (2, 1, [(S, 1, 6)])]))


@SCHEDULES
def test_replicas_split_layers_differently(schedule: str) -> None:
    check(make_plan([(2, 2, [(F, 1, 4), (F, 1, 2)]), (2, 2, [(S, 1, 2), (S, 1, 4)])], schedule=schedule))


@SCHEDULES
def test_tp2_stage_beside_tp1_stage(schedule: str) -> None:
    check(make_plan([(2, 4, [(F, 2, 3), (S, 1, 3)])], schedule=schedule))


def test_tp1_stage_before_tp2_stage() -> None:
    check(make_plan([(2, 4, [(S, 1, 2), (F, 2, 4)])]))


def test_replicas_with_different_tp_degrees() -> None:
    # Every parameter's holders differ in TP degree: the full-size fallback sync.
    check(make_plan([(2, 2, [(F, 2, 6)]), (2, 2, [(S, 1, 6)])]))


def test_tied_embeddings_on_different_stages() -> None:
    spec = replace(SPEC, name="t6-tied", tied_embeddings=True)
    check(make_plan([(2, 2, [(F, 1, 3), (F, 2, 3)]), (2, 2, [(S, 1, 6)])], spec=spec))


def test_gpt_variant() -> None:
    spec = replace(SPEC, name="gpt6", arch="gpt", activation="gelu", num_kv_heads=4, tied_embeddings=True)
    check(make_plan([(2, 2, [(F, 2, 4), (S, 1, 2)])], spec=spec))


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_recompute_modes_per_stage(schedule: str) -> None:
    """none, selective and full on different stages of unequal replicas: a selective TP-2 stage, a full
    one, and the slow kind on math attention, whose selective recomputation re-runs the s x s scores
    (under ZB-H1 the split backward re-runs them for the input gradients)."""
    plan = make_plan([(2, 2, [(F, 2, 3), (S, 1, 3)]), (2, 1, [(S, 1, 4), (F, 1, 2)])], schedule=schedule)
    modes = (("selective", "full"), ("selective", "none"))
    pipes = tuple(replace(p, stages=tuple(replace(s, recompute=m) for s, m in zip(p.stages, ms, strict=True)))
                  for p, ms in zip(plan.pipelines, modes, strict=True))
    plan = replace(plan, pipelines=pipes, kind_settings={S: {"attention": "math"}}).validate()
    assert [s.recompute for p in plan.pipelines for s in p.stages] == ["selective", "full", "selective", "none"]
    check(plan)


def _vocab_rows(res: list[dict], name: str) -> set[tuple[int, int]]:
    """(TP degree, rows of ``name``) on every rank that holds it."""
    return {(r["tp"], r["shapes"][name][0]) for r in res if name in r["shapes"]}


def test_tied_embeddings_under_tp2() -> None:
    # Embedding and tied head on different TP=2 stages: both use the same vocabulary shard.
    spec = replace(SPEC, name="t6-tied", tied_embeddings=True)
    res = check(make_plan([(2, 4, [(F, 2, 3), (S, 2, 3)])], spec=spec))
    assert _vocab_rows(res, "embed.weight") == {(2, SPEC.vocab_size // 2)}


def test_head_stage_tp2_splits_vocabulary() -> None:
    # A TP=2 head beside a TP=1 replica's head: the mixed sync of a vocabulary-split parameter.
    res = check(make_plan([(2, 2, [(S, 1, 3), (F, 2, 3)]), (2, 2, [(S, 1, 6)])]))
    assert _vocab_rows(res, "head.weight") == {(2, SPEC.vocab_size // 2), (1, SPEC.vocab_size)}


def test_indivisible_vocabulary_replicates_on_that_stage() -> None:
    # 255 rows do not split over TP=2: those stages keep the whole (tied) table, and sync it with a
    # TP=1 replica through the mixed path.
    spec = replace(SPEC, name="t6-v255", vocab_size=255, tied_embeddings=True)
    res = check(make_plan([(2, 2, [(F, 2, 3), (F, 2, 3)]), (2, 2, [(S, 1, 6)])], spec=spec))
    assert _vocab_rows(res, "embed.weight") == {(2, 255), (1, 255)}


@SCHEDULES
def test_tp_split_inter_stage_send(schedule: str) -> None:
    # TP=2 -> TP=2 across kinds: each rank sends half the activation (and half the gradient back),
    # the receiving stage all-gathers it (layout.split_hop); a TP=2 -> TP=1 hop sends whole tensors.
    plan = make_plan([(2, 4, [(F, 2, 2), (S, 2, 2), (F, 1, 2)])], schedule=schedule)
    topo = build_topology(plan)
    first, second, third = (topo.stages[i].ranks for i in range(3))
    assert all(topo.place(r).split_out and not topo.place(r).split_in for r in first)
    assert all(topo.place(r).split_in and not topo.place(r).split_out for r in second)
    assert not any(topo.place(r).split_in for r in third)
    check(plan)


def test_unequal_tp_hops_across_kinds_send_one_copy() -> None:
    """TP 2 -> TP 4 -> TP 1 across kinds (with the bridge forced, through it): each receiver gets its
    flat slice from sender q mod a and all-gathers over its own TP group (layout.split_hop), the
    gradients back likewise (4 -> 2 halves, 1 -> 4 quarters); a single receiver gets the whole."""
    spec = replace(SPEC, name="t6-kv4", num_kv_heads=4)
    plan = make_plan([(2, 3, [(F, 2, 2), (S, 4, 2), (F, 1, 2)])], spec=spec)
    topo = build_topology(plan)
    first, second, third = (topo.stages[i].ranks for i in range(3))
    assert all(topo.place(r).hop_out.parts == 4 and topo.place(r).hop_grad_in.parts == 2 for r in first)
    assert all(topo.place(r).hop_out.piece == "whole" and topo.place(r).hop_grad_in.parts == 4 for r in second)
    assert all(topo.place(r).split_in for r in second) and not any(topo.place(r).split_in for r in third)
    check(plan)


@SCHEDULES
def test_replicas_with_different_micro_batch_sizes(schedule: str) -> None:
    """Per-replica micro-batch sizes (the planner may give a memory-poor kind mbs 1 beside a rich kind
    at mbs 4): 4 x 1 samples on the slow kind, 2 x 4 on the fast one, unequal shares and layer splits;
    gradients are weighted by samples, not by micro-batches or replicas."""
    plan = make_plan([(1, 4, [(S, 1, 6)]), (4, 2, [(F, 1, 2), (F, 1, 4)])], schedule=schedule)
    assert sorted(p.micro_batch_size for p in plan.pipelines) == [1, 4]
    check(plan)
