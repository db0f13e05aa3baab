"""Links profiles: the alpha-beta fit, the file format, and the predictor reading measured links."""

import json
import math
from dataclasses import replace

import pytest

from conftest import EXAMPLES, small_cluster, tiny_model, two_stage_plan
from hethub.errors import SpecError
from hethub.plan import Pipeline, Plan, Stage
from hethub.predict.links import (
    CROSS_KIND,
    LinkFit,
    LinksProfile,
    apply_links_profile,
    fit_alpha_beta,
    links_profile_from_dict,
    plan_with_links,
    read_links_profile,
    write_links_profile,
)
from hethub.predict.predictor import predict
from hethub.spec.cluster import Cluster, EmulationHost, Link, load_cluster

SIZES = [4 * 1024 * 4**i for i in range(9)]  # 4 KiB .. 256 MiB


def _samples(alpha: float, bw: float) -> tuple[tuple[int, float], ...]:
    return tuple((n, alpha + n / bw) for n in SIZES)


def _profile(**links: tuple[float, float]) -> LinksProfile:
    return LinksProfile(cluster="small", links={k.replace("__", ":"): LinkFit(a, bw, _samples(a, bw))
                                                 for k, (a, bw) in links.items()})


def test_fit_recovers_alpha_and_beta() -> None:
    alpha, bw = fit_alpha_beta(_samples(50e-6, 2e9))
    assert alpha == pytest.approx(50e-6, rel=1e-6) and bw == pytest.approx(2e9, rel=1e-6)
    # Noise of +-10% on each sample still gives the right order of magnitude for both.
    noisy = [(n, t * (1.1 if i % 2 else 0.9)) for i, (n, t) in enumerate(_samples(50e-6, 2e9))]
    alpha, bw = fit_alpha_beta(noisy)
    assert 30e-6 < alpha < 80e-6 and 1.5e9 < bw < 2.6e9


def test_fit_never_returns_negative_latency() -> None:
    # These samples give a negative intercept: the fit must fall back to a line through the origin,
    # whose bandwidth lies within the samples' own rates (1.0e9 .. 4.1e9 B/s).
    alpha, bw = fit_alpha_beta([(4096, 1e-6), (1 << 20, 1e-3), (1 << 24, 9e-3)])
    assert alpha == 0.0 and 1.0e9 < bw < 4.1e9


def test_profile_round_trip_and_errors(tmp_path) -> None:
    prof = _profile(intra_node__fast=(5e-6, 50e9), cross_kind=(80e-6, 1e9))
    path = tmp_path / "links.json"
    write_links_profile(prof, path)
    assert read_links_profile(path) == prof
    data = json.loads(path.read_text())
    assert data["format"] == "hethub-links" and data["version"] == 1
    with pytest.raises(SpecError, match="version"):
        links_profile_from_dict({**data, "version": 9})
    with pytest.raises(SpecError, match="link class 'sideways'"):
        links_profile_from_dict({**data, "links": {"sideways": data["links"][CROSS_KIND]}})
    with pytest.raises(SpecError, match="does not exist"):
        read_links_profile(tmp_path / "missing.json")


def test_host_allreduce_round_trips_and_applies_to_emulation_hosts_only(tmp_path) -> None:
    prof = replace(_profile(cross_kind=(80e-6, 1e9)),
                   host_allreduce={2: LinkFit(5e-4, 4e8, _samples(5e-4, 4e8)), 4: LinkFit(6e-3, 3e8)})
    path = tmp_path / "links.json"
    write_links_profile(prof, path)
    assert read_links_profile(path) == prof
    data = json.loads(path.read_text())
    with pytest.raises(SpecError, match="participant count"):
        links_profile_from_dict({**data, "host_allreduce": {"1": data["host_allreduce"]["2"]}})
    with pytest.raises(SpecError, match=r"host_allreduce\.2 has"):
        links_profile_from_dict({**data, "host_allreduce": {"2": {"latency_s": -1, "bw_bytes_per_s": 1e9}}})
    c = small_cluster()
    assert apply_links_profile(c, prof).host is None  # a real cluster: measured on another host
    host = apply_links_profile(replace(c, host=EmulationHost(cores="auto")), prof)
    assert dict(host.host.allreduce) == {2: Link(4e8, 5e-4), 4: Link(3e8, 6e-3)}
    # Plans embed the cluster: the measurement survives a save and load, and "auto" stays "auto"
    # (hethub.emulation reads the cores when it predicts, not the file's loader).
    again = Cluster.from_dict(json.loads(json.dumps(host.to_dict())))
    assert again.host == host.host and again.host.cores == "auto"
    with pytest.raises(SpecError, match="participants"):
        Cluster.from_dict({**host.to_dict(), "host_allreduce": [{"participants": 1, "latency_s": 0.0,
                                                                  "bw_bytes_per_s": 1e9}]})
    no_cores = {k: v for k, v in host.to_dict().items() if k != "host_cores"}
    with pytest.raises(SpecError, match=r"'host_allreduce'.*host_cores"):
        Cluster.from_dict(no_cores)


