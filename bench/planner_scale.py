"""Planner search time and efficiency from 32 to 4,096 devices (2-3 device kinds).

Usage: python bench/planner_scale.py [--sizes 32,128,512,4096]

Targets (docs/planner.md): <= 1 s at 512 devices, <= 10 s at 4,096, on a 2-core machine. On a shared
machine the wall time says little; the CPU seconds (cpu_s) and the load average printed beside them
say how busy it was. cpu_s counts this process and its children: from 256 devices the planner runs
the bound's searches and most template scans in a forked child (PlannerConfig.search_processes), whose
CPU is work done too.
"""

from __future__ import annotations

import argparse
import os
import time

from hethub.search import PlannerConfig, make_plan
from hethub.spec.cluster import Cluster, parse_cluster
from hethub.spec.model import get_model

# A 400 Gb/s NIC per device (rail-optimised training nodes: devices_per_nic = 1 below), a slower
# host-staged path between kinds.
NETWORK = {"inter_node_bw_bytes_per_s": 50e9, "inter_node_latency_s": 10e-6,
           "cross_kind_bw_bytes_per_s": 12.5e9, "cross_kind_latency_s": 40e-6}

# devices -> (node groups as (kind, nodes), model, global batch, seq_len); 8 devices per node.
SIZES: dict[int, tuple[list[tuple[str, int]], str, int, int]] = {
    32: ([("a100-80gb", 2), ("v100-16gb", 2)], "llama-2-7b", 256, 2048),
    128: ([("h100-sxm", 8), ("a100-80gb", 8)], "llama-2-13b", 512, 4096),
    512: ([("h100-sxm", 32), ("a100-80gb", 16), ("mi300x", 16)], "llama-2-70b", 1024, 4096),
    4096: ([("h100-sxm", 256), ("a100-80gb", 128), ("mi300x", 128)], "llama-2-70b", 2048, 4096),
}


def build(groups: list[tuple[str, int]], n: int) -> Cluster:
    return parse_cluster({"name": f"bench-{n}", "network": NETWORK,
                          "group": [{"kind": k, "nodes": nodes, "devices_per_node": 8, "devices_per_nic": 1}
                                    for k, nodes in groups]},
                         where="bench")


def _cpu_s() -> float:
    """CPU seconds of this process and of its children reaped so far (user + system)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default=",".join(map(str, SIZES)))
    args = ap.parse_args()
    print(f"{'devices':>8} {'kinds':>5} {'model':>12} {'search_s':>9} {'cpu_s':>7} {'load':>5} {'efficiency':>10} "
          f"{'tokens/s':>12} {'pipelines':>9} {'used':>5}")
    for n in (int(x) for x in args.sizes.split(",")):
        groups, model, gb, seq = SIZES[n]
        cluster = build(groups, n)
        assert cluster.num_devices == n
        t0, c0 = time.perf_counter(), _cpu_s()
        r = make_plan(cluster=cluster, model=get_model(model), config=PlannerConfig(global_batch=gb, seq_len=seq))
        wall, cpu = time.perf_counter() - t0, _cpu_s() - c0
        print(f"{n:>8} {len(groups):>5} {model:>12} {wall:>9.2f} {cpu:>7.2f} {os.getloadavg()[0]:>5.1f} "
              f"{r.efficiency:>10.3f} {r.prediction.tokens_per_s:>12,.0f} {len(r.plan.pipelines):>9} "
              f"{r.plan.world_size:>5}")
        for note in r.notes:
            print(f"{'':>8} note: {note}")


if __name__ == "__main__":
    main()
