"""The bridge's transport seam (comm/transport.py): a second transport, the key-value store's, carries
every cross-island byte of the bridge's point-to-point, all-reduces, sharded exchange and a training
run, with the same results as gloo; nothing in schedules, groups or the runtime changes."""

from __future__ import annotations

from typing import Any

import pytest
import test_bridge as tb
import torch
from _harness import OPTIM, batches, make_plan, reference, run_ranks

from hethub.comm.bridge import BridgedCommunicator
from hethub.comm.store_transport import StoreTransport
from hethub.comm.transport import GlooTransport
from hethub.comm.transport_choice import TRANSPORT_ENV, transport_name
from hethub.errors import RuntimeSetupError


@pytest.fixture
def store(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(TRANSPORT_ENV, "store")


def _moved_worker(rank: int) -> dict[str, Any]:
    comm = BridgedCommunicator(kind_of_rank=["a", "a", "b"], backend_of_kind={"a": "gloo", "b": "gloo"},
                               timeout=tb.TIMEOUT, force_bridge=True)
    x = torch.arange(1000, dtype=torch.float32) + rank
    if rank == 0:
        comm.isend(x, dst=2, tag=5).wait()
    elif rank == 2:
        got = torch.empty(1000)
        comm.recv(got, src=0, tag=5)
        assert torch.equal(got, torch.arange(1000, dtype=torch.float32))
    total = comm.all_reduce(x.clone())
    assert torch.equal(total, 3 * torch.arange(1000, dtype=torch.float32) + 3)
    comm.barrier()
    t = comm.transport
    return {"name": comm.describe()["transport"], "moved": t.moved_bytes if isinstance(t, StoreTransport) else None}


def test_store_transport_carries_the_bridge(store: None) -> None:
    res = run_ranks(3, _moved_worker)
    assert {r["name"] for r in res} == {"store"}
    # rank 0: its message to rank 2 and its half shard's all-reduce with rank 2; rank 1 the other
    # half (island a of two ranks: each carries half the buffer over the bridge); rank 2, alone in
    # its island, both halves.
    assert [r["moved"] for r in res] == [6000, 2000, 4000]


def test_p2p_through_the_store_transport(store: None) -> None:
    tb.test_p2p_across_kinds_all_shapes_and_dtypes()


def test_all_reduce_through_the_store_transport(store: None) -> None:
    checked = run_ranks(4, tb._allreduce_worker, ["a", "a", "b", "b"], [(0, 2), (0, 1, 3), (2, 3)], 1024, 1000)
    assert all(c > 0 for c in checked)


def test_reduce_scatter_and_all_gather_through_the_store_transport(store: None) -> None:
    tb.test_reduce_scatter_and_all_gather_across_islands_equal_plain_gloo(stage_host=False)


@pytest.mark.parametrize("stages", [
    [(2, 3, [("cpu-fast", 2, 2), ("cpu-slow", 1, 2), ("cpu-fast", 2, 2)])],  # unequal TP hops through the bridge
    [(2, 2, [("cpu-fast", 2, 6)]), (2, 2, [("cpu-slow", 1, 6)])],  # DP across kinds, island of 2 + 1
])
def test_training_parity_over_the_store_transport(store: None, stages: list) -> None:
    plan = make_plan(stages)
    data = batches(plan, steps=2)
    ref = reference(plan.model, data, optim=OPTIM)
    for r in run_ranks(plan.world_size, tb._train_worker, plan, data, ref):
        assert abs(r["loss"] - ref["loss"]) <= 1e-5
        assert r["grad_diff"] <= 1e-5 and r["param_diff"] <= 1e-5, r


def test_transport_choice_is_validated(monkeypatch: pytest.MonkeyPatch) -> None:
    assert transport_name() == "gloo" and GlooTransport.caps.device_types == frozenset({"cpu"})
    monkeypatch.setenv(TRANSPORT_ENV, "flagcx")
    with pytest.raises(RuntimeSetupError, match=f"{TRANSPORT_ENV}=gloo or store"):
        transport_name()
