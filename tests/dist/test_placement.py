"""Per-kind placement in the training entry point, on CPU: two kinds, each with its own group, the
bridge forced between them. Checks which group every collective and message of a real training step
uses, and that `hethub.train` on such a plan logs the per-kind groups and trains like one device
(1e-5). Its ranks are forked from this process (``launch_forked``: the entry point torchrun starts,
without torchrun's agent and a torch import per rank); tests/dist/test_train_cli.py and
tests/dist/test_elastic.py launch it under torchrun itself."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _harness import OPTIM, TIMEOUT, F, S, batches, make_plan, run_ranks

from hethub.comm.factory import BRIDGE_ENV, make_communicator
from hethub.runtime.checkpoint_io import latest_dir, read_manifest
from hethub.runtime.data import BatchSource, byte_tokenize, load_tokens
from hethub.runtime.launch import launch_forked
from hethub.runtime.optim import OptimConfig
from hethub.runtime.reference import train_single_device
from hethub.runtime.trainer import Trainer, TrainerConfig

# Pipeline 0: F rank 0 (layers 0-3, embedding) -> S rank 2 (4-5, head); pipeline 1: F rank 1 (0-1) ->
# S rank 3 (2-5). Sync groups: layers 0-1 + embedding {0,1} (inside F), 2-3 {0,3} (across kinds),
# 4-5 + head {2,3} (inside S); p2p 0->2 and 1->3 across kinds.
STAGES = [(2, 2, [(F, 1, 4), (S, 1, 2)]), (2, 2, [(F, 1, 2), (S, 1, 4)])]
KIND_OF_RANK = [F, F, S, S]


def _ranks_of(pg: Any) -> tuple[int, ...]:
    return tuple(range(dist.get_world_size())) if pg is None else tuple(dist.get_process_group_ranks(pg))


def _group_use_worker(rank: int, plan, data) -> dict[str, Any]:
    os.environ[BRIDGE_ENV] = "force"
    comm = make_communicator(plan=plan, rank=rank, timeout=TIMEOUT, device_types=dict.fromkeys((F, S), "cpu"))
    trainer = Trainer(plan, rank=rank, comm=comm, cfg=TrainerConfig(optim=OPTIM))
    native = {id(p.native_pg) for r in comm._routes.values() for p in [r.local] if p is not None and p.native_pg}
    native |= {id(comm._island_pg)} if comm._island_pg is not None else set()
    bridge = {id(pg) for r in comm._routes.values() for pg in (r.segment_pgs or {}).values()}
    bridge |= {id(r.host_pg) for r in comm._routes.values() if r.host_pg is not None} | {id(comm._bridge_pg)}
    log: list[tuple[str, tuple[int, ...], str]] = []
    real = {n: getattr(dist, n) for n in ("all_reduce", "reduce", "broadcast", "isend", "irecv")}

    def spy(name):
        def call(*args, **kw):
            pg = kw.get("group")
            where = "native" if id(pg) in native else "bridge" if id(pg) in bridge or pg is None else "other"
            log.append((name, _ranks_of(pg), where))
            return real[name](*args, **kw)
        return call

    for n in real:
        setattr(dist, n, spy(n))
    try:
        trainer.train_step(data[0], step=0)
    finally:
        for n, f in real.items():
            setattr(dist, n, f)
    comm.barrier()
    return {"log": log, "islands": comm.describe()["islands"]}


def test_each_collective_uses_its_kinds_group_or_the_bridge() -> None:
    plan = make_plan(STAGES)
    res = run_ranks(4, _group_use_worker, plan, batches(plan, steps=1))
    assert {k: v["ranks"] for k, v in res[0]["islands"].items()} == {f"kind:{F}": [0, 1], f"kind:{S}": [2, 3]}
    seen = set()
    for rank, r in enumerate(res):
        for op, ranks, where in r["log"]:
            kinds = {KIND_OF_RANK[x] for x in ranks}
            if where == "native":
                assert len(kinds) == 1, (rank, op, ranks)  # a kind's own group never spans kinds
            else:
                assert where == "bridge", (rank, op, ranks, where)  # cross-kind: only the bridge's gloo groups
            seen.add((op, where, len(kinds)))
    # The step really used each path: in-kind sync on native groups, cross-kind sync and p2p on the bridge.
    assert ("all_reduce", "native", 1) in seen or ("reduce", "native", 1) in seen
    assert ("all_reduce", "bridge", 2) in seen
    assert ("isend", "bridge", 2) in seen and ("irecv", "bridge", 2) in seen


def _corpus_batches(plan, steps: int) -> list[torch.Tensor]:
    """The batches hethub.train reads (default corpus, byte tokens), for the single-device reference."""
    src = BatchSource(load_tokens(num_tokens=steps * plan.global_batch * (plan.seq_len + 1), tokenize=byte_tokenize),
                      global_batch=plan.global_batch, seq_len=plan.seq_len)
    return [src.global_batch_at(s) for s in range(steps)]


@pytest.mark.slow
def test_train_two_kinds_logs_per_kind_groups_and_matches_one_device(tmp_path: Path, monkeypatch,
                                                                     capfd: pytest.CaptureFixture[str]) -> None:
    plan = make_plan(STAGES)
    plan.save(tmp_path / "plan.json")
    steps = 2
    monkeypatch.setenv(BRIDGE_ENV, "force")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    args = ["--lr", "1e-3", "--warmup-steps", "1", "--grad-clip", "0.5", "--timeout-s", "60",
            "--checkpoint-dir", str(tmp_path / "ck")]
    capfd.readouterr()
    codes = launch_forked(tmp_path / "plan.json", nproc=4, steps=steps, metrics=tmp_path / "m.jsonl", quiet=False,
                          timeout_s=240, extra_args=args)
    out, err = capfd.readouterr()
    assert codes == [0] * 4, (codes, err[-3000:])
    assert f"kind {F}: ranks 0-1 on cpu" in out and f"gloo group kind:{F} over ranks 0-1" in out
    assert f"kind {S}: ranks 2-3 on cpu" in out and f"gloo group kind:{S} over ranks 2-3" in out
    assert "through the bridge" in out and "forced" in out
    # The reference uses hethub.train's optimizer settings for these arguments.
    optim = OptimConfig(lr=1e-3, warmup_steps=1, total_steps=steps, weight_decay=0.1, grad_clip=0.5)
    ref = train_single_device(plan.model, _corpus_batches(plan, steps), optim=optim)
    first = json.loads((tmp_path / "m.jsonl").read_text().splitlines()[0])
    assert abs(first["loss"] - ref["loss"]) <= 1e-5
    step_dir = latest_dir(tmp_path / "ck")
    params = {}
    for name in read_manifest(step_dir)["files"]:
        params |= {k.removeprefix("param:"): v for k, v in torch.load(step_dir / name).items()
                   if k.startswith("param:")}
    assert set(params) == set(ref["params"])
    diff = max((params[n] - ref["params"][n]).abs().max().item() for n in params)
    assert diff <= 1e-5, diff
