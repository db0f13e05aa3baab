"""CPU time of one `predict()` and one `stage_memory_fits()` at 512 and 4,096 devices: the plain rules
(hethub/memo.py's reference path, what the predictor ran before its shortcuts) beside the
shortcuts, in one process, every memo emptied before each call (a job's first prediction), and
again with the memos the first call left (the planner's later predictions of one job).

Usage: python bench/predict_speed.py [--sizes 512,4096] [--variants zb-h1/zero1,1f1b/none,interleaved/zero1,...]

The plans have the shape `hethub plan` gives on bench/planner_scale.py's clusters (llama-2-70b,
TP 4 stages: 8 MI300X, 16 H100, 8 A100 per pipeline, 3/3/1 layers; 4 pipelines at 512 devices, 32 at
4,096), under each schedule and optimizer sharding named. A variant ending in "/uneven" gives the
pipelines unequal micro-batch counts (the same total), as the planner's batch shares do, so each
pipeline is simulated on its own. Each line checks that both paths give the same step time and
per-stage memory; ratios are measured here, side by side.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from hethub.memo import clear_caches, reference_path
from hethub.plan import Pipeline, Plan, Stage
from hethub.plan_parts import interleave
from hethub.predict.predictor import predict
from hethub.predict.stage_fits import stage_memory_fits
from hethub.spec.model import get_model

sys.path.insert(0, str(Path(__file__).parent))
from planner_scale import case

# (kind, stages per pipeline, layers per stage), in pipeline order.
SHAPE = (("mi300x", 8, 3), ("h100-sxm", 16, 3), ("a100-80gb", 8, 1))
TP = 4


def scale_plan(n: int, *, schedule: str, sharding: str, uneven: bool = False) -> Plan:
    """The planner's plan shape on bench/planner_scale.py's n-device cluster (module doc); ``uneven``:
    pipeline i's micro-batch count is the even share plus or minus (i // 2 + 1), in turn."""
    cluster, model_name, gb, seq = case(n)
    model = get_model(model_name)
    free = {k: [d.id for d in cluster.devices if d.kind == k] for k, _, _ in SHAPE}
    per_pipe = sum(s for _, s, _ in SHAPE) * TP
    pipes, k = [], n // per_pipe
    for pi in range(k):
        stages, layer = [], 0
        for kind, count, layers in SHAPE:
            for _ in range(count):
                devs, free[kind] = tuple(free[kind][:TP]), free[kind][TP:]
                stages.append(Stage(kind, devs, (layer, layer + layers), embedding=layer == 0,
                                    head=layer + layers == model.num_layers))
                layer += layers
        skew = (pi // 2 + 1) * (1 if pi % 2 == 0 else -1) if uneven and k % 2 == 0 else 0
        pipes.append(Pipeline(1, gb // k + skew, tuple(stages)))
    if schedule == "interleaved":  # two chunks per stage: each stage's layers split in two
        pipes = [interleave(p, [[(s.num_layers + 1) // 2, s.num_layers // 2] for s in p.stages]) for p in pipes]
        pipes = [replace(p, stages=tuple(replace(s, embedding=si == 0, head=si == len(p.stages) - 1)
                                         for si, s in enumerate(p.stages))) for p in pipes]
    return Plan(model=model, cluster=cluster, global_batch=gb, seq_len=seq, pipelines=tuple(pipes),
                schedule=schedule, optimizer_sharding=sharding).validate()


def _cpu(fn: Callable[[], object]) -> tuple[float, object]:
    t = time.process_time()
    out = fn()
    return time.process_time() - t, out


def measure(plan: Plan, *, reference: bool) -> dict[str, object]:
    """Cold and warm CPU seconds of predict() and stage_memory_fits(), and the prediction."""
    def run() -> dict[str, object]:
        clear_caches()
        cold, pred = _cpu(lambda: predict(plan))
        warm, _ = _cpu(lambda: predict(plan))
        clear_caches()
        fits_cold, fits = _cpu(lambda: stage_memory_fits(plan))
        return {"cold": cold, "warm": warm, "fits": fits_cold, "pred": pred, "fits_out": fits}
    if reference:
        with reference_path():
            return run()
    return run()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="512,4096")
    ap.add_argument("--variants", default="zb-h1/zero1,1f1b/none,interleaved/zero1,zb-h1/zero1/uneven,"
                                           "interleaved/zero1/uneven")
    args = ap.parse_args()
    print(f"{'devices':>7} {'variant':>25} {'ref cold':>9} {'fast cold':>9} {'ratio':>6} {'ref warm':>9} "
          f"{'fast warm':>9} {'ratio':>6} {'fits ref':>8} {'fits fast':>9} {'ratio':>6} {'same':>5} load")
    for n in (int(x) for x in args.sizes.split(",")):
        for variant in args.variants.split(","):
            schedule, sharding, *rest = variant.split("/")
            plan = scale_plan(n, schedule=schedule, sharding=sharding, uneven=rest == ["uneven"])
            ref = measure(plan, reference=True)
            new = measure(plan, reference=False)
            a, b = ref["pred"], new["pred"]
            same = (a.step_time_s == b.step_time_s and ref["fits_out"] == new["fits_out"]  # type: ignore[attr-defined]
                    and [s.memory for s in a.stages] == [s.memory for s in b.stages])  # type: ignore[attr-defined]
            print(f"{n:>7} {variant:>25} {ref['cold']:>9.3f} {new['cold']:>9.3f} {ref['cold'] / new['cold']:>6.1f} "
                  f"{ref['warm']:>9.3f} {new['warm']:>9.3f} {ref['warm'] / new['warm']:>6.1f} "
                  f"{ref['fits']:>8.3f} {new['fits']:>9.3f} {ref['fits'] / new['fits']:>6.1f} "
                  f"{'yes' if same else 'NO':>5} {os.getloadavg()[0]:.1f}", flush=True)


if __name__ == "__main__":
    main()
