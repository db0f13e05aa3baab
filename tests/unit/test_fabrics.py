"""Achievable-bandwidth curves (predict/fabrics.py) against the cited collective measurements.

Tolerances, stated: each fitted curve reproduces every point it was fitted on within 25% of the
measured time (NCCL switches protocol inside the A100 sweep, LL -> LL128 -> Simple, which a smooth
curve smooths over: its worst point is 8MiB at +21%) and their median within 6%; held-out points
(another NVLink generation, other collectives) within 5%.
"""

from __future__ import annotations

import itertools
import statistics

import pytest

from hethub.predict.cited_comm import POINTS, CommPoint, measured_time_s
from hethub.predict.comm import allreduce_floor_s, allreduce_time_s, p2p_time_s
from hethub.predict.fabrics import FABRICS, NVLS, Fabric, fabric_of
from hethub.spec.cluster import NETWORK_FABRICS, Link
from hethub.spec.kind import INTRA_NODE_FABRICS, catalog


def _priced_s(point: CommPoint) -> float:
    link = Link(point.line_bytes_per_s, point.latency_s, point.fabric)
    if point.collective == "nvls":
        return allreduce_time_s(nbytes=point.payload_bytes, participants=point.ranks, link=link)
    if point.collective == "all_reduce":
        return allreduce_time_s(nbytes=point.payload_bytes, participants=point.ranks, link=link)
    f = FABRICS[point.fabric]
    v = point.link_bytes
    return point.steps * point.latency_s + v / (point.line_bytes_per_s * f.efficiency(v))


def test_every_fabric_name_has_a_curve_with_a_source() -> None:
    for name in (*INTRA_NODE_FABRICS, *NETWORK_FABRICS):
        if name in ("", "measured"):
            assert fabric_of(Link(1e9, 1e-6, name)) is None
        else:
            assert FABRICS[name].source


@pytest.mark.parametrize("fabric", [*FABRICS.values(), NVLS], ids=lambda f: f.name)
def test_curves_rise_with_size_towards_but_below_the_line_rate(fabric: Fabric) -> None:
    sizes = [2.0**k for k in range(10, 41)]
    effs = [fabric.efficiency(v) for v in sizes]
    assert all(b > a for a, b in itertools.pairwise(effs))
    assert 0 < effs[0] < 0.2 * fabric.eff_max
    assert effs[-1] < fabric.eff_max < 1.0
    assert effs[-1] > 0.9 * fabric.eff_max


def test_fitted_curves_reproduce_their_cited_points() -> None:
    by_curve: dict[str, list[float]] = {}
    for p in POINTS:
        err = _priced_s(p) / measured_time_s(p) - 1
        if p.fitted:
            assert abs(err) < 0.25, (p, err)
            by_curve.setdefault("nvls" if p.collective == "nvls" else p.fabric, []).append(abs(err))
        else:
            assert abs(err) < 0.05, (p, err)
    for name, errs in by_curve.items():
        assert statistics.median(errs) < 0.06, name


def test_a_ring_across_nodes_is_priced_at_what_the_network_achieves_not_its_line_rate() -> None:
    """An 8-way data-parallel all-reduce, one rank per node over EFA, of a bucket whose bytes per NIC
    equal the cited 256MiB row's (50MB; the NIC moved them at 44% of its spec): hethub prices it within
    12% of that measured time, ~2x what the line rate gave (the old alpha-beta price); large buckets
    approach 1 / 0.78 of it."""
    link = Link(50e9, 10e-6, "efa")
    line = Link(50e9, 10e-6)  # no fabric: the line rate
    cited = next(p for p in POINTS if p.fabric == "efa" and p.payload_bytes == 256 * 2**20 / 8)
    per_rank = cited.link_bytes / (2 * 7 / 8)  # the same bytes through each NIC in an 8-rank ring
    priced = allreduce_time_s(nbytes=per_rank, participants=8, link=link)
    assert priced == pytest.approx(measured_time_s(cited), rel=0.12)
    assert 1.8 < priced / allreduce_time_s(nbytes=per_rank, participants=8, link=line) < 2.4
    big = 4e9
    assert (allreduce_time_s(nbytes=big, participants=8, link=link)
            / allreduce_time_s(nbytes=big, participants=8, link=line)) == pytest.approx(1 / 0.78, rel=0.06)


def test_nvls_is_taken_on_nvswitch_nodes_from_five_ranks_and_only_for_all_reduce() -> None:
    h200 = catalog()["h200"]
    link = Link(h200.intra_node_bw_bytes_per_s, h200.intra_node_latency_s, h200.intra_node_fabric)
    ring_only = Link(link.bw_bytes_per_s, link.latency_s, "nvlink")
    n = 8 * 2**30
    eight = allreduce_time_s(nbytes=n, participants=8, link=link)
    assert eight < allreduce_time_s(nbytes=n, participants=8, link=ring_only)
    # the cited gain at 8 GPUs and 8GiB: 473.1 / 365.6 = 1.29
    assert allreduce_time_s(nbytes=n, participants=8, link=ring_only) / eight == pytest.approx(1.29, rel=0.06)
    assert allreduce_time_s(nbytes=n, participants=4, link=link) == allreduce_time_s(
        nbytes=n, participants=4, link=ring_only)


def test_measured_links_keep_their_own_numbers() -> None:
    assert p2p_time_s(Link(1e9, 1e-3, "measured"), 1e6) == pytest.approx(1e-3 + 1e-3)
    assert p2p_time_s(Link(1e9, 1e-3, "infiniband"), 1e6) > 2e-3


def test_catalog_kinds_name_their_fabric() -> None:
    kinds = catalog()
    assert kinds["a100-40gb"].intra_node_fabric == "nvlink"
    assert kinds["h100-sxm"].intra_node_fabric == "nvswitch-nvls"
    assert kinds["mi300x"].intra_node_fabric == "infinity-fabric"
    assert kinds["rtx-3090"].intra_node_fabric == ""  # its number is NCCL's measured SHM rate
    assert kinds["cpu"].intra_node_fabric == ""


@pytest.mark.parametrize("fabric", ["nvlink", "nvswitch-nvls", "infiniband", "efa", "ethernet", ""])
def test_the_floor_is_below_every_fused_all_reduce(fabric: str) -> None:
    """``allreduce_floor_s`` (the planner's per-layer sync floors) stays under the all-reduce of the
    same bytes alone or fused with more, per byte past the latency, NVLink SHARP included."""
    link = Link(450e9, 5e-6, fabric)
    for p, n in itertools.product((2, 5, 8), (1e3, 1e6, 3e7, 1e9)):
        floor = allreduce_floor_s(nbytes=n, participants=p, link=link)
        assert 0 < floor <= allreduce_time_s(nbytes=n, participants=p, link=link)
        lat = 2 * (p - 1) * link.latency_s
        for k in (4, 64):
            fused = allreduce_time_s(nbytes=k * n, participants=p, link=link)
            assert floor - lat <= fused / k, (p, n, k)


def test_a_local_emulation_prices_its_links_at_their_own_numbers() -> None:
    from dataclasses import replace as copy
    from pathlib import Path

    from hethub.spec.cluster import load_cluster

    c = load_cluster(Path(__file__).resolve().parents[2] / "examples" / "clusters" / "local-cpu.toml")
    assert c.host is not None and c.inter_node.fabric == c.cross_kind.fabric == ""
    a, b = c.devices[0].id, c.devices[-1].id
    assert c.link(a, b).fabric == "" and copy(c, host=None).link(a, b) == c.link(a, b)
