"""Plain-text tables of plans and predictions for the terminal.

Identical replicas are folded into one row group ("x16") so a 768-device plan stays readable.
"""

from __future__ import annotations

from hethub.plan import Plan, Stage
from hethub.predict.result import Prediction
from hethub.predict.utilisation import cluster_mfu
from hethub.schedules import DEFAULT_P2P
from hethub.spec.cluster import Cluster
from hethub.spec.kind import DeviceKind
from hethub.units import GIB, fmt_chunks

GB = GIB  # memory columns are GiB, as everywhere (hethub.units)


def compact_ids(ids: tuple[int, ...] | list[int]) -> str:
    """[0,1,2,3,8,9] -> '0-3,8-9'."""
    if not ids:
        return "-"
    out, start, prev = [], ids[0], ids[0]
    for i in [*ids[1:], None]:
        if i is not None and i == prev + 1:
            prev = i
            continue
        out.append(str(start) if start == prev else f"{start}-{prev}")
        if i is not None:
            start = prev = i
    return ",".join(out)


def _signature(plan: Plan, pi: int) -> tuple:
    p = plan.pipelines[pi]
    return (p.micro_batch_size, p.num_micro_batches,
            tuple((s.kind, s.tp, s.layer_ranges, s.recompute, s.sequence_parallel, s.cp) for s in p.stages))


def seq_split(s: Stage) -> str:
    """How a stage splits its sequences: "sp" (sequence parallelism), "cpN" (context parallelism), "-"."""
    return "+".join(["sp"] * s.sequence_parallel + [f"cp{s.cp}"] * (s.cp > 1)) or "-"


def format_plan_table(plan: Plan, pred: Prediction) -> str:
    groups: dict[tuple, list[int]] = {}
    for pi in range(len(plan.pipelines)):
        groups.setdefault(_signature(plan, pi), []).append(pi)
    by_stage = {(s.pipeline, s.stage): s for s in pred.stages}
    head = (f"{'pipelines':<14} {'mbs x n':>9} {'stage':>5} {'kind':<12} {'devices':<18} {'layers':<9} {'tp':>2} "
            f"{'seq':<6} {'recompute':<9} {'mem GiB / cap':>14} {'fwd+bwd ms':>10} {'sync ms':>8}")
    lines = [head, "-" * len(head)]
    for pis in groups.values():
        first = plan.pipelines[pis[0]]
        label = f"{compact_ids(pis)}" + (f" (x{len(pis)})" if len(pis) > 1 else "")
        for si, s in enumerate(first.stages):
            sp = by_stage[(pis[0], si)]
            devs = compact_ids(list(s.devices)) + (" ..." if len(pis) > 1 else "")
            mem = f"{sp.peak_mem_bytes / GB:.1f}/{sp.capacity_bytes / GB:.0f}" + ("" if sp.fits else " !")
            lines.append(
                f"{label if si == 0 else '':<14} "
                f"{(f'{first.micro_batch_size}x{first.num_micro_batches}' if si == 0 else ''):>9} "
                f"{si:>5} {s.kind:<12} {devs:<18} {fmt_chunks(s.layer_ranges):<9} "
                f"{s.tp:>2} {seq_split(s):<6} {s.recompute:<9} {mem:>14} {(sp.fwd_s + sp.bwd_s) * 1e3:>10.1f} "
                f"{sp.sync_s * 1e3:>8.1f}"
            )
    return "\n".join(lines)


def format_summary(plan: Plan, pred: Prediction, *, upper_bound_tokens_per_s: float | None = None,
                   search_time_s: float | None = None, kinds_alone_tokens_per_s: float | None = None) -> str:
    """The plan's headline: devices, schedule, predicted step and tokens/s; with the job's proven upper
    bound (predict/proven_bound.py) the efficiency (<= 1) and MFU; with the sum of kind-alone plans, the
    ratio to it (above 1 where mixing kinds relieves one's memory)."""
    used = plan.world_size
    kinds = ", ".join(f"{n} x{c}" for n, c in _kinds_used(plan).items())
    out = [
        f"strategy {plan.strategy}: {len(plan.pipelines)} pipelines on {used} of {plan.cluster.num_devices} "
        f"devices ({kinds}); schedule {plan.schedule}, {plan.precision}"
        + (f", optimizer state sharded ({plan.optimizer_sharding}, {plan.optimizer_shares} slices)"
           if plan.sharded_optimizer else "")
        + (f"; {plan.p2p} sends between stages (training.p2p)" if plan.p2p != DEFAULT_P2P else ""),
        f"predicted step time {pred.step_time_s:.3f} s, {pred.tokens_per_s:,.0f} tokens/s "
        f"(global batch {plan.global_batch} x {plan.seq_len} tokens); {prediction_basis(plan.cluster, pred)}",
    ]
    if upper_bound_tokens_per_s:
        mfu = cluster_mfu(cluster=plan.cluster, model=plan.model, seq_len=plan.seq_len, precision=plan.precision,
                          tokens_per_s=pred.tokens_per_s)
        out.append(f"proven upper bound {upper_bound_tokens_per_s:,.0f} tokens/s (every device at its best modelled "
                   f"rate, no memory limit, bubble or communication) -> efficiency "
                   f"{pred.tokens_per_s / upper_bound_tokens_per_s:.3f}; MFU {mfu:.1%} of the cluster's summed peak")
    if kinds_alone_tokens_per_s:
        out.append(f"sum of kind-alone plans {kinds_alone_tokens_per_s:,.0f} tokens/s -> vs_kinds_alone "
                   f"{pred.tokens_per_s / kinds_alone_tokens_per_s:.3f}")
    if search_time_s is not None:
        out.append(f"search time {search_time_s:.2f} s")
    srcs = ", ".join(f"{k}: {v}" for k, v in sorted(pred.compute_sources.items()))
    out.append(f"compute times from: {srcs}")
    if "recomputation" in pred.sources:
        out.append(f"recomputation: {pred.sources['recomputation']}")
    out += calibration_notes(plan, pred)
    emulated = [k.name for k in plan.cluster.kinds.values() if k.emulated]
    if emulated:
        out.append(f"EMULATED kinds (CPU processes slowed on purpose): {', '.join(emulated)}")
    if not pred.fits_memory:
        out.append("WARNING: some stages exceed device memory (marked '!')")
    return "\n".join(out)


