"""summary.md: stages, predicted vs measured step time, FLOP/s and utilisation per kind, bubble, efficiency."""

from __future__ import annotations

from hethub.plan import Plan
from hethub.predict.result import Prediction
from hethub.report._style import fmt_time
from hethub.report.analysis import Bubble, bubble, kind_use
from hethub.report.groups import stage_predictions, stage_rows
from hethub.report.metrics import MeasuredRun
from hethub.report.rebalance import rebalance_markdown
from hethub.units import fmt_flops

GIB = 1024**3


def summary_markdown(*, plan: Plan, prediction: Prediction, measured: MeasuredRun | None) -> str:
    m_step = measured.typical_step_time_s if measured else None
    m_tps = measured.typical_tokens_per_s if measured else None
    if m_tps is None and m_step:
        m_tps = plan.tokens_per_step / m_step
    c = plan.cluster
    out = [
        f"# Report: plan '{plan.strategy}'", "",
        f"- model: {plan.model.name} ({_count(plan.model.num_params)} parameters)",
        f"- cluster: {c.name}, {plan.world_size} of {c.num_devices} devices used "
        f"({', '.join(f'{n} {k}' for k, n in c.count_by_kind().items())} in the cluster)",
        f"- training: global batch {plan.global_batch} × {plan.seq_len} tokens = {plan.tokens_per_step:,} tokens "
        f"per step, {plan.schedule}, {plan.precision}, {len(plan.pipelines)} pipeline(s)", "",
        "## Step time and throughput", "",
        "| | predicted | measured |", "|---|---:|---:|",
        f"| step time | {fmt_time(prediction.step_time_s)} | {_opt(m_step, fmt_time)} |",
        f"| tokens/s | {prediction.tokens_per_s:,.0f} | {_opt(m_tps, lambda v: f'{v:,.0f}')} |",
    ]
    if measured and m_step is not None:
        n = len(measured.step_times_s)
        basis = f"median of {n - 1} steps after the first" if n > 1 else "one step"
        out.append(f"| measured / predicted step time | | {m_step / prediction.step_time_s:.2f}× ({basis}) |")
    out += ["", *_efficiency(plan, prediction.tokens_per_s, m_tps), "", *_bubble(prediction, measured, m_step), "",
            *_kinds(plan, prediction.step_time_s, m_step), "", *_stages(plan, prediction), "",
            *_memory(plan, prediction)]
    if measured and measured.rebalance:
        out += ["", *rebalance_markdown(measured)]
    if measured and measured.warnings:
        out += ["", "## Metrics file warnings", "", *[f"- {w}" for w in measured.warnings[:20]]]
        if len(measured.warnings) > 20:
            out.append(f"- … and {len(measured.warnings) - 20} more")
    return "\n".join(out) + "\n"


def _efficiency(plan: Plan, pred_tps: float, meas_tps: float | None) -> list[str]:
    out = ["## Efficiency against the proven upper bound", ""]
    ub = plan.meta.get("upper_bound_tokens_per_s")
    if not isinstance(ub, int | float) or isinstance(ub, bool) or ub <= 0:
        return [*out, "The upper bound is not known (the plan's meta has no `upper_bound_tokens_per_s`)."]
    out.append(f"Upper bound: {ub:,.0f} tokens/s (plan meta `upper_bound_tokens_per_s`: every device at its kind's "
               "best modelled rate with memory, bubble and communication relaxed, docs/planner.md; a bound on "
               "predicted throughput, which a measurement may exceed where the model is pessimistic).")
    out.append("")
    out.append(f"- predicted: {pred_tps / ub:.1%} of the upper bound")
    out.append(f"- measured: {meas_tps / ub:.1%} of the upper bound" if meas_tps else "- measured: no measurement")
    alone = plan.meta.get("kinds_alone_tokens_per_s")
    if isinstance(alone, int | float) and not isinstance(alone, bool) and alone > 0:
        out.append(f"- predicted: {pred_tps / alone:.3f}x the sum of kind-alone plans ({alone:,.0f} tokens/s, "
                   "`vs_kinds_alone`)")
    return out


def _bubble(prediction: Prediction, measured: MeasuredRun | None, m_step: float | None) -> list[str]:
    out = ["## Bubble (share of the step a device spends without compute)", ""]

    def line(name: str, b: Bubble | None, why: str) -> str:
        if b is None:
            return f"- {name}: unknown ({why})"
        return f"- {name}: mean {b.mean_fraction:.1%} over {b.devices} device(s), worst {b.max_fraction:.1%}"

    out.append(line("predicted", bubble(prediction.timeline, step_s=prediction.step_time_s),
                    "the prediction has no timeline; predict with timeline=True"))
    if measured is not None:
        evs = [e for es in measured.events.values() for e in es]
        step = max(m_step or 0.0, measured.timeline_end_s)
        why = "the metrics have no per-rank events"
        out.append(line(f"measured (step {measured.timeline_step})" if evs else "measured",
                        bubble(evs, step_s=step) if evs else None, why))
    return out


