"""The cross-kind bridge on CPU: two (or three) emulated kinds, each its own native group, with the
bridge forced between them. Point-to-point must deliver exactly what was sent; all-reduces must equal
a plain gloo all-reduce of the same data (integer-valued data, so summation order cannot matter);
training through the bridge must match one device like the runtime's parity tests."""

from __future__ import annotations

import argparse
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _harness import OPTIM, TIMEOUT, batches, make_plan, reference, run_ranks

from conftest import EXAMPLES
from hethub.comm.backends import available_backends, backend_for_kind
from hethub.comm.bridge import BridgedCommunicator, StagedWork
from hethub.comm.communicator import Communicator
from hethub.comm.factory import BRIDGE_ENV, bridge_mode, make_communicator
from hethub.commands import bench
from hethub.commands.bench import parse_bytes
from hethub.emulation.host import host_model
from hethub.errors import RuntimeSetupError
from hethub.plan import Pipeline, Plan, Stage
from hethub.predict.comm import p2p_time_s
from hethub.predict.links import plan_with_links, read_links_profile
from hethub.predict.predictor import predict
from hethub.predict.sync import sync_groups
from hethub.runtime.tensor_parallel import TPContext, shard
from hethub.runtime.trainer import Trainer, TrainerConfig
from hethub.spec.cluster import load_cluster
from hethub.spec.kind import catalog
from hethub.spec.model import PRESETS

DTYPES = (torch.float32, torch.float64, torch.int64, torch.bfloat16)
SHAPES = ((7,), (3, 5), (2, 3, 4), (1, 1))


def _bridge(kinds: list[str], **kw: Any) -> BridgedCommunicator:
    return BridgedCommunicator(kind_of_rank=kinds, backend_of_kind=dict.fromkeys(kinds, "gloo"), timeout=TIMEOUT,
                               force_bridge=True, **kw)


