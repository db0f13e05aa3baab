"""ZeRO-2 and ZeRO-3 across unequal data-parallel holders (runtime/zero_grads.py, runtime/zero_params.py)
train like one device: loss, gradient norm, each owner's reduced gradient slice of step 0 and the
parameters after 3 AdamW steps with clipping active, within 1e-5 in fp32 (bf16-mixed within
test_precision.py's bounds); and each rank's persistent gradient and parameter bytes are what the
memory model predicts, byte for byte, its transient ones within the model's bound."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch
from _harness import SPEC, TIMEOUT, F, S, make_plan, warm_imports
from test_zero import MIXED_TOL, owned_grad_diff, run_and_compare

from hethub.comm.factory import make_communicator
from hethub.plan import Plan, Recompute
from hethub.predict.predictor import predict, with_shard_weights
from hethub.predict.sharding import rank_shards
from hethub.runtime.tensor_parallel import TPContext, shard
from hethub.runtime.trainer import Trainer, TrainerConfig

warm_imports()


def sharded(plan: Plan, stage: int) -> Plan:
    """``plan`` under ZeRO-``stage``, the slow kind with less memory: unequal slices."""
    kinds = dict(plan.cluster.kinds)
    kinds[S] = replace(kinds[S], mem_bytes=2**23)
    kinds[F] = replace(kinds[F], mem_bytes=2**24)
    out = replace(plan, cluster=replace(plan.cluster, kinds=kinds), optimizer_sharding=f"zero{stage}").validate()
    return with_shard_weights(out, mem_headroom=0.25)


def _worker(rank: int, plan: Plan, data: list[torch.Tensor], ref: dict[str, Any], cfg: TrainerConfig) -> dict:
    comm = make_communicator(plan=plan, rank=rank, timeout=TIMEOUT)
    trainer = Trainer(plan, rank=rank, comm=comm, cfg=cfg)
    zero = trainer.zero
    assert zero is not None and zero.stage == plan.zero_stage
    tp = TPContext(size=trainer.place.stage.tp, rank=trainer.place.tp_rank)
    loss, _ = trainer.forward_backward(data[0])
    trainer.sync_grads()
    # No gradient outside the shard once the step's rounds are reduced.
    leftover = [n for n, p in trainer.model.named_parameters() if p.grad is not None or hasattr(p, "main_grad")]
    grad_diff = owned_grad_diff(zero, ref, tp=tp)
    norm = trainer.clip_and_update()
    for step in range(1, len(data)):
        trainer.train_step(data[step], step=step)
    fp32 = {n: st["param"] for n, st in zero.gather_state(trainer.optimizer).items() if "param" in st}
    named = dict(trainer.model.named_parameters())
    param_diff = max((fp32.get(n, p.detach()) - shard(ref["params"][n], dim=trainer.model.shard_dim(n), tp=tp))
                     .abs().max().item() for n, p in named.items())
    gather = getattr(zero, "gather", None)
    # Parameter bytes held between steps: storages of the parameters that still have memory.
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in named.values()
                if p.untyped_storage().nbytes()}
    moments, masters = zero.state_bytes(trainer.optimizer)
    return {"loss": loss, "norm": norm, "grad_diff": grad_diff, "param_diff": param_diff, "leftover": leftover,
            "grad_bytes": zero.grad_bytes, "round_peak": zero.round_peak_bytes, "param_bytes": sum(storages.values()),
            "gather_peak": gather.peak_bytes if gather else 0, "moment_bytes": moments, "master_bytes": masters,
            "names": sorted(named), "sizes": {b.line: b.sizes for b in zero.buckets}}


def check(plan: Plan, *, tol: dict[str, float] | None = None) -> list[dict]:
    res = run_and_compare(plan, _worker, tol=tol)
    for r in res:
        assert not r["leftover"], r["leftover"]
    shards = rank_shards(plan, plan.rank_shard_weights())
    pred = predict(plan)
    rank_of = plan.rank_of_device()
    for rank, r in enumerate(res):
        assert r["grad_bytes"] == 4 * shards.moment_elems[rank]
        assert r["moment_bytes"] == 8 * shards.moment_elems[rank]
    for sp in pred.stages:
        ranks = [rank_of[d] for d in sp.devices]
        mem = sp.memory
        assert mem is not None
        assert sp.grads_bytes == max(res[q]["grad_bytes"] for q in ranks), (sp.stage, sp.grads_bytes)
        assert mem.master_weights_bytes == max(res[q]["master_bytes"] for q in ranks)
        assert max(res[q]["round_peak"] for q in ranks) <= mem.grad_sync_buffer_bytes, (sp.stage, mem)
        if plan.zero_stage == 3:
            assert mem.weights_bytes == max(res[q]["param_bytes"] for q in ranks), (sp.stage, mem.weights_bytes)
            assert mem.gathered_bytes == max(res[q]["gather_peak"] for q in ranks), (sp.stage, mem.gathered_bytes)
    return res


# Replica 0 on the fast kind (a TP-2 stage then a TP-1 one, 3 sequences per micro-batch), replica 1 on the
# slow kind split differently (1 sequence per micro-batch); both 2 micro-batches. Holders of every group:
# two kinds, different TP degrees on the first layers (full-size layout), unequal slices.
PLAN = [(3, 2, [(F, 2, 3), (F, 1, 3)]), (1, 2, [(S, 1, 2), (S, 1, 4)])]


@pytest.mark.parametrize(("stage", "bridge"), [(2, "auto"), (3, "force")])
def test_unequal_holders_of_two_kinds(stage: int, bridge: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # ZeRO-3 with every kind its own island (bridged reductions and broadcasts) and sequence parallelism
    # on the TP-2 stage (its norms' gradients summed over TP inside the backward).
    monkeypatch.setenv("HETHUB_BRIDGE", bridge)
    plan = make_plan(PLAN)
    if stage == 3:
        p0 = plan.pipelines[0]
        p0 = replace(p0, stages=(replace(p0.stages[0], sequence_parallel=True), *p0.stages[1:]))
        plan = replace(plan, pipelines=(p0, *plan.pipelines[1:]))
    res = check(sharded(plan, stage))
    assert any(len(s) > 1 and len(set(s)) > 1 for s in res[0]["sizes"].values()), "slices must be unequal"
    if stage == 3:
        assert any(r["gather_peak"] > 0 for r in res) and any(r["param_bytes"] > 0 for r in res)


def test_zero3_mixed_precision_zb_h1() -> None:
    plan = replace(make_plan(PLAN, schedule="zb-h1"), precision="bf16-mixed")
    check(sharded(plan, 3), tol=MIXED_TOL)


def test_zero3_tied_gpt_full_recompute() -> None:
    spec = replace(SPEC, name="gpt6", arch="gpt", activation="gelu", num_kv_heads=4, tied_embeddings=True)
    # Layer splits aligned (parameters gathered per use); the tied embedding's holders are the first and
    # last stages, at different positions: kept whole, its gradients sharded (layout.gathers_params).
    plan = make_plan([(2, 2, [(F, 1, 4), (F, 2, 2)]), (2, 2, [(S, 1, 4), (S, 1, 2)])], spec=spec)
    full = tuple(replace(p, stages=tuple(replace(s, recompute=Recompute.FULL) for s in p.stages))
                 for p in plan.pipelines)
    plan = replace(plan, pipelines=full)
    check(sharded(plan, 3))
