"""Elastic runs: a rank SIGKILLed under ``torchrun --max-restarts 1`` resumes and finishes exactly; a
job that comes back with fewer processes re-plans and resumes under the new plan (resharding).

Only the restart needs torchrun's agent. The runs that give the uninterrupted losses and the job
that comes back smaller are ``hethub.train``'s same ranks forked from this process
(``launch_forked``): the same entry point without the agent and without importing torch again in
every rank, which is most of a torchrun launch's cost here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _harness import CLUSTER, F, S, make_plan

from hethub.commands.replan import replan, replan_path, restrict_cluster, shrunk_plan
from hethub.errors import RuntimeSetupError
from hethub.runtime.elastic import Fault, maybe_inject_fault, parse_fault
from hethub.runtime.launch import launch_forked, torchrun_command

TIMEOUT_S = 120


def _losses(path: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, path.read_text().splitlines())}


def _torchrun(tmp: Path, *, nproc: int, steps: int, metrics: str, args: list[str],
              env: dict[str, str] | None = None, restarts: int = 0) -> str:
    import os
    import subprocess

    import hethub

    cmd = torchrun_command(tmp / "plan.json", nproc=nproc, steps=steps, metrics=tmp / metrics,
                           extra_args=["--timeout-s", "30", *args])
    # torchrun's own flags go before the module: restarts, and a fast failure monitor.
    i = cmd.index("-m", 3)
    cmd[i:i] = [f"--max-restarts={restarts}", "--monitor-interval=0.1"]
    full = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {}),
            "PYTHONPATH": str(Path(hethub.__file__).resolve().parents[1])}
    proc = subprocess.run(cmd, env=full, text=True, capture_output=True, timeout=TIMEOUT_S, check=False, cwd=tmp)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def _forked(tmp: Path, *, nproc: int, steps: int, metrics: str, args: list[str]) -> None:
    """The same ranks as `_torchrun` (same flags), forked from this process; their output goes to
    this process's stdout (read it with ``capfd``)."""
    codes = launch_forked(tmp / "plan.json", nproc=nproc, steps=steps, metrics=tmp / metrics, quiet=False,
                          timeout_s=TIMEOUT_S, extra_args=["--timeout-s", "30", *args])
    assert codes == [0] * nproc, codes


