"""Achievable bandwidth of each interconnect by message size: what collectives and sends really get.

A collective over a link of line rate B moves ``link_bytes`` through each link in ``steps`` latency-bound
steps (predict/comm.py: the ring's 2(p-1) or p-1, a send's one). It takes

    steps x latency + link_bytes / (B x efficiency(link_bytes)),
    efficiency(v) = eff_max x r / (1 + r),  r = (v / half_bytes) ^ shape,

so small transfers get a small share of the line rate (protocol, pipelining and launch costs grow
into the ramp) and large ones approach ``eff_max`` < 1 (protocol overhead: NCCL's maintainers put
NVLink's at ~20%), never the line rate. Each fabric's three numbers are fitted on cited public
measurements (predict/cited_comm.py; tests/unit/test_fabrics.py checks the fit reproduces them
within its stated tolerance) or, where none was found, assumed and said so (``Fabric.source``).

NVLink SHARP (``nvswitch-nvls``, H100/H200 nodes): an all-reduce among 5 or more ranks of one node
reduces inside the switch (NCCL's NVLS algorithm), moving the payload once each way per link at its
own curve; the faster of it and the ring is taken, as NCCL's tuner picks. Other collectives run the
ring. A link with no fabric ("": a measured link, a rate the catalog gives as achieved, a local
emulation host) is priced at its own numbers, as 'hethub bench comm' fitted them. Pure.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from hethub.predict.cited_comm import MLE_A100, MLE_EFA, MLE_H200_NVLS, MLE_MI300X, NCCL_412
from hethub.spec.cluster import Link

# NCCL selects NVLS for all-reduces of more than 4 ranks on an NVSwitch node (cited_comm.MLE_H200:
# ring at 4 GPUs, NVLS from 5).
NVLS_MIN_RANKS = 5


@dataclass(frozen=True)
class Fabric:
    name: str
    eff_max: float  # share of the line rate large transfers approach
    half_bytes: float  # bytes per link at which half of eff_max is reached
    shape: float  # steepness of the ramp
    source: str  # the fit's measurements, or "assumed: ..." with the reason

    def efficiency(self, link_bytes: float) -> float:
        """Share of the line rate a transfer of ``link_bytes`` per link achieves (in (0, eff_max))."""
        if link_bytes <= 0:
            return self.eff_max
        r = (link_bytes / self.half_bytes) ** self.shape
        return self.eff_max * r / (1.0 + r)

    @property
    def assumed(self) -> bool:
        return self.source.startswith("assumed")


_NVLINK_FIT = (0.9079, 3.17e6, 0.227)  # bench/fabrics.py --fit (2026-12-05) on predict/cited_comm.POINTS
_NVLS_FIT = (0.6158, 1.77e7, 0.763)
_EFA_FIT = (0.7810, 2.25e7, 0.791)
NVLINK = Fabric("nvlink", *_NVLINK_FIT, source=f"fitted: {MLE_A100} (1MiB-16GiB)")
FABRICS: dict[str, Fabric] = {f.name: f for f in (
    NVLINK,
    Fabric("nvswitch-nvls", *_NVLINK_FIT, source=f"ring: as nvlink ({MLE_A100}); NVLS: {MLE_H200_NVLS}"),
    Fabric("infinity-fabric", 0.822, *_NVLINK_FIT[1:],
           source=f"eff_max fitted: {MLE_MI300X}; ramp assumed: nvlink's (no size sweep found)"),
    Fabric("hccs", *_NVLINK_FIT, source="assumed: nvlink's curve (no public HCCL collective sweep found)"),
    Fabric("mtlink", *_NVLINK_FIT, source="assumed: nvlink's curve (no public MCCL collective sweep found)"),
    Fabric("metaxlink", *_NVLINK_FIT, source="assumed: nvlink's curve (no public MCCL collective sweep found)"),
    Fabric("pcie", 0.88, *_NVLINK_FIT[1:], source="assumed: 88% of the line rate, as nvbandwidth measures PCIe 5 "
           "host-device copies (stas00/ml-engineering network/README.md 'PCIe'), nvlink's ramp"),
    Fabric("efa", *_EFA_FIT, source=f"fitted: {MLE_EFA}"),
    Fabric("infiniband", 0.9678, *_EFA_FIT[1:], source=f"eff_max fitted: NCCL maintainers' per-NIC plateaus "
           f"({NCCL_412}; nccl-tests#29, #290); ramp assumed: efa's (no complete inter-node sweep found)"),
    Fabric("roce", 0.9678, *_EFA_FIT[1:], source="assumed: infiniband's curve (RDMA over Ethernet)"),
    Fabric("ethernet", 0.9678 * 0.8, *_EFA_FIT[1:], source="assumed: 80% of infiniband's plateau for NCCL's "
           "socket transport (TCP copies through host memory; no public sweep found), efa's ramp"),
)}
NVLS = Fabric("nvls", *_NVLS_FIT, source=f"fitted: {MLE_H200_NVLS} (2MiB-16GiB)")


def fabric_of(link: Link) -> Fabric | None:
    """The link's fabric curve; None where the link's numbers are already achieved rates."""
    if not link.fabric or link.fabric == "measured":
        return None
    return FABRICS[link.fabric]


@functools.lru_cache(maxsize=65536)
def transfer_time_s(link: Link, *, link_bytes: float, steps: int) -> float:
    """``link_bytes`` through ``link`` in ``steps`` latency-bound steps, at the fabric's achievable rate."""
    if link_bytes <= 0 or steps <= 0:
        return 0.0
    fabric = fabric_of(link)
    eff = 1.0 if fabric is None else fabric.efficiency(link_bytes)
    return steps * link.latency_s + link_bytes / (link.bw_bytes_per_s * eff)


def nvls_allreduce_time_s(link: Link, *, nbytes: float, participants: int, plateau: bool = False) -> float | None:
    """An all-reduce by NVLink SHARP where NCCL would run it (an ``nvswitch-nvls`` link, enough ranks),
    else None: the payload up to the switch and back once per link, two steps. ``plateau``: at the
    curve's large-message share (a floor for any size)."""
    if link.fabric != "nvswitch-nvls" or participants < NVLS_MIN_RANKS or nbytes <= 0:
        return None
    eff = NVLS.eff_max if plateau else NVLS.efficiency(nbytes)
    return 2 * link.latency_s + nbytes / (link.bw_bytes_per_s * eff)


def describe(fabric: str) -> dict[str, object]:
    """A fabric's curve and its source (``hethub predict --json``: sources.fabrics)."""
    f = FABRICS[fabric]
    out: dict[str, object] = {"eff_max": f.eff_max, "half_bytes": f.half_bytes, "shape": f.shape, "source": f.source}
    if fabric == "nvswitch-nvls":
        out["nvls"] = {"eff_max": NVLS.eff_max, "half_bytes": NVLS.half_bytes, "shape": NVLS.shape,
                       "source": NVLS.source, "min_ranks": NVLS_MIN_RANKS}
    return out
