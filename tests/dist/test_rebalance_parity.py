"""Online re-balancing keeps training that of one device: across a change of batch shares (uneven
replicas, a TP-2 stage) and across live layer moves (into a TP-2 stage, out of a TP-1 one, with and
without ZeRO-1), parameters after 3 AdamW steps within 1e-5 of one device in fp32; the decision goes
from the log rank to every rank through the run's own hook; a checkpoint taken after the changes
resumes with them."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from _harness import OPTIM, TIMEOUT, F, S, batches, make_plan, reference, run_ranks, warm_imports

from hethub.comm.factory import make_communicator
from hethub.commands.rebalance_plan import saved_balance
from hethub.plan import Plan
from hethub.predict.predictor import with_shard_weights
from hethub.rebalance import Decision, LayerMove, Observation, RebalanceConfig
from hethub.rebalance.decision import shares_of, stage_layers_of
from hethub.runtime.checkpoint import load_checkpoint, save_checkpoint
from hethub.runtime.rebalance import LiveRebalance
from hethub.runtime.tensor_parallel import TPContext, shard
from hethub.runtime.trainer import Trainer, TrainerConfig

TOL = 1e-5


def setup_module() -> None:
    warm_imports()


class _Forced:
    """A policy that decides ``by_step[step]`` (the log rank's part of the hook, without measurements)."""

    def __init__(self, by_step: dict[int, Decision]) -> None:
        self.by_step = by_step
        self.watch = argparse.Namespace(basis="its prediction")

    def observe(self, step: int, ranks: Any, *, step_time_s: float) -> Observation:
        return Observation(decision=self.by_step.get(step))

    def applied(self, step: int, decision: Decision, plan: Plan) -> None:
        pass


def _diff(trainer: Trainer, ref: dict[str, torch.Tensor]) -> float:
    tp = TPContext(size=trainer.place.stage.tp, rank=trainer.place.tp_rank)
    return max((p.detach() - shard(ref[n], dim=trainer.model.shard_dim(n), tp=tp)).abs().max().item()
               for n, p in trainer.model.named_parameters())


def _train(rank: int, plan: Plan, data: list[torch.Tensor], changes: dict[int, Decision], steps: range,
           trainer: Trainer | None = None) -> tuple[Trainer, list[float], list[dict]]:
    """Train ``steps`` through the run's hook with ``changes`` forced; (trainer, losses, change records)."""
    if trainer is None:
        comm = make_communicator(plan=plan, rank=rank, timeout=TIMEOUT)
        trainer = Trainer(plan, rank=rank, comm=comm, cfg=TrainerConfig(optim=OPTIM))
    live = LiveRebalance(trainer, cfg=RebalanceConfig(mode="layers"), say=lambda text: None)
    if live.policy is not None:
        live.policy = _Forced(changes)  # type: ignore[assignment]
    losses, applied = [], []
    for step in steps:
        live.before_step(step)
        rec = trainer.train_step(data[step], step=step)
        live.after_step(step, rec)
        if rec is not None:
            losses.append(rec["loss"])
            applied.append(rec.get("rebalance", {}).get("change"))
    return trainer, losses, applied


def _worker(rank: int, plan: Plan, data: list[torch.Tensor], ref: dict[str, Any], changes: dict[int, Decision]) -> dict:
    trainer, losses, applied = _train(rank, plan, data, changes, range(len(data)))
    return {"param_diff": _diff(trainer, ref["params"]), "losses": losses, "applied": applied,
            "shares": shares_of(trainer.plan), "layers": stage_layers_of(trainer.plan),
            "names": sorted(n for n, _ in trainer.model.named_parameters())}


def check(plan: Plan, changes: dict[int, Decision]) -> list[dict]:
    data = batches(plan, steps=3)
    ref = reference(plan.model, data, optim=OPTIM)
    res = run_ranks(plan.world_size, _worker, plan, data, ref, changes)
    final = plan
    for step in sorted(changes):
        final = changes[step].apply(final)
    assert set().union(*(r["names"] for r in res)) == set(ref["params"]), "every parameter is held somewhere"
    for r in res:
        assert r["param_diff"] <= TOL, r
        assert (r["shares"], r["layers"]) == (shares_of(final), stage_layers_of(final))
    log = [r for r in res if r["losses"]]
    assert len(log) == 1 and [a is not None for a in log[0]["applied"]] == [s in changes for s in range(3)]
    for got, want in zip(log[0]["losses"], ref["losses"], strict=True):
        assert abs(got - want) <= TOL
    return res


def test_share_change_keeps_one_device_numerics() -> None:
    """Uneven replicas (3 and 1 micro-batches, a TP-2 stage beside a TP-1 one), re-split to 1 and 3
    after step 0, then to 2 and 2 after step 1."""
    plan = make_plan([(2, 3, [(F, 2, 3), (S, 1, 3)]), (2, 1, [(S, 1, 6)])])
    check(plan, {0: Decision(counts=(1, 3)), 1: Decision(counts=(2, 2))})


def _moves() -> tuple[Plan, dict[int, Decision]]:
    """Pipeline 0 moves layer 3 into its TP-2 first stage after step 0; pipeline 1 moves layer 1 out of
    its first stage (with a share change) after step 1."""
    plan = make_plan([(2, 2, [(F, 2, 3), (S, 1, 3)]), (2, 2, [(S, 1, 2), (F, 1, 4)])])
    return plan, {0: Decision(counts=(2, 2), move=LayerMove(pipeline=0, src=1, dst=0)),
                  1: Decision(counts=(3, 1), move=LayerMove(pipeline=1, src=0, dst=1))}


def test_layer_moves_keep_one_device_numerics() -> None:
    plan, changes = _moves()
    res = check(plan, changes)
    assert {r["layers"][0][0] for r in res} == {4}


def test_layer_moves_under_zero1_keep_one_device_numerics() -> None:
    plan, changes = _moves()
    check(with_shard_weights(replace(plan, optimizer_sharding="zero1").validate()), changes)


def _save_after_changes(rank: int, plan: Plan, data: list[torch.Tensor], changes: dict[int, Decision],
                        root: str) -> None:
    trainer, _, _ = _train(rank, plan, data, changes, range(2))
    save_checkpoint(trainer, root=root, step=2)


def _resume(rank: int, plan: Plan, data: list[torch.Tensor], ref: dict[str, Any], root: str) -> dict:
    comm = make_communicator(plan=plan, rank=rank, timeout=TIMEOUT)
    trainer = Trainer(plan, rank=rank, comm=comm, cfg=TrainerConfig(optim=OPTIM))
    got = load_checkpoint(trainer, root)
    _train(rank, plan, data, {}, range(2, 3), trainer=trainer)
    return {"step": got.step, "resharded": got.resharded, "param_diff": _diff(trainer, ref["params"])}


def test_checkpoint_after_changes_resumes_with_them(tmp_path: Path) -> None:
    plan, changes = _moves()
    data = batches(plan, steps=3)
    ref = reference(plan.model, data, optim=OPTIM)
    run_ranks(plan.world_size, _save_after_changes, plan, data, changes, str(tmp_path))
    args = argparse.Namespace(resume="auto", checkpoint_dir=str(tmp_path))
    resumed = saved_balance(plan, args)
    final = changes[1].apply(changes[0].apply(plan))
    assert (shares_of(resumed), stage_layers_of(resumed)) == (shares_of(final), stage_layers_of(final)) \
        == ([3, 1], [[4, 2], [1, 5]])
    other = make_plan([(2, 2, [(F, 2, 3), (S, 1, 3)]), (2, 2, [(S, 1, 3), (F, 1, 3)])], schedule="gpipe")
    assert saved_balance(other, args) is other, "another job's plan is never replaced"
    res = run_ranks(plan.world_size, _resume, resumed, data, ref, str(tmp_path))
    for r in res:
        assert (r["step"], r["resharded"]) == (2, False)
        assert r["param_diff"] <= TOL, r


@pytest.mark.slow
def test_hethub_train_rebalances_a_slowed_rank_and_the_report_shows_it(tmp_path: Path) -> None:
    """The whole path under torchrun: --emulate-slowdown slows rank 1 four times from step 1 (a margin
    other processes' load on a shared host cannot hide), the shares move away from it at a step
    boundary, the change is logged with its reason and predicted gain, and the report lists the
    shares over the run."""
    from hethub.predict.predictor import predict
    from hethub.report import write_report
    from hethub.runtime.launch import launch_local

    plan = make_plan([(1, 4, [(F, 1, 6)]), (1, 4, [(F, 1, 6)])])
    plan.save(tmp_path / "plan.json")
    metrics = tmp_path / "m.jsonl"
    proc = launch_local(tmp_path / "plan.json", nproc=2, steps=8, metrics=metrics, capture=True, timeout_s=240,
                        extra_args=["--timeout-s", "60", "--emulate-slowdown", "1:4@1", "--rebalance-patience", "1"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    recs = [json.loads(line) for line in metrics.read_text().splitlines()]
    changes = [(r["step"], r["rebalance"]["change"]) for r in recs if "change" in r["rebalance"]]
    assert changes, [r["rebalance"] for r in recs]
    step, change = changes[0]
    assert change["shares"][0] > change["shares"][1] and sum(change["shares"]) == 8
    assert change["predicted_gain"] > 0.05 and "pipelines finish at" in change["reason"]
    assert recs[step + 1]["rebalance"]["shares"] == change["shares"]
    assert all(r["ranks"][0]["mb_fwd_s"] > 0 and r["ranks"][1]["span_s"] > 0 for r in recs)
    assert "re-balanced after step" in proc.stdout
    summary = write_report(plan=plan, prediction=predict(plan), out_dir=tmp_path / "report",
                           metrics_path=metrics).summary_md.read_text()
    assert "## Re-balancing (measured)" in summary and str(change["shares"]) in summary
