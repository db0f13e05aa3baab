"""Plan one model on every vendor pairing of the HETHUB setting and print the results side by side.

Usage: python bench/vendor_pairs.py [--model llama-3-8b] [--global-batch 512] [--seq-len 2048]

Rows: NVIDIA (16 A100-80GB) beside 16 devices of each other brand (examples/clusters/nvidia-*-32.toml)
and the HETHUB paper's AMD + accelerator-A setting (hethub-768.toml; its global batch is scaled by its
device count so every device can get a sample). For each: the planner's predicted tokens/s, its
efficiency against the per-kind upper bound, the best single-kind plan's tokens/s and the ratio, and
how the work splits between the kinds (share of layer x sample work, devices used). All figures are
PREDICTIONS from the catalog's numbers (many of them assumed for the newer vendors; see the catalog).
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace
from pathlib import Path

from hethub.errors import HethubError
from hethub.plan import Plan
from hethub.search import PlannerConfig, make_plan
from hethub.spec.cluster import load_cluster
from hethub.spec.model import get_model

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "clusters"
PAIRS = ("nvidia-amd-32", "nvidia-ascend-32", "nvidia-iluvatar-32", "nvidia-metax-32", "nvidia-mthreads-32",
         "hethub-768")


def work_split(plan: Plan) -> dict[str, float]:
    """Share of (decoder layer x sample) work each kind does; sums to 1."""
    work: dict[str, float] = {}
    for p in plan.pipelines:
        for s in p.stages:
            work[s.kind] = work.get(s.kind, 0.0) + s.num_layers * p.num_samples
    total = sum(work.values())
    return {k: v / total for k, v in work.items()}


def devices_by_kind(plan: Plan) -> dict[str, int]:
    out: dict[str, int] = {}
    for d in plan.devices:
        k = plan.cluster.devices[d].kind
        out[k] = out.get(k, 0) + 1
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-3-8b")
    ap.add_argument("--global-batch", type=int, default=512)
    ap.add_argument("--seq-len", type=int, default=2048)
    args = ap.parse_args()
    model = get_model(args.model)
    print(f"model {args.model}, seq {args.seq_len}; predicted from the catalog (assumed numbers marked there)\n")
    print(f"{'cluster':<20} {'devices':>7} {'batch':>6} {'tokens/s':>12} {'vs alone':>10} {'best 1-kind':>12} "
          f"{'gain':>6} {'pipes':>5} {'search s':>8}  work split (devices used)")
    for name in PAIRS:
        cluster = load_cluster(EXAMPLES / f"{name}.toml")
        batch = args.global_batch * max(1, cluster.num_devices // 32)
        config = PlannerConfig(global_batch=batch, seq_len=args.seq_len)
        t0 = time.perf_counter()
        try:
            r = make_plan(cluster=cluster, model=model, config=config)
        except HethubError as err:
            print(f"{name:<20} {cluster.num_devices:>7} {batch:>6} infeasible: {str(err).split('. Fix')[0]}")
            continue
        search_s = time.perf_counter() - t0
        try:
            alone = make_plan(cluster=cluster, model=model, config=replace(config, strategy="homogeneous"))
            best_alone = alone.prediction.tokens_per_s
        except HethubError:
            best_alone = 0.0
        tps = r.prediction.tokens_per_s
        used = devices_by_kind(r.plan)
        split = ", ".join(f"{k} {v:.0%} ({used.get(k, 0)})" for k, v in work_split(r.plan).items())
        gain = f"{tps / best_alone:.2f}x" if best_alone else "-"
        print(f"{name:<20} {cluster.num_devices:>7} {batch:>6} {tps:>12,.0f} {r.vs_kinds_alone or 0:>10.3f} "
              f"{best_alone:>12,.0f} {gain:>6} {len(r.plan.pipelines):>5} {search_s:>8.2f}  {split}")


if __name__ == "__main__":
    main()
