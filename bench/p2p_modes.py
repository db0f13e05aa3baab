"""PREDICTIONS, not measurements: how much blocking sends (training.p2p "blocking") and DeepSpeed's
lock-step engine (training.p2p "lockstep", as Sailor runs it) change hethub's predicted step time of
Sailor's example plan.

    python bench/p2p_modes.py

The plan is ../shared/reference/sailor/example-plan-opt350-a100-v100.json (OPT-350M, 8 replicas of
a V100 x2 + A100 x2 two-stage pipeline, 64 micro-batches of 2) imported onto
examples/clusters/a100-v100-32.toml, timed with Sailor's OPT-350 profiles. Rows: the plan as is;
with the links between nodes at 10 Gb/s Ethernet (1.25 GB/s, 50 us), the issue's workstation
setting; and each of those with every TP-2 stage split into two TP-1 stages (4 stages on the same
devices, layers split evenly), where the inner stages send both ways. Per row: the predicted step
with asynchronous sends (hethub's runtime), with blocking ones and in lock-step, and each one's change
from async. docs/predictor.md ("Blocking sends") says why two stages change little under blocking,
and why lock-step adds about one more transfer per micro-batch on 2 stages and two more from 3.
"""

from __future__ import annotations

import json
import sys
import warnings
from dataclasses import replace
from pathlib import Path

from hethub.interop import import_sailor_plan
from hethub.plan import Pipeline, Plan, Stage
from hethub.predict.predictor import predict
from hethub.profile import load_profiles
from hethub.spec.cluster import Link, load_cluster
from hethub.spec.model import PRESETS

REPO = Path(__file__).resolve().parents[1]
SAILOR = REPO.parent / "shared" / "reference" / "sailor"
ETHERNET = Link(1.25e9, 50e-6)  # 10 Gb/s


def four_stages(plan: Plan) -> Plan:
    """Each pipeline's TP-2 stages as two TP-1 stages on the same two devices, layers split evenly."""
    pipes = []
    for p in plan.pipelines:
        stages = []
        for si, s in enumerate(p.stages):
            a, b = s.layers
            mid = (a + b) // 2
            stages.append(Stage(s.kind, s.devices[:1], (a, mid), embedding=si == 0))
            stages.append(Stage(s.kind, s.devices[1:], (mid, b), head=si == len(p.stages) - 1))
        pipes.append(Pipeline(p.micro_batch_size, p.num_micro_batches, tuple(stages)))
    return replace(plan, pipelines=tuple(pipes)).validate()


def main() -> int:
    example = SAILOR / "example-plan-opt350-a100-v100.json"
    if not example.is_file():
        print("no ../shared/reference/sailor here; skipped")
        return 0
    model = PRESETS["opt-350m"]
    plan = import_sailor_plan(json.loads(example.read_text()), cluster=load_cluster(REPO / "examples" / "clusters" /
                                                                                     "a100-v100-32.toml"),
                              model=model, seq_len=2048)
    with warnings.catch_warnings():  # the other models' profiles in the tree are skipped, as expected
        warnings.simplefilter("ignore")
        profiles = load_profiles(SAILOR / "profiles" / "OPT-350", model=model, seq_len=2048)
    eth = replace(plan, cluster=replace(plan.cluster, inter_node=ETHERNET, cross_kind=ETHERNET))
    rows = [("example plan (2 stages, TP 2)", plan), ("  links 10 Gb/s Ethernet", eth),
            ("4 stages, TP 1, same devices", four_stages(plan)), ("  links 10 Gb/s Ethernet", four_stages(eth))]
    print("PREDICTED step times (hethub's model with Sailor's profiles; not measurements)")
    print(f"{'plan':<32} {'send ms':>8} {'F+B ms':>7} {'async s':>8} {'blocking s':>10} {'change':>7} "
          f"{'lockstep s':>10} {'change':>7}")
    for label, p in rows:
        a, b, lock = (predict(replace(p, p2p=mode), profiles=profiles) for mode in ("async", "blocking", "lockstep"))
        send = max(s.p2p_s for s in a.stages)
        work = max(s.fwd_s + s.bwd_s for s in a.stages)
        print(f"{label:<32} {send * 1e3:>8.2f} {work * 1e3:>7.1f} {a.step_time_s:>8.3f} {b.step_time_s:>10.3f} "
              f"{b.step_time_s / a.step_time_s - 1:>+7.1%} {lock.step_time_s:>10.3f} "
              f"{lock.step_time_s / a.step_time_s - 1:>+7.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
