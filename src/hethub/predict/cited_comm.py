"""Public collective measurements the fabric curves (predict/fabrics.py) are fitted on, each with its source.

A point is one published measurement: a collective of ``payload_bytes`` per rank among ``ranks``
ranks over links of ``line_bytes_per_s`` per direction, reported as bus bandwidth (nccl-tests'
``busbw``: the payload's ring traffic per link over the elapsed time), or for inter-node runs
already converted by the source to the rate each accelerator's NIC moved. From it follow the bytes
each link carried (``link_bytes``) and the elapsed time (``measured_time_s``); the fabric's curve is checked
against that time (tests/unit/test_fabrics.py) with the steps and latency hethub prices the same
collective with.
"""

from __future__ import annotations

from dataclasses import dataclass

MLE = "stas00/ml-engineering network/README.md at 744d01e (2026-08-22)"
MLE_A100 = f"{MLE}, 'Real network throughput': nccl-tests all_reduce_perf on one 8x A100 node"
MLE_H200 = (f"{MLE}, 'SHARP': nccl-tests on 8x H200 at 16GiB with NCCL_NVLS_ENABLE=0 (all-reduce) and the "
            "all-gather / reduce-scatter rows (ring)")
MLE_H200_NVLS = f"{MLE}, 'Real network throughput': all_reduce_bench.py on 8x H200 (NCCL picks NVLS from 2MiB)"
MLE_EFA = (f"{MLE}, 'So what should you expect?': 4 nodes x 8 B200, 8x 50GBps EFA v4 per node, all-reduce "
           "converted to the rate each accelerator's NIC moved (busbw x (k-1)/(n-1))")
MLE_MI300X = f"{MLE}, 'Peer-to-peer bandwidth': all_reduce_bench.py on 8x MI300X at 4GiB"
NCCL_412 = "NVIDIA/nccl#412 (sjeaugey, 2023-04-24): ~24GB/s inter-node busbw at 8G on a 200Gb HDR NIC"
NCCL_TESTS_29 = "NVIDIA/nccl-tests#29 (sjeaugey, 2019-12-06): 12.2 GB/s for a 100Gbps card 'is as good as you can get'"
NCCL_TESTS_290 = "NVIDIA/nccl-tests#290 (AddyLaddy, 2025-03-03): NDR 400Gbps 'you should see 46-48GB/s per NIC'"

GIB = 2**30
MIB = 2**20


@dataclass(frozen=True)
class CommPoint:
    fabric: str
    collective: str  # "all_reduce", "all_gather", "reduce_scatter" (ring), "nvls" (NVLink SHARP all-reduce)
    ranks: int
    payload_bytes: float
    busbw_bytes_per_s: float  # or the per-NIC rate the source converted to (inter-node)
    line_bytes_per_s: float
    latency_s: float  # per step, as hethub's catalog / cluster default prices that link
    source: str
    fitted: bool = True  # False: held out (checked, not fitted on)

    @property
    def steps(self) -> int:
        """Latency-bound steps of the algorithm hethub prices it with (ring: 2(p-1) or p-1; NVLS: 2)."""
        p = self.ranks
        return {"all_reduce": 2 * (p - 1), "nvls": 2}.get(self.collective, p - 1)

    @property
    def link_bytes(self) -> float:
        """Bytes each link carries: the ring's 2(p-1)/p (all-reduce) or (p-1)/p of the payload; NVLS
        sends the payload up to the switch once and receives the result once."""
        p, s = self.ranks, self.payload_bytes
        return {"all_reduce": 2 * (p - 1) / p * s, "nvls": s}.get(self.collective, (p - 1) / p * s)


def _a100(payload: float, busbw_gbps: float) -> CommPoint:
    return CommPoint("nvlink", "all_reduce", 8, payload, busbw_gbps * 1e9, 300e9, 5e-6, MLE_A100)


def _efa(payload_mib: float, pct_of_spec: float) -> CommPoint:
    # Hierarchical across k = 4 nodes of g = 8: each NIC carries 2(k-1)/k x payload/g, in 2(k-1) steps.
    p = payload_mib * MIB
    return CommPoint("efa", "all_reduce", 4, p / 8, pct_of_spec / 100 * 50e9, 50e9, 10e-6, MLE_EFA)