def _payload(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(-(2**40), 2**40, shape, generator=g, dtype=dtype)


# ---- point to point --------------------------------------------------------------------------------
def _p2p_worker(rank: int) -> dict[str, Any]:
    comm = _bridge(["a", "a", "b", "b"])
    staged, checked = [], 0
    for i, (dtype, shape) in enumerate((d, s) for d in DTYPES for s in SHAPES):
        want = _payload(dtype, shape, seed=i)
        for src, dst in ((0, 2), (3, 1), (0, 1)):  # a->b and b->a through the bridge, a->a direct
            if rank == src:
                work = comm.isend(want.t() if want.dim() == 2 else want, dst=dst, tag=i)  # t(): non-contiguous
                staged.append(isinstance(work, StagedWork))
                work.wait()
            elif rank == dst:
                got = torch.empty(shape[::-1] if len(shape) == 2 else shape, dtype=dtype)
                comm.recv(got, src=src, tag=i)
                expect = want.t() if want.dim() == 2 else want
                assert got.dtype == dtype and torch.equal(got, expect), (src, dst, dtype, shape)
                checked += 1
    comm.barrier()
    return {"staged": staged, "checked": checked}


def test_p2p_across_kinds_all_shapes_and_dtypes() -> None:
    res = run_ranks(4, _p2p_worker)
    n = len(DTYPES) * len(SHAPES)
    assert res[0]["staged"] == [True, False] * n  # rank 0 sends to b (bridge) then to a (direct)
    assert res[3]["staged"] == [True] * n
    assert res[1]["checked"] == 2 * n and res[2]["checked"] == n


def _irecv_worker(rank: int) -> list[bool]:
    """Receives posted before the sends, several outstanding, waited on out of order."""
    comm = _bridge(["a", "b"])  # force_bridge stages host copies: StagedWork's receive path
    payloads = [_payload(torch.float32, (3, 4), seed=i) for i in range(3)]
    ok = []
    if rank == 1:
        bufs = [torch.empty(3, 4) for _ in payloads]
        works = [comm.irecv(b, src=0, tag=i) for i, b in enumerate(bufs)]
        ok.append(all(isinstance(w, StagedWork) for w in works))
        comm.barrier()  # the sender starts only now
        for i in (2, 0, 1):
            works[i].wait()
            ok.append(torch.equal(bufs[i], payloads[i]))
    else:
        comm.barrier()
        for w in [comm.isend(x, dst=1, tag=i) for i, x in enumerate(payloads)]:
            w.wait()
    comm.barrier()
    return ok


def _chunked_worker(rank: int) -> int:
    # Rank 0 stages its host tensors (as a device rank does), rank 1 sends and receives in place: the
    # two ends cut each message into the same chunks whichever path they take.
    comm = _bridge(["a", "b"], p2p_chunk_bytes=1000, stage_host=rank == 0)
    checked = 0
    for i, (dtype, numel) in enumerate((d, n) for d in DTYPES for n in (1, 999, 12_345)):
        want = _payload(dtype, (numel,), seed=i)
        for src in (0, 1):
            if rank == src:
                comm.isend(want, dst=1 - src, tag=i).wait()
            else:
                got = torch.empty(numel, dtype=dtype)
                comm.recv(got, src=src, tag=i)
                assert torch.equal(got, want), (src, dtype, numel)
                checked += 1
    comm.barrier()
    return checked


def test_p2p_in_chunks_staged_on_one_end_only() -> None:
    assert run_ranks(2, _chunked_worker) == [3 * len(DTYPES)] * 2


def test_irecv_posted_ahead_through_the_bridge() -> None:
    assert run_ranks(2, _irecv_worker)[1] == [True] * 4


# ---- all-reduce ------------------------------------------------------------------------------------
def _data(rank: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    # Integer-valued, large enough that a wrong partial sum would show, small enough to stay exact.
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randint(-1000, 1000, (numel,), generator=g).to(dtype)


def _allreduce_worker(rank: int, kinds: list[str], groups: list[tuple[int, ...]], chunk_bytes: int,
                      numel: int) -> int:
    comm = _bridge(kinds, chunk_bytes=chunk_bytes)
    comm.create_groups(groups)
    plain = {g: dist.new_group(list(g), backend="gloo") for g in groups}  # reference, same order everywhere
    checked = 0
    for group in [None, *groups]:
        members = range(len(kinds)) if group is None else group
        for dtype in (torch.float32, torch.float64, torch.int64, torch.bfloat16):
            for op, rop in (("sum", dist.ReduceOp.SUM), ("max", dist.ReduceOp.MAX)):
                if rank not in members:
                    continue
                # bf16 holds integers exactly only up to 256: keep its data small.
                x = _data(rank, numel, dtype) if dtype != torch.bfloat16 else _data(rank, numel, dtype) // 64
                expect = x.clone()
                dist.all_reduce(expect, op=rop, group=None if group is None else plain[group])
                got = comm.all_reduce(x.view(-1, 2).t() if numel % 2 == 0 else x, group=group, op=op)
                got = got.t().reshape(-1) if numel % 2 == 0 else got
                assert torch.equal(got, expect), (group, dtype, op, (got - expect).abs().max())
                checked += 1
    comm.barrier()
    return checked


@pytest.mark.parametrize(("kinds", "groups", "numel"), [
    (["a", "b"], [], 1000),
    (["a", "a", "b", "b"], [(0, 2), (0, 1, 3), (2, 3)], 1000),
    (["a", "b", "b", "c"], [(1, 2, 3), (0, 3)], 1000),
    # Islands of 2 and 3: shards of a half and a third cut four segments; 1001 elements pad to 1002,
    # 1000 (strided: the non-contiguous path) to 1002 too.
    (["a", "b", "a", "b", "b"], [(0, 1, 2), (1, 2, 3, 4)], 1001),
    (["a", "b", "a", "b", "b"], [(1, 2, 3, 4)], 1000),
])
def test_all_reduce_across_kinds_equals_plain_gloo(kinds: list[str], groups: list[tuple[int, ...]],
                                                   numel: int) -> None:
    checked = run_ranks(len(kinds), _allreduce_worker, kinds, groups, 4 * 1024 * 1024, numel)
    assert all(c > 0 for c in checked)


def test_chunked_all_reduce_with_tiny_chunks() -> None:
    # 13 bytes: 1-3 elements per chunk, several hundred async chunks in flight, ragged last chunk.
    checked = run_ranks(4, _allreduce_worker, ["a", "a", "b", "b"], [(1, 2)], 13, 602)
    assert all(c > 0 for c in checked)


def _gather_worker(rank: int) -> dict[str, Any]:
    comm = _bridge(["a", "b", "b"])
    comm.create_groups([(0, 1), (1, 2)])
    x = torch.full((2, 3), float(rank))
    # Results go back as lists: a tensor on the queue is shared through the child, which exits at once.
    out = {"mixed": comm.all_gather(x, group=(0, 1), dim=0).tolist() if rank in (0, 1) else None,
           "native": comm.all_gather(x, group=(1, 2), dim=1).tolist() if rank in (1, 2) else None,
           "objects": comm.gather_objects({"rank": rank}, dst=2), "describe": comm.describe()}
    comm.barrier()
    return out


def test_all_gather_and_objects_across_kinds() -> None:
    res = run_ranks(3, _gather_worker)
    assert res[0]["mixed"] == torch.cat([torch.zeros(2, 3), torch.ones(2, 3)]).tolist()
    assert res[2]["native"] == torch.cat([torch.ones(2, 3), torch.full((2, 3), 2.0)], dim=1).tolist()
    assert res[2]["objects"] == [{"rank": r} for r in range(3)] and res[0]["objects"] is None
    assert res[0]["describe"]["bridged"] and len(res[0]["describe"]["islands"]) == 2


# ---- reduce-scatter and all-gather (the sharded sync's two-level exchange) ------------------------------
def _sharded_worker(rank: int, kinds: list[str], groups: list[tuple[int, ...]], stage_host: bool) -> int:
    comm = _bridge(kinds, stage_host=stage_host)
    comm.create_groups(groups)
    plain = {g: dist.new_group(list(g), backend="gloo") for g in groups}  # reference, same order everywhere
    checked = 0
    for group in groups:
        if rank not in group:
            continue
        k = len(group)
        for dtype in (torch.float32, torch.bfloat16):
            x = _data(rank, 7 * k, dtype) // (64 if dtype == torch.bfloat16 else 1)
            expect = torch.empty(7, dtype=dtype)
            dist.reduce_scatter_tensor(expect, x.clone(), group=plain[group])
            got = comm.reduce_scatter(x, group=group)
            assert got.shape == (7,) and torch.equal(got, expect), (group, dtype, got, expect)
            mine = _data(rank, 6, dtype).view(2, 3)
            parts = [torch.empty_like(mine) for _ in group]
            dist.all_gather(parts, mine, group=plain[group])
            for dim in (0, 1):
                assert torch.equal(comm.all_gather(mine, group=group, dim=dim), torch.cat(parts, dim=dim)), group
            checked += 1
    comm.barrier()
    return checked


@pytest.mark.parametrize("stage_host", [False, True])
def test_reduce_scatter_and_all_gather_across_islands_equal_plain_gloo(stage_host: bool) -> None:
    # Unequal islands (3 a's, 1 b, 2 c's): proxies with several foreign chunks, blocks padded, one-rank
    # islands, and a group inside one island (the native path).
    kinds = ["a", "b", "a", "c", "a", "c"]
    groups = [(0, 1, 2, 3, 4, 5), (0, 1, 3), (1, 2, 4, 5), (0, 2, 4), (1, 3)]
    checked = run_ranks(len(kinds), _sharded_worker, kinds, groups, stage_host)
    assert all(c > 0 for c in checked)


# ---- backends and the factory ----------------------------------------------------------------------
def test_missing_backend_error_names_backend_kind_and_fix() -> None:
    with pytest.raises(RuntimeSetupError) as err:
        backend_for_kind(catalog()["ascend-910b"], device_type="npu", available=("gloo",))
    msg = str(err.value)
    assert "plan needs backend 'hccl' for kind 'ascend-910b' but this torch build has: gloo" in msg
    assert "Fix: install torch_npu" in msg
    if "nccl" not in available_backends():
        with pytest.raises(RuntimeSetupError, match=r"backend 'nccl' for kind 'a100-80gb'.*Fix: install a CUDA"):
            backend_for_kind(catalog()["a100-80gb"], device_type="cuda")
    # Kinds run on the host use gloo whatever the catalog says (emulation).
    assert backend_for_kind(catalog()["ascend-910b"], device_type="cpu") == "gloo"
    assert backend_for_kind(catalog()["h100-sxm"], device_type="cuda", available=("gloo", "nccl")) == "nccl"
    with pytest.raises(RuntimeSetupError, match="placed on 'npu'"):
        backend_for_kind(catalog()["h100-sxm"], device_type="npu", available=("gloo", "nccl"))


def test_bridge_mode_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(BRIDGE_ENV, "force")
    assert bridge_mode("auto") == "force"
    monkeypatch.setenv(BRIDGE_ENV, "sideways")
    with pytest.raises(RuntimeSetupError, match="HETHUB_BRIDGE=auto, force or off"):
        bridge_mode("auto")
    monkeypatch.delenv(BRIDGE_ENV)
    assert bridge_mode("off") == "off"


def _factory_worker(rank: int, plan: Plan) -> dict[str, Any]:
    out = {}
    for mode in ("auto", "force", "off"):
        comm = make_communicator(plan=plan, rank=rank, timeout=TIMEOUT, bridge=mode)
        out[mode] = (type(comm).__name__, getattr(comm, "bridged", None))
    return out


def test_factory_modes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(BRIDGE_ENV, raising=False)
    plan = make_plan([(2, 2, [("cpu-fast", 1, 3), ("cpu-slow", 1, 3)])])
    res = run_ranks(2, _factory_worker, plan)
    # Two CPU kinds share gloo: auto needs no bridge, force bridges them, off is the plain seam.
    assert res[0] == {"auto": ("BridgedCommunicator", False), "force": ("BridgedCommunicator", True),
                      "off": ("Communicator", None)}


# ---- the runtime through the bridge ----------------------------------------------------------------
def _train_worker(rank: int, plan: Plan, data: list[torch.Tensor], ref: dict[str, Any]) -> dict[str, Any]:
    comm = make_communicator(plan=plan, rank=rank, timeout=TIMEOUT, bridge="force", chunk_bytes=1000)
    assert isinstance(comm, BridgedCommunicator) and comm.bridged
    trainer = Trainer(plan, rank=rank, comm=comm, cfg=TrainerConfig(optim=OPTIM))
    tp = TPContext(size=trainer.place.stage.tp, rank=trainer.place.tp_rank)
    named = dict(trainer.model.named_parameters())
    loss, _ = trainer.forward_backward(data[0])
    trainer.sync_grads()
    grad_diff = max((p.grad - shard(ref["grads"][n], dim=trainer.model.shard_dim(n), tp=tp)).abs().max().item()
                    for n, p in named.items())
    trainer.clip_and_update()
    for step in range(1, len(data)):
        trainer.train_step(data[step], step=step)
    param_diff = max((p.detach() - shard(ref["params"][n], dim=trainer.model.shard_dim(n), tp=tp)).abs().max().item()
                     for n, p in named.items())
    return {"loss": loss, "grad_diff": grad_diff, "param_diff": param_diff}


@pytest.mark.parametrize("stages", [
    [(2, 4, [("cpu-fast", 1, 2), ("cpu-slow", 1, 2), ("cpu-fast", 1, 2)])],  # p2p a->b->a and back
    [(2, 2, [("cpu-fast", 2, 6)]), (2, 2, [("cpu-slow", 1, 6)])],  # DP across kinds, island of 2 + 1
])
def test_runtime_parity_with_bridge_forced(stages: list) -> None:
    plan = make_plan(stages)
    data = batches(plan, steps=2)
    ref = reference(plan.model, data, optim=OPTIM)
    for r in run_ranks(plan.world_size, _train_worker, plan, data, ref):
        assert abs(r["loss"] - ref["loss"]) <= 1e-5
        assert r["grad_diff"] <= 1e-5 and r["param_diff"] <= 1e-5, r


def test_plain_communicator_is_still_the_seam() -> None:
    assert issubclass(BridgedCommunicator, Communicator)


# ---- hethub bench comm -----------------------------------------------------------------------------
def test_bench_comm_writes_a_profile_the_predictor_reads(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser(prog="hethub")
    bench.register(parser.add_subparsers(dest="command", required=True))
    out = tmp_path / "links.json"
    cluster_file = EXAMPLES / "local-cpu.toml"
    args = parser.parse_args(["bench", "comm", "--cluster", str(cluster_file), "--out", str(out),
                              "--max-bytes", "64KiB"])
    assert args.func(args) == 0
    assert "loopback" in capsys.readouterr().out
    profile = read_links_profile(out)
    assert set(profile.links) == {"intra_node:cpu-fast", "intra_node:cpu-slow", "cross_kind"}
    assert all(len(f.samples) == 3 and f.bw_bytes_per_s > 0 for f in profile.links.values())
    cluster = load_cluster(cluster_file)
    stages = (Stage("cpu-fast", (0,), (0, 3), embedding=True), Stage("cpu-slow", (2,), (3, 6), head=True))
    plan = Plan(model=PRESETS["tiny"], cluster=cluster, global_batch=8, seq_len=64,
                pipelines=(Pipeline(2, 4, stages),)).validate()
    measured = plan_with_links(plan, profile)
    assert measured.cluster.cross_kind.bw_bytes_per_s == profile.links["cross_kind"].bw_bytes_per_s
    # predict --json's sources say what the cross-kind figures rest on: the file's (no citation in
    # local-cpu.toml, so assumed) until the profile's measurement through the bridge replaces them
    assert predict(plan).sources["cross_kind"]["source"].startswith("assumed")
    cross = predict(measured).sources["cross_kind"]
    assert cross["source"].startswith("measured")
    assert cross["bw_bytes_per_s"] == measured.cluster.cross_kind.bw_bytes_per_s
    # The transfer is costed over the measured link (capped by the NIC, so it need not differ from the
    # catalog's figure when loopback outruns the NIC).
    act_bytes = 2 * 64 * PRESETS["tiny"].hidden_size * 2  # micro-batch 2 x 64 tokens x hidden, bf16
    assert predict(measured).stages[0].p2p_s == pytest.approx(p2p_time_s(measured.cluster.link(0, 2), act_bytes))
    # An emulation host: its all-reduce among 2, 3 and 4 local ranks is measured too and drives the sync.
    assert sorted(profile.host_allreduce) == [2, 3, 4]
    assert all(len(f.samples) == 3 for f in profile.host_allreduce.values())
    replicas = Plan(model=PRESETS["tiny"], cluster=cluster, global_batch=8, seq_len=64,
                    pipelines=tuple(Pipeline(2, 2, (Stage("cpu-fast", (d,), (0, 6), embedding=True, head=True),))
                                    for d in (0, 1))).validate()
    on_host = plan_with_links(replicas, profile)
    (group,) = host_model(on_host.cluster).price_collectives(sync_groups(on_host))
    assert group.time_s == pytest.approx(profile.host_allreduce[2].link.time_s(group.nbytes))


def test_parse_bytes() -> None:
    assert parse_bytes("4096") == 4096 and parse_bytes("64KiB") == 65536 and parse_bytes("256 MiB") == 256 << 20
    with pytest.raises(argparse.ArgumentTypeError, match="expected a size"):
        parse_bytes("lots")
