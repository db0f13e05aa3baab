"""The ranks behind one NIC share it: in pipeline hops and in the data-parallel gradient sync.

A node's ``devices_per_nic`` (cluster file, per [[group]]) says how many of its devices reach other
nodes through one NIC: left out, one NIC serves the whole node (a workstation cluster on Ethernet);
1 gives every device its own (a rail-optimised training node). The predictor (predict/comm.py) and
the planner's representative links (predict/stage_links.py) price the same rule.
"""

from __future__ import annotations

import pytest

from hethub.errors import SpecError
from hethub.plan import Pipeline, Plan, Stage
from hethub.predict.comm import allreduce_time_s, p2p_time_s, rings_link, stage_hop_time_s
from hethub.predict.stage_links import LinkBook
from hethub.predict.sync import sync_groups
from hethub.spec.cluster import Link, parse_cluster
from hethub.spec.model import get_model

NETWORK = {"inter_node_bw_bytes_per_s": 10e9, "inter_node_latency_s": 10e-6}


def _cluster(devices_per_nic: int | None, *, nodes: int = 2, per_node: int = 8):
    group = {"kind": "a100-80gb", "nodes": nodes, "devices_per_node": per_node}
    if devices_per_nic is not None:
        group["devices_per_nic"] = devices_per_nic
    return parse_cluster({"name": "nic", "network": NETWORK, "group": [group]}, where="test")


def _two_replicas(cluster, *, tp: int) -> Plan:
    """Two whole-model replicas of `tp` ranks each, one per node, so the gradient sync crosses nodes."""
    model = get_model("llama-2-7b")
    per_node = cluster.groups[0].devices_per_node
    pipes = tuple(Pipeline(micro_batch_size=1, num_micro_batches=4, stages=(
        Stage(kind="a100-80gb", devices=tuple(range(n * per_node, n * per_node + tp)), layers=(0, model.num_layers),
              embedding=True, head=True),)) for n in range(2))
    return Plan(model=model, cluster=cluster, global_batch=8, seq_len=1024, pipelines=pipes)


def test_devices_per_nic_must_divide_the_node():
    with pytest.raises(SpecError, match=r"devices_per_nic.*does not divide devices_per_node"):
        _cluster(3)
    with pytest.raises(SpecError, match="devices_per_nic"):
        _cluster(0)
    assert [d.nic for d in _cluster(2, nodes=1, per_node=4).devices] == [0, 0, 1, 1]
    assert len({d.nic for d in _cluster(None).devices}) == 2  # one NIC per node


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_gradient_sync_of_tp_ranks_shares_one_nic_per_node(tp):
    # One NIC per node: the tp rings (one per TP rank, each 1/tp of the gradients) cross it at once,
    # so the sync moves the whole gradient through it. A NIC per device: each ring has its own.
    shared = sync_groups(_two_replicas(_cluster(None), tp=tp))
    own = sync_groups(_two_replicas(_cluster(1), tp=tp))
    assert len(shared) == len(own) == 1  # plain replicas: one fused all-reduce
    assert shared[0].link.bw_bytes_per_s == pytest.approx(NETWORK["inter_node_bw_bytes_per_s"] / tp)
    assert own[0].link.bw_bytes_per_s == pytest.approx(NETWORK["inter_node_bw_bytes_per_s"])
    nbytes = shared[0].nbytes
    assert shared[0].time_s == pytest.approx(allreduce_time_s(nbytes=nbytes, participants=2, link=shared[0].link))
    latency_s = 2 * NETWORK["inter_node_latency_s"]
    assert (shared[0].time_s - latency_s) == pytest.approx(tp * (own[0].time_s - latency_s))


def test_rings_inside_a_node_share_nothing():
    c = _cluster(None)
    assert rings_link(c, [[0, 1], [2, 3]]) == c.link(0, 1)
    assert rings_link(c, [[0]]).bw_bytes_per_s == float("inf")


def test_pipeline_hop_shares_the_senders_nic():
    nbytes = 64e6
    bw = NETWORK["inter_node_bw_bytes_per_s"]
    # TP 4 -> TP 4 across nodes, each receiver taking the whole tensor from its sender (no split).
    for per_nic, share in ((None, 4), (2, 2), (1, 1)):
        c = _cluster(per_nic)
        t = stage_hop_time_s(c, senders=[0, 1, 2, 3], receivers=[8, 9, 10, 11], nbytes=nbytes)
        # share messages through one NIC end as one message of their summed bytes (predict/fabrics.py rate)
        assert t == pytest.approx(p2p_time_s(Link(bw, NETWORK["inter_node_latency_s"], "infiniband"), share * nbytes))


@pytest.mark.parametrize("per_nic", [None, 2, 1])
def test_planner_ring_link_is_the_predictors(per_nic):
    c = _cluster(per_nic)
    for tp in (1, 2, 4, 8):
        predicted = sync_groups(_two_replicas(c, tp=tp))[0].link
        planned = LinkBook(c).replicas(frozenset(["a100-80gb"]), devices=2 * tp + 8, rings=tp)
        assert planned.bw_bytes_per_s == pytest.approx(predicted.bw_bytes_per_s), tp


@pytest.mark.parametrize(("per_nic", "nics"), [(None, 1), (4, 2), (1, 8)])
def test_a_ring_through_several_ranks_of_a_node_crosses_on_all_their_nics(per_nic, nics):
    # Sixteen single-device replicas on two nodes: one ring through all, two node crossings. NCCL runs
    # it as several channels, each through another NIC of the ranks it passes, so the crossing gets
    # every NIC of the node (at least one NIC's rate: a point-to-point hop keeps its own NIC).
    c = _cluster(per_nic)
    ring = rings_link(c, [list(range(16))])
    assert ring.bw_bytes_per_s == pytest.approx(min(nics * NETWORK["inter_node_bw_bytes_per_s"],
                                                    c.kinds["a100-80gb"].intra_node_bw_bytes_per_s))
    # Ranks of the ring that sit on one NIC give it no more: two ranks per node behind one NIC.
    two = rings_link(c, [[0, 1, 8, 9]])
    assert two.bw_bytes_per_s == pytest.approx(NETWORK["inter_node_bw_bytes_per_s"] * (2 if per_nic == 1 else 1))
    assert stage_hop_time_s(c, senders=[0], receivers=[8], nbytes=1e6) == pytest.approx(
        p2p_time_s(c.link(0, 8), 1e6))