@pytest.fixture(autouse=True)
def _one_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """Forked and torchrun ranks alike run one thread each (as `_torchrun` sets), so losses match bit for bit."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.delenv("HETHUB_FAULT_INJECT", raising=False)


@pytest.mark.slow
def test_killed_rank_restarts_from_checkpoint_and_matches(tmp_path: Path) -> None:
    make_plan([(2, 2, [(F, 1, 4), (F, 1, 2)])]).save(tmp_path / "plan.json")
    _forked(tmp_path, nproc=2, steps=5, metrics="clean.jsonl", args=[])
    out = _torchrun(tmp_path, nproc=2, steps=5, metrics="killed.jsonl", restarts=1,
                    env={"HETHUB_FAULT_INJECT": "rank=1,step=3"},
                    # Synchronous saves: the step-2 checkpoint is then committed before the kill at step 3
                    # (a background save commits whenever its files are written, which a test cannot time).
                    args=["--checkpoint-dir", "ck", "--checkpoint-every", "2", "--resume", "auto",
                          "--checkpoint-sync"])
    assert "kills itself before step 3" in out and "resumed from ck/step-000002 at step 2" in out
    clean, killed = _losses(tmp_path / "clean.jsonl"), _losses(tmp_path / "killed.jsonl")
    assert sorted(killed) == [0, 1, 2, 3, 4]
    assert killed == clean  # bit for bit, the final loss included
    assert (tmp_path / "ck" / "latest").read_text().strip() == "step-000005"


@pytest.mark.slow
def test_fewer_processes_replan_and_resume(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                          capfd: pytest.CaptureFixture[str]) -> None:
    # 4 ranks (TP=2 replica beside a 2-stage replica) save at step 2; 2 processes come back.
    monkeypatch.chdir(tmp_path)  # the checkpoint flags are relative, as under `_torchrun`'s cwd
    make_plan([(2, 2, [(F, 1, 3), (F, 1, 3)]), (2, 2, [(F, 2, 6)])]).save(tmp_path / "plan.json")
    _forked(tmp_path, nproc=4, steps=4, metrics="full.jsonl",
            args=["--checkpoint-dir", "ck", "--checkpoint-every", "2"])
    capfd.readouterr()
    _forked(tmp_path, nproc=2, steps=4, metrics="shrunk.jsonl",
            args=["--checkpoint-dir", "ck2", "--resume", "ck/step-000002", "--replan-on-shrink"])
    out = "".join(capfd.readouterr())
    assert "re-planned" in out and "resharded" in out
    assert (tmp_path / "ck2" / "plan-world2.json").is_file()
    full, shrunk = _losses(tmp_path / "full.jsonl"), _losses(tmp_path / "shrunk.jsonl")
    assert sorted(shrunk) == [2, 3]
    for step in (2, 3):
        assert abs(shrunk[step] - full[step]) <= 1e-5


# ---- pure parts -----------------------------------------------------------------------------------
def test_restrict_cluster_keeps_device_order_and_partial_nodes() -> None:
    sub = restrict_cluster(CLUSTER, [0, 1, 4, 5, 6])  # 2 of the fast node, 3 of the slow node
    assert [d.kind for d in sub.devices] == [F, F, S, S, S]
    assert [g.devices_per_node for g in sub.groups] == [2, 3]
    with pytest.raises(RuntimeSetupError, match="Fix"):
        restrict_cluster(CLUSTER, [99])


def test_replan_uses_every_surviving_device(monkeypatch: pytest.MonkeyPatch) -> None:
    # In a training rank's process the planner forks nothing (hethub.fanout.serial), even where it could.
    import hethub.fanout as fanout

    monkeypatch.setenv(fanout.ENV, "2")
    monkeypatch.setattr(fanout.threading, "active_count", lambda: 1)
    monkeypatch.setattr(fanout._Pool, "run", lambda *_: pytest.fail("re-planning forked"))
    plan = make_plan([(2, 2, [(F, 2, 3), (S, 1, 3)]), (2, 2, [(F, 1, 6)])])  # devices F0 F1 F2 S4
    new = replan(plan, world_size=2)
    assert new.world_size == 2 and new.global_batch == plan.global_batch and new.model == plan.model
    assert {s.kind for p in new.pipelines for s in p.stages} == {F}
    assert new.meta["replanned_from_world_size"] == 4


def test_shrunk_plan_is_rank_0s_file_for_every_rank(tmp_path: Path) -> None:
    """Before any process group: rank 0 plans and writes the file, any other rank waits for a plan
    for exactly these devices there; a stale file for another job is neither taken nor kept."""
    import threading
    from dataclasses import replace

    plan = make_plan([(2, 2, [(F, 2, 3), (S, 1, 3)]), (2, 2, [(F, 1, 6)])])
    with pytest.raises(RuntimeSetupError, match=r"no plan for 2 devices .* shared file system"):
        shrunk_plan(plan, world_size=2, rank=1, root=tmp_path, timeout_s=0.3)
    other_job = replace(replan(plan, world_size=2), global_batch=plan.global_batch * 2,
                        pipelines=tuple(replace(p, num_micro_batches=2 * p.num_micro_batches)
                                        for p in replan(plan, world_size=2).pipelines))
    other_job.save(replan_path(tmp_path, 2))
    got: dict[int, object] = {}
    waiting = threading.Thread(target=lambda: got.update({1: shrunk_plan(plan, world_size=2, rank=1, root=tmp_path,
                                                                         timeout_s=60)}))
    waiting.start()  # sees only the other job's plan until rank 0 replaces it
    got[0] = shrunk_plan(plan, world_size=2, rank=0, root=tmp_path, timeout_s=60)
    waiting.join()
    assert got[0] == got[1] and got[0].global_batch == plan.global_batch and got[0].world_size == 2
    assert shrunk_plan(plan, world_size=2, rank=0, root=tmp_path, timeout_s=1) == got[0]  # reused, not re-made


def test_replan_keeps_sharding_and_the_headroom() -> None:
    from dataclasses import replace

    from hethub.predict.predictor import with_shard_weights

    plan = make_plan([(2, 2, [(F, 2, 3), (S, 1, 3)]), (2, 2, [(F, 1, 6)])])
    sharded = with_shard_weights(replace(plan, optimizer_sharding="zero1"), mem_headroom=0.25)
    new = replan(sharded, world_size=3)
    assert new.optimizer_sharding == "zero1" and new.shard_weights is not None
    assert new.shard_weights == with_shard_weights(replace(new, shard_weights=None), mem_headroom=0.25).shard_weights


def test_entry_point_completes_a_plan_without_split_weights(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A ZeRO-1 plan file without the split (written before plan version 7) trains: the entry point
    computes it at the default headroom and says so; a plan that carries one keeps it."""
    from dataclasses import replace

    from hethub.predict.memory import DEFAULT_MEM_HEADROOM
    from hethub.predict.predictor import with_shard_weights
    from hethub.runtime.train import parse_args
    from hethub.train import rank_plan

    plan = replace(make_plan([(2, 2, [(F, 2, 3), (S, 1, 3)]), (2, 2, [(F, 1, 6)])]), optimizer_sharding="zero1")
    plan.save(tmp_path / "old.json")
    got = rank_plan(parse_args(["--plan", str(tmp_path / "old.json")]), world_size=4, rank=0)
    assert got.shard_weights == with_shard_weights(plan).shard_weights
    assert got.shard_weights is not None and got.shard_weights.mem_headroom == DEFAULT_MEM_HEADROOM
    assert "carries no optimizer shard weights" in capsys.readouterr().out
    with_shard_weights(plan, mem_headroom=0.25).save(tmp_path / "new.json")
    got = rank_plan(parse_args(["--plan", str(tmp_path / "new.json")]), world_size=4, rank=0)
    assert got.shard_weights is not None and got.shard_weights.mem_headroom == 0.25
    assert capsys.readouterr().out == ""


def test_fault_spec() -> None:
    assert parse_fault("rank=1,step=3") == Fault(rank=1, step=3)
    with pytest.raises(RuntimeSetupError, match="rank=R,step=S"):
        parse_fault("rank=1")
    # Only in torchrun's first attempt, and only on the named rank and step: these return.
    maybe_inject_fault(rank=1, step=3, env={"HETHUB_FAULT_INJECT": "rank=1,step=3", "TORCHELASTIC_RESTART_COUNT": "1"})
    maybe_inject_fault(rank=0, step=3, env={"HETHUB_FAULT_INJECT": "rank=1,step=3"})
    maybe_inject_fault(rank=1, step=2, env={})