def _kinds(plan: Plan, pred_step: float, meas_step: float | None) -> list[str]:
    out = ["## Achieved model FLOP/s and utilisation per device kind", "",
           "Model FLOPs = forward + backward (no recomputation); utilisation (MFU) = achieved per device / dense "
           f"peak for the plan's precision ({plan.precision}).",
           "", "| kind | devices | peak / device | predicted FLOP/s / device | predicted util. "
           "| measured FLOP/s / device | measured util. |", "|---|---:|---:|---:|---:|---:|---:|"]
    total_flops = total_peak = 0.0
    for u in kind_use(plan):
        per_dev = u.achieved_flops_per_s(pred_step) / u.devices
        meas = (u.achieved_flops_per_s(meas_step) / u.devices) if meas_step else None
        out.append(f"| {u.kind} | {u.devices} | {_tf(u.peak_flops_per_device)} | {_tf(per_dev)} | "
                   f"{u.utilisation(pred_step):.1%} | {_opt(meas, _tf)} | "
                   f"{_opt(u.utilisation(meas_step) if meas_step else None, lambda v: f'{v:.1%}')} |")
        total_flops += u.model_flops_per_step
        total_peak += u.devices * u.peak_flops_per_device
    if total_peak > 0:
        pred_mfu = total_flops / pred_step / total_peak if pred_step > 0 else 0.0
        meas_mfu = total_flops / meas_step / total_peak if meas_step else None
        out.append(f"| **all** | {plan.world_size} | | | {pred_mfu:.1%} | | "
                   f"{_opt(meas_mfu, lambda v: f'{v:.1%}')} |")
    return out


def _stages(plan: Plan, prediction: Prediction) -> list[str]:
    rows = stage_rows(plan)
    preds = stage_predictions(prediction)
    out = ["## Stages (predicted)", ""]
    if any(len(r.replicas) > 1 for r in rows):
        out += ["Identical data-parallel replicas share a row; times are per micro-batch of the first replica.", ""]
    out += ["Per step, one device of the stage: compute (forward + backward), exposed communication (TP "
            "collectives, gradient sync after its last backward), optimizer update, and the rest, bubble.", ""]
    out += ["| pipelines | stage | kind | devices | TP | layers | fwd / mb | bwd / mb | p2p / mb | grad sync | "
            "compute / exposed comm / update / bubble per step | peak mem / usable | fits | compute from |",
            "|---|---:|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---|---|"]
    for r in rows:
        sp = preds.get((r.pipeline, r.stage))
        extra = " +emb" if r.embedding else ""
        extra += " +head" if r.head else ""
        layers = f"{r.layers_text}{extra}"
        pipes = r.label.split(" · ")[0]
        if sp is None:
            out.append(f"| {pipes} | {r.stage} | {r.kind} | {r.num_devices} | {r.tp} | {layers} | | | | | | | | |")
            continue
        out.append(f"| {pipes} | {r.stage} | {r.kind} | {r.num_devices} | {r.tp} | {layers} | {fmt_time(sp.fwd_s)} "
                   f"| {fmt_time(sp.bwd_s)} | {fmt_time(sp.p2p_s)} | {fmt_time(sp.sync_s)} | "
                   f"{' / '.join(fmt_time(v) for v in (sp.compute_s, sp.exposed_comm_s, sp.update_s, sp.bubble_s))} | "
                   f"{sp.peak_mem_bytes / GIB:.1f} / {sp.capacity_bytes / GIB:.1f} GiB | "
                   f"{'yes' if sp.fits else '**no**'} | {sp.compute_source} |")
    return out


def _memory(plan: Plan, prediction: Prediction) -> list[str]:
    """Each stage's predicted peak per device, by part (predict/memory): the parts add up to the peak."""
    rows = stage_rows(plan)
    preds = stage_predictions(prediction)
    out = ["## Memory per device (predicted peak, GiB)", "",
           "Parts at the step's peak moment; *temporaries*: the working set of that moment (logits, a layer's "
           "gradients, the gradient-sync copy or the optimizer's scratch); *outside*: framework context and "
           "collective buffers, which the allocator does not see.", "",
           "| pipelines | stage | kind | precision / attention / recompute | weights (+master) | grads | optimizer | "
           "activations (in flight) | temporaries | fragmentation | outside | peak / usable |",
           "|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        sp = preds.get((r.pipeline, r.stage))
        if sp is None or sp.memory is None:
            continue
        p = sp.memory.parts
        temps = p["fb_temporaries"] + p["p2p_buffers"] + p["grad_sync_buffer"] + p["optimizer_temporaries"]
        out.append(
            f"| {r.label.split(' · ')[0]} | {r.stage} | {r.kind} | {sp.precision} / {sp.attention} / "
            f"{plan.pipelines[r.pipeline].stages[r.stage].recompute} | "
            f"{(p['weights'] + p['master_weights']) / GIB:.2f} | {p['grads'] / GIB:.2f} | {p['optimizer'] / GIB:.2f} | "
            f"{p['activations'] / GIB:.2f} ({sp.in_flight}) | "
            f"{temps / GIB:.2f} ({sp.memory.peak_phase.replace('_', ' ')}) | "
            f"{p['fragmentation'] / GIB:.2f} | {(p['framework_context'] + p['comm_buffers']) / GIB:.2f} | "
            f"{sp.peak_mem_bytes / GIB:.2f} / {sp.capacity_bytes / GIB:.2f}{'' if sp.fits else ' **over**'} |")
    out += [*([""] + [f"- warning: {w}" for w in prediction.warnings] if prediction.warnings else [])]
    return out


def _count(n: float) -> str:
    for div, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k")):
        if n >= div:
            return f"{n / div:.3g} {suffix}"
    return f"{n:.0f}"


def _tf(v: float) -> str:
    return fmt_flops(v)


def _opt(v: float | None, fmt: object) -> str:
    return "—" if v is None else fmt(v)  # type: ignore[operator]
