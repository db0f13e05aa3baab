"""Planner time and plan quality on `hethub plan`'s default path, 32 to 4,096 devices and HETHUB-768.

Usage: python bench/planner_scale.py [--sizes 32,128,512,4096,768]

Each case runs exactly what `hethub plan --cluster C --model M --global-batch B --seq-len S` runs
(the command's own parser and config: schedule auto, optimizer sharding auto); "768" is the
README's HETHUB-768 command (examples/clusters/hethub-768.toml, llama-140b, 1536 x 4096). Targets
(docs/planner.md) on a 2-core machine: 512 devices <= 3 s, 4,096 <= 10 s, HETHUB-768 <= 4 s. On a
shared machine the wall time says little: cpu_s (this process and its children: the planner's
forked workers, hethub.fanout, so above the wall time when they overlap) and the load average beside
it say how busy it was; HETHUB_PLAN_WORKERS=1 times the serial search. crit_s estimates an idle
machine's wall time: the search's serial CPU s plus, per fan-out, its busiest worker's (fanout.timed);
"crit parts" splits it: the serial rest, then each fan-out's busiest worker in the order they ran
(the enumeration; the variants beside the bound's parts; the polish beside the interleaving; the
interleaving of starts the polish changed, where there are some).
Each plan's tokens/s is printed beside main's at the commit named in REFERENCE, with their ratio: the
plans must not get worse. The last line times a fixed Python loop before and after the table: this VM's
speed then, which the host moves 2x within minutes while the load average stays the same (CPU seconds
inflate with it too, so only that line tells a slowed machine from a slower planner).
"""

from __future__ import annotations

import argparse
import os
import time

from hethub import fanout
from hethub.cli import build_parser, plan_config
from hethub.search import make_plan
from hethub.spec.cluster import Cluster, load_cluster, parse_cluster
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
HETHUB_768 = ("examples/clusters/hethub-768.toml", "llama-140b", 1536, 4096)
# The default path's plans, tokens/s, on main 64a7f09 (2026-12-05, this script's cases through
# `hethub plan`'s defaults; 4,096 devices on 8ca1f55, whose other plans equal 64a7f09's).
REFERENCE = {32: 114_092, 128: 588_249, 512: 480_202, 768: 77_297, 4096: 3_235_598}


def build(groups: list[tuple[str, int]], n: int) -> Cluster:
    return parse_cluster({"name": f"bench-{n}", "network": NETWORK,
                          "group": [{"kind": k, "nodes": nodes, "devices_per_node": 8, "devices_per_nic": 1}
                                    for k, nodes in groups]},
                         where="bench")


def _cpu_s() -> float:
    """CPU seconds of this process and of its children reaped so far (user + system)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def case(n: int) -> tuple[Cluster, str, int, int]:
    if n == 768:
        path, model, gb, seq = HETHUB_768
        return load_cluster(path), model, gb, seq
    groups, model, gb, seq = SIZES[n]
    cluster = build(groups, n)
    assert cluster.num_devices == n
    return cluster, model, gb, seq


def loop_s(steps: int = 5_000_000) -> float:
    """CPU seconds of a fixed pure-Python loop: this VM's speed when the table was made, printed beside it
    (the host's load moves it 2x within minutes while the guest's load average stays the same)."""
    t, acc = time.process_time(), 0
    for i in range(steps):
        acc += i * i % 7
    return time.process_time() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="32,128,512,4096,768")
    args = ap.parse_args()
    before = loop_s()
    print(f"{'devices':>8} {'model':>12} {'search_s':>9} {'cpu_s':>7} {'crit_s':>6} {'load':>5} {'efficiency':>10} "
          f"{'vs alone':>8} {'tokens/s':>12} {'main':>12} {'ratio':>7} {'pipelines':>9} {'used':>5}  schedule, "
          "sharding; crit parts")
    for n in (int(x) for x in args.sizes.split(",")):
        cluster, model, gb, seq = case(n)
        cli = build_parser().parse_args(["plan", "--cluster", cluster.name, "--model", model,
                                         "--global-batch", str(gb), "--seq-len", str(seq)])
        t0, c0, own0 = time.perf_counter(), _cpu_s(), time.process_time()
        with fanout.timed() as spans:
            r = make_plan(cluster=cluster, model=get_model(model), config=plan_config(cli))
        wall, cpu = time.perf_counter() - t0, _cpu_s() - c0
        # The serial rest plus each fan-out's busiest worker: an idle machine's wall time, estimated.
        crit = time.process_time() - own0 + sum(max(own, *kids) - own for own, kids in spans)
        busiest = [max(own, *kids) for own, kids in spans]
        parts = " + ".join(f"{x:.1f}" for x in [crit - sum(busiest), *busiest])
        tps, ref = r.prediction.tokens_per_s, REFERENCE.get(n)
        print(f"{n:>8} {model:>12} {wall:>9.2f} {cpu:>7.2f} {crit:>6.2f} {os.getloadavg()[0]:>5.1f} "
              f"{r.efficiency:>10.3f} {r.vs_kinds_alone or 0:>8.3f} "
              f"{tps:>12,.0f} {ref or 0:>12,} {tps / ref if ref else float('nan'):>7.4f} {len(r.plan.pipelines):>9} "
              f"{r.plan.world_size:>5}  {r.plan.schedule}, {r.plan.optimizer_sharding}; {parts}")
    print(f"this VM's speed: a 5*10^6-step Python loop took {before:.3f} s of CPU before the table, {loop_s():.3f} s "
          "after (docs/planner.md, Measured, gives the figures beside it)")


if __name__ == "__main__":
    main()
