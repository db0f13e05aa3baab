"""Online re-balancing on the local CPU cluster: one rank slowed 2x mid-run, against a fresh plan
made for the new speeds, side by side in one run.

    python bench/rebalance.py [--replicas 4] [--micro-batches 4] [--steps 26] [--slow-rank 3]
                              [--factor 2] [--slow-at 10] [--rounds 2]

Forked gloo ranks (one thread each) train a Llama-shaped model as ``--replicas`` data-parallel
replicas of one stage, each with ``--micro-batches`` micro-batches of one sequence, through the
runtime's own hook (``runtime/rebalance.py``, default thresholds, ``--rebalance shares``). Two runs,
alternated ``--rounds`` times:

* **live**: the even split; from step ``--slow-at`` on, rank ``--slow-rank`` runs ``--factor`` times
  slower (``--emulate-slowdown``'s emulation); re-balancing reacts;
* **fresh**: a plan made for the new speeds, as re-profiling and re-planning would: first the new
  speeds are measured (``--profile-steps`` steps of the even split with the rank slowed from step 0:
  each rank's median emulated device time per micro-batch, its CPU time plus emulated sleep), then
  the same replicas get the split best for them (exhaustive over the splits; ties: the most even),
  trained with the rank slowed from step 0 by the same runtime (re-balancing on: it has nothing to
  change there, and any change it makes is printed). (The planner itself, asked on this 2-core
  host, leaves the fourth device out for core sharing, a different structure: docs/rebalance.md.)

Printed per round: the step whose measurement decided the change (and how many slowed steps that
took), the shares before and after, the steady step time after the change (median from two steps
after it to the end), the fresh plan's steady step time over the same steps, and their ratio; and
the same ratio for the busiest emulated device's compute per step (CPU time plus emulated sleep),
which leaves out how the scheduler shared this host's cores among the ranks in each run.
Everything runs on this host's cores, shared by all ranks (the step times are emulation).
"""

from __future__ import annotations

import argparse
import itertools
import statistics
from dataclasses import replace

import torch

from hethub.comm.factory import make_communicator
from hethub.comm.local_ranks import run_local_ranks
from hethub.commands.rebalance_plan import with_rebalance_meta
from hethub.plan import Pipeline, Plan, Stage
from hethub.rebalance import RebalanceConfig
from hethub.rebalance.measure import rank_times
from hethub.runtime.optim import OptimConfig
from hethub.runtime.rebalance import LiveRebalance
from hethub.runtime.slowdown import SlowdownAt
from hethub.runtime.trainer import Trainer, TrainerConfig
from hethub.spec.cluster import parse_cluster
from hethub.spec.model import ModelSpec

SPEC = ModelSpec(name="bench", num_layers=2, hidden_size=128, num_heads=4, num_kv_heads=2, ffn_hidden_size=344,
                 vocab_size=256, max_seq_len=128)


def dp_plan(counts: tuple[int, ...], *, seq_len: int) -> Plan:
    """One-stage replicas, one per CPU device of this host, with these micro-batch counts."""
    c = parse_cluster({"name": "bench-rebalance", "host_cores": "auto", "kinds": {"cpu": {"base": "cpu"}},
                       "group": [{"kind": "cpu", "nodes": 1, "devices_per_node": len(counts)}],
                       "network": {"inter_node_bw_bytes_per_s": 1.5e9, "inter_node_latency_s": 50e-6,
                                   "cross_kind_bw_bytes_per_s": 1.5e9, "cross_kind_latency_s": 50e-6}}, where="bench")
    pipes = tuple(Pipeline(1, m, (Stage("cpu", (d,), (0, SPEC.num_layers), embedding=True, head=True),))
                  for d, m in enumerate(counts))
    return Plan(model=SPEC, cluster=c, global_batch=sum(counts), seq_len=seq_len, pipelines=pipes,
                precision="fp32").validate()


def fresh_counts(per_mb_s: list[float], total: int) -> tuple[int, ...]:
    """The split of ``total`` micro-batches among one-stage replicas that is best for their measured
    time per micro-batch (a replica's step is its micro-batches times that; exhaustive; among equals,
    the most even)."""
    n, best = len(per_mb_s), None
    for cut in itertools.combinations(range(1, total), n - 1):
        counts = tuple(b - a for a, b in zip((0, *cut), (*cut, total), strict=True))
        key = (max(m * t for m, t in zip(counts, per_mb_s, strict=True)), max(counts) - min(counts))
        if best is None or key < best[0]:
            best = (key, counts)
    assert best is not None
    return best[1]