# What a kind's compute times stand on (the predictor's compute_source, read for a person).
MEASURED, CALIBRATED, PARTLY_CALIBRATED, PLACEHOLDER, DATASHEET = (
    "measured profiles", "catalog numbers calibrated on measurements",
    "catalog numbers partly calibrated on measurements", "catalog placeholders, not measured",
    "datasheet peaks x an assumed efficiency, uncalibrated")


def compute_basis(kind: DeviceKind, compute_source: str) -> str:
    """One of the labels above for a kind's ``compute_source`` (hethub.predict.compute.StageTimes)."""
    if compute_source == "profile":
        return MEASURED
    if "partly calibrated on" in compute_source:
        return PARTLY_CALIBRATED
    if "calibrated on" in compute_source:
        return CALIBRATED
    # CPU kinds (gloo) have only nominal placeholder numbers in the catalog; other kinds a datasheet.
    return PLACEHOLDER if kind.backend == "gloo" else DATASHEET


def prediction_basis(cluster: Cluster, *predictions: Prediction) -> str:
    """What the predicted figures on the same line stand on, by kind: "compute from measured profiles:
    a, b; catalog placeholders (...): c". Several predictions (a table's rows) merge their kinds."""
    by_label: dict[str, list[str]] = {}
    sources = {k: v for p in predictions for k, v in p.compute_sources.items()}
    for kind, source in sorted(sources.items()):
        by_label.setdefault(compute_basis(cluster.kinds[kind], source), []).append(kind)
    return "compute from " + "; ".join(f"{label}: {', '.join(kinds)}" for label, kinds in by_label.items())


def calibration_notes(plan: Plan, pred: Prediction) -> list[str]:
    """Say which kinds' times rest on assumed numbers, and how to measure them instead. CPU kinds
    (backend gloo) have only nominal placeholders in the catalog, so their analytic times can be off
    several-fold; accelerator kinds use datasheet peaks with efficiencies that are fitted on cited
    measurements where the catalog has them (`hethub predict --json`: sources.calibration)."""
    roofline = sorted(k for k, v in pred.compute_sources.items() if v == "analytic, constant efficiency")
    cpu = [k for k in roofline if plan.cluster.kinds[k].backend == "gloo"]
    accel = [k for k in roofline if k not in cpu]
    uncal = sorted(k for k, v in pred.compute_sources.items() if v == "analytic, uncalibrated")
    partly = {k: v for k, v in sorted(pred.compute_sources.items()) if v.startswith("analytic, partly calibrated")}
    out = []
    if cpu:
        out.append(f"UNCALIBRATED: {', '.join(cpu)}: times from the catalog's nominal CPU numbers (placeholders, not "
                   "measurements); this prediction can be off several-fold. Calibrate: hethub profile --model "
                   f"{plan.model.name} --seq-len {plan.seq_len} --kind {','.join(cpu)} --out profiles/, then pass "
                   "--profiles profiles/")
    if accel or uncal:
        out.append(f"uncalibrated: {', '.join(accel + uncal)}: times from datasheet peaks x assumed efficiencies "
                   "(catalog); measured profiles (hethub profile on the device, or Sailor's) replace them via "
                   "--profiles")
    for kind, src in partly.items():
        assumed = src.rpartition(" (")[2].rstrip(")")
        out.append(f"partly calibrated: {kind}: {assumed} (the rest fitted on cited measurements: "
                   "hethub predict --json, sources.calibration)")
    return out


def _kinds_used(plan: Plan) -> dict[str, int]:
    out: dict[str, int] = {}
    for p in plan.pipelines:
        for s in p.stages:
            out[s.kind] = out.get(s.kind, 0) + s.tp
    return out
