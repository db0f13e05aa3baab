"""Why nothing fits, in words a person can act on."""

from __future__ import annotations

from hethub.predict.memory import USABLE_FRACTION, stage_memory
from hethub.schedules import SCHEDULES, get_schedule
from hethub.search.config import PlannerConfig
from hethub.search.templates import tp_options
from hethub.spec.cluster import GIB, Cluster
from hethub.spec.model import ModelSpec


def infeasible_message(*, cluster: Cluster, model: ModelSpec, config: PlannerConfig) -> str:
    state = model.num_params * sum(ModelSpec.state_bytes_per_param(config.precision).values())
    counts = cluster.count_by_kind()
    usable = sum(n * cluster.kinds[k].mem_bytes * USABLE_FRACTION for k, n in counts.items())
    head = (f"no {config.strategy} plan for {model.name} ({model.num_params / 1e9:.1f}B parameters, "
            f"{model.num_layers} layers) at seq_len {config.seq_len} fits cluster {cluster.name!r} "
            f"({cluster.num_devices} devices)")
    if state > usable:
        return (f"{head}: weights, gradients and Adam state alone need {state / GIB:.0f} GiB but the cluster's "
                f"usable memory is {usable / GIB:.0f} GiB. Fix: use a larger cluster or a smaller model "
                "(fewer layers or a narrower hidden size).")
    # The state fits in aggregate, so activations or per-device granularity are the problem: show
    # the smallest per-device footprint of one layer on each kind (largest TP, micro-batch 1).
    parts = []
    for k in counts:
        tps = tp_options(cluster, model, k, config.tp_degrees)
        if not tps:
            parts.append(f"{k} has no TP degree in {config.tp_degrees} that divides its node size and the "
                         "model's heads")
            continue
        mem = stage_memory(model, layers=1, embedding=False, head=False, tp=tps[-1], mbs=1, seq_len=config.seq_len,
                           recompute=config.allow_recompute, precision=config.precision, in_flight=1).total_bytes
        cap = cluster.kinds[k].mem_bytes * USABLE_FRACTION
        parts.append(f"one layer at TP {tps[-1]} needs {mem / GIB:.1f} GiB per {k} device of {cap / GIB:.1f} "
                     "GiB usable")
    fixes = ["a smaller --seq-len", "a larger cluster", "a model with fewer layers"]
    if get_schedule(config.schedule).max_in_flight(stage=0, num_stages=1) is None:
        bounded = [n for n in SCHEDULES if get_schedule(n).max_in_flight(stage=0, num_stages=1) is not None]
        fixes.insert(0, f"schedule {' or '.join(bounded)} ({config.schedule} keeps every micro-batch's activations)")
    if not config.allow_recompute:
        fixes.insert(0, "allowing activation recomputation")
    if config.strategy in ("uniform", "flops-proportional"):
        fixes.insert(0, "strategy hethub (it may leave devices out and splits layers unevenly)")
    return f"{head}: {'; '.join(parts)}. Fix: try {', or '.join(fixes)}."
