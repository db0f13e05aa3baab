"""Checkpoints on forked gloo ranks: bit-identical resume, resume under another plan, refusing damage."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from _harness import OPTIM, SPEC, TIMEOUT, F, S, batches, make_plan, run_ranks, warm_imports

from hethub.comm.communicator import Communicator
from hethub.errors import CheckpointError
from hethub.plan import Plan
from hethub.runtime.checkpoint import load_checkpoint, save_checkpoint
from hethub.runtime.trainer import Trainer, TrainerConfig

STEPS = 6
CFG = TrainerConfig(optim=replace(OPTIM, total_steps=STEPS, warmup_steps=2))


warm_imports()


def _train(rank: int, plan: Plan, data: list[torch.Tensor], *, start: int = 0, stop: int = STEPS,
           resume: str | None = None, save: str | None = None, cfg: TrainerConfig = CFG) -> dict[str, Any]:
    trainer = Trainer(plan, rank=rank, comm=Communicator(timeout=TIMEOUT), cfg=cfg)
    if resume is not None:
        assert load_checkpoint(trainer, resume).step == start
    losses = []
    for step in range(start, stop):
        loss, _ = trainer.forward_backward(data[step])
        trainer.sync_grads()
        trainer.clip_and_update()
        losses.append(loss)
    if save is not None:
        save_checkpoint(trainer, root=save, step=stop, keep=2)
    # ZeRO-3 frees parameters between uses: their values are the fp32 masters (collective).
    masters = trainer.zero.gather_state(trainer.optimizer) if trainer.zero is not None and trainer.zero.stage == 3 \
        else {}
    return {"losses": losses, "lr": trainer.optimizer.param_groups[0]["lr"],
            # numpy, not torch: torch tensors cross the result queue through shared memory a forked child's
            # os._exit tears down before the parent reads it.
            "params": {n: masters.get(n, {}).get("param", p.detach()).float().numpy().copy()
                       for n, p in trainer.model.named_parameters()}}


def _run(plan: Plan, data: list[torch.Tensor], **kw: Any) -> list[dict[str, Any]]:
    return run_ranks(plan.world_size, _train_kw, plan, data, kw)


def _train_kw(rank: int, plan: Plan, data: list[torch.Tensor], kw: dict[str, Any]) -> dict[str, Any]:
    return _train(rank, plan, data, **kw)


def test_resume_is_bit_identical(tmp_path: Path) -> None:
    # TP=2 stage, unequal DP replicas with different splits: gathering, one owner per parameter.
    plan = make_plan([(2, 2, [(F, 2, 3), (F, 1, 3)]), (2, 1, [(F, 1, 6)])])
    data = batches(plan, steps=STEPS)
    whole = _run(plan, data)
    first = _run(plan, data, stop=3, save=str(tmp_path))
    assert (tmp_path / "step-000003" / "manifest.json").is_file()
    second = _run(plan, data, start=3, resume=str(tmp_path))
    for w, a, b in zip(whole, first, second, strict=True):
        assert a["losses"] + b["losses"] == w["losses"]  # bit for bit
        assert w["lr"] == b["lr"]
        assert w["params"].keys() == b["params"].keys()
        for n, p in w["params"].items():
            assert np.array_equal(p, b["params"][n]), n


def _assert_resumes_like_uninterrupted(p: Plan, q: Plan, tmp_path: Path) -> None:
    """Saved by `p` after 3 of 4 steps, resumed under `q`: step 4's loss matches `p` running all 4."""
    data = batches(p, steps=4)
    whole = _run(p, data, stop=4)
    _run(p, data, stop=3, save=str(tmp_path))
    after = _run(q, data, start=3, stop=4, resume=str(tmp_path))
    for r in after:
        assert abs(r["losses"][0] - whole[0]["losses"][3]) <= 1e-6


def test_resume_under_another_plan(tmp_path: Path) -> None:
    # Saved by 2 stages (4/2) on one kind; resumed by 3 stages (2/3/1) over two kinds with a TP=2 middle.
    p = make_plan([(2, 4, [(F, 1, 4), (F, 1, 2)])])
    q = make_plan([(2, 4, [(S, 1, 2), (F, 2, 3), (S, 1, 1)])])
    _assert_resumes_like_uninterrupted(p, q, tmp_path)


def test_resume_vocab_split_under_another_plan(tmp_path: Path) -> None:
    # Tied table split by vocabulary on two TP=2 stages (gathered on save); resumed whole on a TP=1 first
    # stage and split again on a TP=2 head stage.
    spec = replace(SPEC, name="t6-tied", tied_embeddings=True)
    p = make_plan([(2, 4, [(F, 2, 3), (S, 2, 3)])], spec=spec)
    q = make_plan([(2, 4, [(S, 1, 2), (F, 2, 4)])], spec=spec)
    _assert_resumes_like_uninterrupted(p, q, tmp_path)


def _load_error(rank: int, plan: Plan, root: str) -> str:
    trainer = Trainer(plan, rank=rank, comm=Communicator(timeout=TIMEOUT), cfg=CFG)
    try:
        load_checkpoint(trainer, root)
    except CheckpointError as err:
        return str(err)
    return "loaded"


@pytest.mark.parametrize("damage", ["flip", "delete"])
def test_damaged_file_is_refused_by_every_rank(tmp_path: Path, damage: str) -> None:
    plan = make_plan([(2, 4, [(F, 1, 4), (F, 1, 2)])])
    _run(plan, batches(plan, steps=1), stop=1, save=str(tmp_path))
    victim = tmp_path / "step-000001" / "model-r00001.pt"
    if damage == "flip":
        raw = bytearray(victim.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        victim.write_bytes(bytes(raw))
    else:
        victim.unlink()
    for msg in run_ranks(plan.world_size, _load_error, plan, str(tmp_path)):
        assert str(victim) in msg and "corrupt" in msg, msg
        assert ("sha256" if damage == "flip" else "missing") in msg


def test_other_model_is_refused(tmp_path: Path) -> None:
    plan = make_plan([(2, 4, [(F, 1, 4), (F, 1, 2)])])
    _run(plan, batches(plan, steps=1), stop=1, save=str(tmp_path))
    other = make_plan([(2, 4, [(F, 1, 6)])], spec=replace(SPEC, hidden_size=48, num_heads=4))
    (msg,) = run_ranks(1, _load_error, other, str(tmp_path))
    assert "hidden_size" in msg and "manifest.json" in msg


def test_parameter_missing_from_manifest_stops_every_rank(tmp_path: Path) -> None:
    plan = make_plan([(2, 4, [(F, 1, 4), (F, 1, 2)])])
    _run(plan, batches(plan, steps=1), stop=1, save=str(tmp_path))
    path = tmp_path / "step-000001" / "manifest.json"
    manifest = json.loads(path.read_text())
    del manifest["tensors"]["layers.5.mlp.w2.weight"]  # held by rank 1 only
    path.write_text(json.dumps(manifest))
    msgs = run_ranks(plan.world_size, _load_error, plan, str(tmp_path))
    assert "layers.5.mlp.w2.weight" in msgs[1] and "another rank" in msgs[0]
    assert all("does not fit this model" in m for m in msgs)