def test_apply_replaces_each_link_class() -> None:
    c = small_cluster()
    out = apply_links_profile(c, _profile(intra_node__fast=(7e-6, 30e9), inter_node__slow=(40e-6, 3e9),
                                          cross_kind=(90e-6, 0.5e9)))
    assert out.kinds["fast"].intra_node_bw_bytes_per_s == 30e9 and out.kinds["fast"].intra_node_latency_s == 7e-6
    assert out.kinds["slow"] == c.kinds["slow"]
    assert [g.inter_node_bw_bytes_per_s for g in out.groups] == [None, 3e9]
    assert out.inter_node.latency_s == 40e-6 and out.cross_kind.bw_bytes_per_s == 0.5e9
    assert out.devices == c.devices
    with pytest.raises(SpecError, match="kind 'tpu'"):
        apply_links_profile(c, _profile(intra_node__tpu=(1e-6, 1e9)))


def test_predicted_transfer_time_follows_the_profile() -> None:
    plan = two_stage_plan()  # stage 0 on a 'fast' device, stage 1 on a 'slow' one in another node
    nbytes = 2 * plan.seq_len * plan.model.hidden_size * 2  # micro-batch 2, bf16 activations
    base = predict(plan).stages[0].p2p_s
    slow = predict(plan_with_links(plan, _profile(cross_kind=(1e-3, 1e8)))).stages[0].p2p_s
    fast = predict(plan_with_links(plan, _profile(cross_kind=(1e-6, 4e9)))).stages[0].p2p_s
    assert slow == pytest.approx(1e-3 + nbytes / 1e8)
    assert slow > base and fast != slow
    assert predict(plan_with_links(plan, _profile(cross_kind=(1e-3, 1e8)))).step_time_s > predict(plan).step_time_s


def test_intra_node_profile_changes_same_node_transfers() -> None:
    c = small_cluster()
    model = tiny_model()
    stages = (Stage("fast", (0,), (0, 3), embedding=True), Stage("fast", (1,), (3, 6), head=True))  # one node
    plan = Plan(model=model, cluster=c, global_batch=8, seq_len=32, pipelines=(Pipeline(2, 4, stages),)).validate()
    a = predict(plan_with_links(plan, _profile(intra_node__fast=(1e-5, 1e9)))).stages[0].p2p_s
    b = predict(plan_with_links(plan, _profile(intra_node__fast=(1e-5, 1e10)))).stages[0].p2p_s
    assert a > b > 0 and not math.isclose(a, b)


def test_a_nodes_ranks_share_its_nic_for_the_inter_stage_send() -> None:

    from hethub.predict.comm import p2p_time_s, stage_hop_time_s

    cluster = load_cluster(EXAMPLES / "a100-v100-32.toml")  # 4 devices per node, 4 nodes per kind
    nic = cluster.inter_node
    nbytes = 64e6
    one = stage_hop_time_s(cluster, senders=[0], receivers=[4], nbytes=nbytes)
    assert one == pytest.approx(p2p_time_s(nic, nbytes))  # the fabric's achievable rate at that size
    # TP-4 to TP-4 across nodes: four whole copies leave node 0 through its one NIC at once.
    four = stage_hop_time_s(cluster, senders=[0, 1, 2, 3], receivers=[4, 5, 6, 7], nbytes=nbytes)
    assert four == pytest.approx(p2p_time_s(nic, 4 * nbytes))  # as one message of the four's bytes
    # TP-2 to TP-4: two senders, but four messages (receiver q reads from sender q mod 2) enter node 1.
    mixed = stage_hop_time_s(cluster, senders=[0, 1], receivers=[4, 5, 6, 7], nbytes=nbytes)
    assert mixed == pytest.approx(four)
    # Within a node nothing crosses a NIC.
    same = stage_hop_time_s(cluster, senders=[0, 1], receivers=[2, 3], nbytes=nbytes)
    assert same < one


def test_a_tp_split_send_carries_one_copy_through_the_nic_and_gathers_inside_the_node() -> None:

    from hethub.predict.comm import p2p_time_s, ring_pass_time_s, stage_hop_time_s

    cluster = load_cluster(EXAMPLES / "a100-v100-32.toml")
    nbytes = 64e6
    whole = stage_hop_time_s(cluster, senders=[0, 1, 2, 3], receivers=[4, 5, 6, 7], nbytes=nbytes)
    split = stage_hop_time_s(cluster, senders=[0, 1, 2, 3], receivers=[4, 5, 6, 7], nbytes=nbytes, split=True)
    nic, intra = cluster.inter_node, cluster.link(4, 5)
    gather = ring_pass_time_s(chunk_bytes=nbytes / 4, participants=4, link=intra)  # ring all-gather over 4 ranks
    # Four quarter-size messages share node 0's NIC (as one message of their summed bytes), then the all-gather.
    quarter = p2p_time_s(nic, nbytes)  # four quarters through one NIC at once: one copy's bytes
    assert split == pytest.approx(quarter + gather)
    assert split < whole
