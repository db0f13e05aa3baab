"""Pure rank-layout math: routing between TP degrees, schedules, parameter holders, groups."""

from __future__ import annotations

from dataclasses import replace

from hypothesis import given
from hypothesis import strategies as st

from hethub.layout import (
    block_starts,
    build_topology,
    bwd_source,
    bwd_targets,
    fwd_source,
    fwd_targets,
    unit_of,
)
from hethub.plan import Pipeline, Plan, Stage
from hethub.spec.cluster import Cluster, Link, NodeGroup
from hethub.spec.kind import DeviceKind
from hethub.spec.model import ModelSpec

SPEC = ModelSpec(name="t", num_layers=6, hidden_size=32, num_heads=4, num_kv_heads=2, ffn_hidden_size=64,
                 vocab_size=256, max_seq_len=32)


def _kind(name: str) -> DeviceKind:
    return DeviceKind(name=name, vendor="cpu", mem_bytes=2**33, peak_flops=1e11, intra_node_bw_bytes_per_s=1e10,
                      intra_node_latency_s=1e-6, backend="gloo")


CLUSTER = Cluster(name="t", kinds={"a": _kind("a"), "b": _kind("b")},
                  groups=(NodeGroup("a", 1, 4), NodeGroup("b", 1, 4)), inter_node=Link(1e9, 1e-5),
                  cross_kind=Link(1e9, 1e-5))


def plan(pipes: list[tuple[int, int, list[tuple[tuple[int, ...], int]]]], *, spec: ModelSpec = SPEC) -> Plan:
    """(mbs, m, [(devices, num_layers), ...]) per pipeline; kind taken from the devices."""
    out = []
    for mbs, m, stages in pipes:
        start, built = 0, []
        for i, (devs, n) in enumerate(stages):
            built.append(Stage(kind=CLUSTER.devices[devs[0]].kind, devices=devs, layers=(start, start + n),
                               embedding=i == 0, head=i == len(stages) - 1))
            start += n
        out.append(Pipeline(micro_batch_size=mbs, num_micro_batches=m, stages=tuple(built)))
    return Plan(model=spec, cluster=CLUSTER, global_batch=sum(p.num_samples for p in out), seq_len=16,
                pipelines=tuple(out), precision="fp32").validate()


@given(st.integers(1, 8), st.integers(1, 8))
def test_fwd_and_bwd_routing_are_consistent(a: int, b: int) -> None:
    # Every receiver has exactly one sender, and the sender lists it; same for gradients.
    for q in range(b):
        assert q in fwd_targets(a=a, b=b, j=fwd_source(a=a, q=q))
    assert sorted(q for j in range(a) for q in fwd_targets(a=a, b=b, j=j)) == list(range(b))
    for j in range(a):
        assert j in bwd_targets(a=a, b=b, q=bwd_source(b=b, j=j))
    assert sorted(j for q in range(b) for j in bwd_targets(a=a, b=b, q=q)) == list(range(a))


def test_routing_examples() -> None:
    assert fwd_targets(a=1, b=2, j=0) == (0, 1)
    assert fwd_targets(a=2, b=1, j=1) == ()
    assert bwd_targets(a=2, b=1, q=0) == (0, 1)
    assert bwd_source(b=2, j=1) == 1


def test_unit_of_parameter_names() -> None:
    assert unit_of("layers.3.attn.wq.weight") == "layer.3"
    assert unit_of("embed.weight") == "embed"
    assert unit_of("norm.weight") == "final_norm"
    assert unit_of("head.weight") == "head"
    assert unit_of("pos.weight") == "pos"


def test_places_and_peers_across_tp_degrees() -> None:
    # devices 0,1 (kind a, tp 2) -> device 4 (kind b, tp 1): ranks 0,1 -> 2
    t = build_topology(plan([(2, 4, [((0, 1), 3), ((4,), 3)])]))
    r0, r1, r2 = t.places
    assert (r0.tp_rank, r1.tp_rank, r2.tp_rank) == (0, 1, 0)
    assert r0.fwd_send_to == (2,) and r1.fwd_send_to == ()
    assert r2.fwd_recv_from == 0 and r2.bwd_send_to == (0, 1)
    assert r0.bwd_recv_from == 2 and r1.bwd_recv_from == 2
    assert t.log_rank == 2
    assert (0, 1) in t.groups  # the TP group


def test_holders_and_sync_groups_for_uneven_splits() -> None:
    # pipeline 0: ranks 0 | 1 with 4/2 layers; pipeline 1: ranks 2 | 3 with 2/4 layers
    t = build_topology(plan([(2, 3, [((0,), 4), ((1,), 2)]), (2, 1, [((4,), 2), ((5,), 4)])]))
    assert t.sync_group("layer.0", 0).ranks == (0, 2)
    assert t.sync_group("layer.3", 0).ranks == (0, 3)
    assert t.sync_group("layer.5", 1).ranks == (1, 3)
    assert t.sync_group("embed", 2).ranks == (0, 2)
    assert t.sync_group("head", 3).ranks == (1, 3)
    assert [p.sample_offset for p in t.places] == [0, 0, 6, 6]
    assert t.owns("layer.3", 0) and not t.owns("layer.3", 3)
    assert set(t.groups) == {(0, 2), (0, 3), (1, 3)}


def test_mixed_tp_holders_sync_over_all_their_ranks() -> None:
    t = build_topology(plan([(2, 2, [((0, 1), 6)]), (2, 2, [((4,), 6)])]))
    g = t.sync_group("layer.2", 0)
    assert g.mixed and g.ranks == (0, 1, 2)
    same = build_topology(plan([(2, 2, [((0, 1), 6)]), (2, 2, [((4, 5), 6)])]))
    assert [same.sync_group("layer.0", r).ranks for r in range(4)] == [(0, 2), (1, 3), (0, 2), (1, 3)]
    assert not same.sync_group("layer.0", 0).mixed


def test_tied_embedding_held_by_first_and_last_stage() -> None:
    t = build_topology(plan([(2, 2, [((0,), 3), ((1,), 3)])], spec=replace(SPEC, tied_embeddings=True)))
    assert "head" not in t.unit_holders
    assert t.sync_group("embed", 1).ranks == (0, 1)
    assert t.owns("embed", 0) and not t.owns("embed", 1)


def test_groups_are_identical_for_every_rank_and_deterministic() -> None:
    p = plan([(2, 2, [((0, 1), 3), ((4,), 3)]), (2, 2, [((2,), 2), ((5, 6), 4)])])
    assert build_topology(p).groups == build_topology(p).groups


def test_block_starts() -> None:
    assert block_starts([6, 2, 4]) == [0, 6, 8]
