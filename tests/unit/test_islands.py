"""The two-level reduce-scatter / all-gather across vendor islands (hethub.islands): its schedule and
what the predictor's sync model charges for it (the bridge runs it: tests/dist/test_bridge.py)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from hethub.islands import exchange, island_of_kind
from hethub.plan import Pipeline, Plan, Stage
from hethub.predict.comm import allreduce_time_s, p2p_time_s, ring_pass_time_s
from hethub.predict.sync import sync_groups
from hethub.predict.sync_rules import holder_exchange
from hethub.spec.cluster import load_cluster
from hethub.spec.model import get_model

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "clusters"


def test_every_island_proxies_every_foreign_owner_once() -> None:
    labels = dict(enumerate("abacac"))
    ex = exchange(range(6), labels)
    assert ex.islands == ((0, 2, 4), (1,), (3, 5))
    for i, isl in enumerate(ex.islands):
        covered = [o for m in isl for o in ex.blocks[m]]
        assert sorted(covered) == list(range(6))  # each owner's chunk has one collector per island
        for m in isl:
            assert ex.blocks[m][0] == m and ex.proxy(m, i) == m
            assert ex.slots[m] == max(len(ex.blocks[x]) for x in isl)
    assert ex.blocks[1] == (1, 0, 2, 3, 4, 5)  # alone in its island: proxies everyone
    assert (ex.blocks[0], ex.blocks[2], ex.blocks[4], ex.blocks[3]) == ((0, 1), (2, 3), (4, 5), (3, 0, 2))
    assert ex.sends(1) == 5 and ex.receives(1) == 2
    assert island_of_kind("v100", backend="nccl", vendor="nvidia", force_bridge=False) == \
        island_of_kind("a100", backend="nccl", vendor="nvidia", force_bridge=False)
    assert island_of_kind("mi250x", backend="nccl", vendor="amd", force_bridge=False) != "nccl:nvidia"


def test_pass_time_critical_path() -> None:
    ex = exchange(range(4), dict(enumerate("aaab")))
    # Island a (3 members, 2 slots: one of them proxies b's chunk) takes 1.0 s natively; b is alone.
    msg = {m: 0.1 for m in range(4)}
    # a's proxy of chunk 3 sends after its island step (1.1); b sends its 3 proxied chunks at once (0.3).
    assert ex.pass_time_s(island_s=[1.0, 0.0], message_s=msg) == pytest.approx(1.1)
    assert ex.pass_time_s(island_s=[0.0, 0.0], message_s=msg) == pytest.approx(0.3)
    assert exchange(range(3), dict.fromkeys(range(3), "a")).pass_time_s(island_s=[0.7], message_s=msg) == 0.7


@pytest.fixture(scope="module")
def bridged_plan() -> Plan:
    # 4 A100 replicas and 2 MI250X replicas (NCCL and RCCL: two islands), 2 stages each.
    cluster = load_cluster(EXAMPLES / "nvidia-amd-32.toml")
    a100 = [d for d in range(cluster.num_devices) if cluster.devices[d].kind == "a100-80gb"]
    amd = [d for d in range(cluster.num_devices) if cluster.devices[d].kind == "mi250x"]

    def pipe(kind: str, devs: list[int]) -> Pipeline:
        return Pipeline(micro_batch_size=1, num_micro_batches=4, stages=(
            Stage(kind=kind, devices=(devs[0],), layers=(0, 16), embedding=True),
            Stage(kind=kind, devices=(devs[1],), layers=(16, 32), head=True)))

    pipes = [pipe("a100-80gb", [a100[i], a100[8 + i]]) for i in range(4)]
    pipes += [pipe("mi250x", [amd[i], amd[8 + i]]) for i in range(2)]
    return Plan(model=get_model("llama-3-8b"), cluster=cluster, global_batch=24, seq_len=2048,
                pipelines=tuple(pipes)).validate()


def test_bridged_sharded_sync_is_priced_as_the_two_level_exchange(bridged_plan: Plan) -> None:
    zero = replace(bridged_plan, optimizer_sharding="zero1", optimizer_shares="equal")
    weights = dict.fromkeys(range(zero.world_size), 1.0)
    plain, sharded = sync_groups(bridged_plan), sync_groups(zero, shard_weights=weights)
    assert len(plain) == len(sharded) > 0
    for g0, g1 in zip(plain, sharded, strict=True):
        ex = holder_exchange(zero, g1.holders)
        assert [len(i) for i in ex.islands] == [4, 2]
        # bf16-mixed: fp32 gradients (4 bytes) reduce-scattered, bf16 parameters (2) gathered back.
        p, elems = g0.participants, g0.nbytes / 4
        grad_chunk, param_chunk = elems / p * 4, elems / p * 2
        cross = zero.cluster.link(zero.pipelines[0].stages[0].devices[0], zero.pipelines[4].stages[0].devices[0])
        # Slowest member: an MI250X proxy (2 members for 4 foreign chunks: 3 slots) sends 2 chunks
        # after its island's ring pass of 3 chunks, in each pass (gradients, then parameters).
        # (each message at the bridge link's achievable rate for its size: predict/fabrics.py)
        amd_link = zero.cluster.link(zero.pipelines[4].stages[0].devices[0], zero.pipelines[5].stages[0].devices[0])
        want = sum(ring_pass_time_s(chunk_bytes=3 * c, participants=2, link=amd_link) + 2 * p2p_time_s(cross, c)
                   for c in (grad_chunk, param_chunk))
        assert g1.time_s == pytest.approx(want, rel=1e-3)
        # The bridge's all-reduce then all-gather (what it ran before the exchange) cost more.
        old = g0.time_s + ring_pass_time_s(chunk_bytes=param_chunk, participants=p, link=g0.link)
        assert g1.time_s < old
        assert g1.time_s < allreduce_time_s(nbytes=g0.nbytes, participants=p, link=g0.link)
