"""Why nothing fits, in words a person can act on."""

from __future__ import annotations

from hethub.predict.memory import describe_peak, stage_memory, state_bytes_per_param, usable_bytes
from hethub.schedules import SCHEDULES, get_schedule
from hethub.search.config import PlannerConfig
from hethub.search.templates import tp_options
from hethub.spec.cluster import Cluster
from hethub.spec.kind import GIB
from hethub.spec.model import ModelSpec


def infeasible_message(*, cluster: Cluster, model: ModelSpec, config: PlannerConfig) -> str:
    state = model.num_params * sum(state_bytes_per_param(config.precision).values())
    counts = cluster.count_by_kind()
    usable = sum(n * usable_bytes(cluster.kinds[k], headroom=config.mem_headroom) for k, n in counts.items())
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
        kind = cluster.kinds[k]
        one = stage_memory(model, layers=1, embedding=False, head=False, tp=tps[-1], mbs=1, seq_len=config.seq_len,
                           recompute=config.allow_recompute, precision=kind.precision_for(config.precision),
                           in_flight=1, attention=kind.attention, kind=kind)
        cap = usable_bytes(kind, headroom=config.mem_headroom)
        parts.append(f"one layer at TP {tps[-1]} needs {one.total_bytes / GIB:.1f} GiB per {k} device "
                     f"({describe_peak(one, limit=2)}) of {cap / GIB:.1f} GiB usable "
                     f"({config.mem_headroom:.0%} headroom)")
    fixes = ["a smaller --seq-len", "a larger cluster", "a model with fewer layers"]
    if get_schedule(config.schedule).max_in_flight(stage=0, num_stages=1) is None:
        bounded = [n for n in SCHEDULES if get_schedule(n).max_in_flight(stage=0, num_stages=1) is not None]
        fixes.insert(0, f"schedule {' or '.join(bounded)} ({config.schedule} keeps every micro-batch's activations)")
    if not config.allow_recompute:
        fixes.insert(0, "allowing activation recomputation")
    if config.strategy in ("uniform", "flops-proportional"):
        fixes.insert(0, "strategy hethub (it may leave devices out and splits layers unevenly)")
    return f"{head}: {'; '.join(parts)}. Fix: try {', or '.join(fixes)}."