POINTS: tuple[CommPoint, ...] = (
    # NVLink 3 through NVSwitch (A100): the ring (no NVLS on A100), 1MiB and up (smaller payloads
    # are latency-bound: steps x latency).
    *(_a100(s, b) for s, b in ((1 * MIB, 18.00), (2 * MIB, 36.18), (4 * MIB, 72.33), (8 * MIB, 109.93),
                                (16 * MIB, 106.16), (32 * MIB, 138.49), (64 * MIB, 171.54), (128 * MIB, 176.92),
                                (256 * MIB, 194.07), (512 * MIB, 222.72), (GIB, 229.04), (2 * GIB, 231.41),
                                (4 * GIB, 233.88), (8 * GIB, 234.61), (16 * GIB, 234.89))),
    # NVLink 4 (H200), ring: held out, another generation at the largest payload.
    CommPoint("nvlink", "all_reduce", 8, 16 * GIB, 367.2e9, 450e9, 5e-6, MLE_H200, fitted=False),
    CommPoint("nvlink", "all_gather", 8, 16 * GIB, 361.4e9, 450e9, 5e-6, MLE_H200, fitted=False),
    CommPoint("nvlink", "reduce_scatter", 8, 16 * GIB, 362.9e9, 450e9, 5e-6, MLE_H200, fitted=False),
    # NVLink SHARP (NVLS) all-reduce on 8x H200, 2MiB and up: busbw converted back to the elapsed time,
    # then to NVLS's own traffic (the payload once each way per link).
    *(CommPoint("nvswitch-nvls", "nvls", 8, s, b * 1e9, 450e9, 5e-6, MLE_H200_NVLS)
      for s, b in ((2 * MIB, 64.53), (4 * MIB, 107.16), (8 * MIB, 155.53), (16 * MIB, 219.89), (32 * MIB, 275.84),
                   (64 * MIB, 346.51), (128 * MIB, 401.93), (256 * MIB, 436.15), (512 * MIB, 450.29),
                   (GIB, 463.58), (2 * GIB, 469.17), (4 * GIB, 473.10), (8 * GIB, 477.45), (16 * GIB, 482.26))),
    # AWS EFA v4 (400Gbps per accelerator), per-NIC rate by payload.
    *(_efa(s, pct) for s, pct in ((16, 12.5), (32, 17.6), (64, 30.3), (128, 38.3), (256, 44.3), (512, 63.3),
                                  (1024, 70.1), (2048, 72.1), (4096, 73.0), (8192, 73.6), (16384, 73.9))),
    # InfiniBand: the plateau NCCL's maintainers state for one NIC (all-reduce, 8GB payloads).
    CommPoint("infiniband", "all_reduce", 2, 8e9, 24e9, 25e9, 10e-6, NCCL_412),
    CommPoint("infiniband", "all_reduce", 2, 8e9, 12.2e9, 12.5e9, 10e-6, NCCL_TESTS_29),
    CommPoint("infiniband", "all_reduce", 2, 8e9, 47e9, 50e9, 10e-6, NCCL_TESTS_290),
    # AMD Infinity Fabric (xGMI), 8x MI300X, 4GiB (line: 7 links x 64 GB/s, the catalog's number).
    CommPoint("infinity-fabric", "all_reduce", 8, 4 * GIB, 312.912e9, 448e9, 8e-6, MLE_MI300X),
)

# the 8x H200 NVLS all-reduce's NVLS values convert from the source's busbw (ring formula) to time:
# time = payload x 2(p-1)/p / busbw; NVLS's per-link traffic is the payload, so its rate is
# busbw x p / (2(p-1)).
NVLS_BUSBW_TO_LINK = 8 / 14


def link_rate_bytes_per_s(point: CommPoint) -> float:
    """The bytes per second each link moved at that point."""
    if point.collective == "nvls":
        return point.busbw_bytes_per_s * NVLS_BUSBW_TO_LINK
    return point.busbw_bytes_per_s


def measured_time_s(point: CommPoint) -> float:
    """The elapsed time of the measured collective."""
    return point.link_bytes / link_rate_bytes_per_s(point)