def run(rank: int, plan: Plan, steps: int, slow: tuple[SlowdownAt, ...], mode: str) -> list[dict] | None:
    comm = make_communicator(plan=plan, rank=rank)
    optim = replace(OptimConfig(lr=1e-4), total_steps=steps, warmup_steps=1)
    trainer = Trainer(plan, rank=rank, comm=comm, cfg=TrainerConfig(optim=optim))
    live = LiveRebalance(trainer, cfg=RebalanceConfig(mode=mode), slowdowns=slow, say=lambda text: None)
    g = torch.Generator().manual_seed(0)
    out = []
    for step in range(steps):
        batch = torch.randint(0, SPEC.vocab_size, (plan.global_batch, plan.seq_len + 1), generator=g)
        live.before_step(step)
        rec = trainer.train_step(batch, step=step)
        live.after_step(step, rec)
        if rec is not None:
            rb = rec["rebalance"]
            # The busiest emulated device's compute this step (CPU time plus emulated sleep): the step
            # without the scheduler's share-out of this host's cores among the ranks.
            device_s = max(r["compute_cpu_s"] + r["emulated_sleep_s"] for r in rec["ranks"])
            out.append({"step": step, "step_s": rec["step_time_s"], "device_s": device_s, "shares": rb["shares"],
                        "change": rb.get("change"),
                        "fb_s": [t.fb_s for t in sorted(rank_times(rec["ranks"], emulated_host=True),
                                                        key=lambda t: t.rank)]})
    return out if out else None


def trained(plan: Plan, steps: int, slow: tuple[SlowdownAt, ...], mode: str) -> list[dict]:
    res = run_local_ranks(plan.world_size, run, plan, steps, slow, mode, timeout_s=900.0, collective_timeout_s=300.0)
    return next(r for r in res if r)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--micro-batches", type=int, default=4, help="per replica in the even split")
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--steps", type=int, default=26)
    ap.add_argument("--slow-rank", type=int, default=3)
    ap.add_argument("--factor", type=float, default=2.0)
    ap.add_argument("--slow-at", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--profile-steps", type=int, default=10, help="steps measuring the new speeds for the fresh plan")
    a = ap.parse_args()
    n, total = a.replicas, a.replicas * a.micro_batches
    even = dp_plan((a.micro_batches,) * n, seq_len=a.seq_len)
    even = with_rebalance_meta(even, layers=False)
    slow_live = (SlowdownAt(target=str(a.slow_rank), factor=a.factor, step=a.slow_at),)
    slow_fresh = (SlowdownAt(target=str(a.slow_rank), factor=a.factor, step=0),)
    # The new speeds, measured as a profile would be: the even split with the rank slowed from the start.
    prof = trained(even, a.profile_steps, slow_fresh, "off")
    per_mb = [statistics.median(r["fb_s"][i] for r in prof[2:]) for i in range(n)]
    others = statistics.median(t for i, t in enumerate(per_mb) if i != a.slow_rank)
    best = fresh_counts(per_mb, total)
    fresh = dp_plan(best, seq_len=a.seq_len)
    print(f"{n} replicas x {a.micro_batches} micro-batches of 1 x {a.seq_len} tokens, {SPEC.num_layers} layers of "
          f"{SPEC.hidden_size}; rank {a.slow_rank} {a.factor:g}x slower from step {a.slow_at} (emulated; measured "
          f"{per_mb[a.slow_rank] / others:.2f}x the others' device time per micro-batch); "
          f"fresh plan's split for the measured new speeds: {list(best)}")
    print(f"{'round':>5} {'decided at':>10} {'slowed steps':>12} {'shares after':>16} {'live steady s':>13} "
          f"{'fresh steady s':>14} {'live / fresh':>12} {'device: live / fresh':>20}")
    ratios, device_ratios = [], []
    for rnd in range(a.rounds):
        live = trained(even, a.steps, slow_live, "shares")
        # The same runtime, re-balancing on (its per-step decision collective included); it finds
        # nothing worth changing in a split made for these speeds (a change would be counted).
        ref = trained(fresh, a.steps, slow_fresh, "shares")
        changes = [r for r in live if r["change"] is not None]
        if not changes:
            print(f"{rnd:>5} {'never':>10}")
            continue
        at = changes[0]["step"]
        window = range(at + 2, a.steps)
        live_s = statistics.median(r["step_s"] for r in live if r["step"] in window)
        ref_s = statistics.median(r["step_s"] for r in ref if r["step"] in window)
        dev = (statistics.median(r["device_s"] for r in live if r["step"] in window)
               / statistics.median(r["device_s"] for r in ref if r["step"] in window))
        ratios.append(live_s / ref_s)
        device_ratios.append(dev)
        ref_changes = sum(r["change"] is not None for r in ref)
        print(f"{rnd:>5} {at:>10} {at - a.slow_at + 1:>12} {live[-1]['shares']!s:>16} {live_s:>13.4f} "
              f"{ref_s:>14.4f} {live_s / ref_s:>12.3f} {dev:>20.3f}"
              + (f"  ({len(changes)} changes)" if len(changes) > 1 else "")
              + (f"  (fresh: {ref_changes} changes)" if ref_changes else ""))
    if ratios:
        print(f"live / fresh steady step time: median {statistics.median(ratios):.3f} over {len(ratios)} round(s) "
              f"(target <= 1.10; busiest device's compute: {statistics.median(device_ratios):.3f}); slowed steps "
              "before the change: target <= 5")


if __name__ == "__main__":
    main()
