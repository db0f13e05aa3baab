"""Per-step metrics records (one JSON object per step, written as JSON lines by the log rank).

Schema of one record::

    step, loss, lr, grad_norm, step_time_s (slowest rank, step start to optimizer done),
    tokens, tokens_per_s, emulated (any kind emulated),
    kinds: {kind: {devices, flops, achieved_flops_per_s (per device, over the step time),
                   busy_flops_per_s (over time spent computing), emulated, emulated_slowdown}},
    ranks: [{rank, kind, pipeline, stage, tp_rank, step_s, busy_s, recv_wait_s, send_wait_s, sync_s,
             optim_s, emulated_sleep_s, compute_cpu_s, mb_fwd_s, mb_bwd_s, span_s,
             events: [{op: "F"|"B"|"sync"|"optim", mb, start_s, end_s}]}]

``mb_fwd_s``/``mb_bwd_s``: the rank's forward and backward (B and W) time per micro-batch, ``span_s``
when its last of them ended: what online re-balancing measures (hethub.rebalance.measure).

FLOPs are model FLOPs (forward + backward = 3x forward, no recomputation), a rank's share being its
stage's FLOPs over its TP degree. Times of an emulated kind include its emulation sleep: they are
emulated, not measured device speeds, and flagged so.
"""

from __future__ import annotations

from typing import Any

from hethub.layout import RankPlace, StagePlace, Topology
from hethub.plan import Plan
from hethub.runtime.pipeline import StepTrace


def stage_flops_per_step(plan: Plan, stage: StagePlace, *, samples: int) -> float:
    tokens = samples * plan.seq_len
    m = plan.model
    fwd = sum(b - a for a, b in stage.layer_ranges)
    flops = fwd * m.layer_fwd_flops(tokens=tokens, seq_len=plan.seq_len)
    if stage.head:
        flops += m.head_fwd_flops(tokens=tokens)
    return 3.0 * flops


def rank_record(*, rank: int, place: RankPlace, trace: StepTrace, sync_s: float, optim_s: float, step_s: float,
                emulated_sleep_s: float, compute_cpu_s: float = 0.0, detail: bool = True,
                reductions: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """One rank's step timings. Without `detail` (hethub.train's default) the per-micro-batch
    events are dropped: the totals are enough for per-step metrics and keep the gather small.
    ``reductions``: each gradient bucket's reduction, started (in the backward, with overlap) and
    found done, kept with the detail."""
    st = place.stage
    m = max(1, place.num_micro_batches)
    op_s = {"F": 0.0, "B": 0.0, "W": 0.0}
    for e in trace.events:
        op_s[e["op"]] += e["end_s"] - e["start_s"]
    # Gradient sync and the optimizer close the step, in that order: place them from its end.
    opt_start = step_s - optim_s
    tail = [{"op": "sync", "mb": None, "start_s": round(opt_start - sync_s, 6), "end_s": round(opt_start, 6)},
            {"op": "optim", "mb": None, "start_s": round(opt_start, 6), "end_s": round(step_s, 6)}]
    return {"rank": rank, "kind": st.kind, "pipeline": st.pipeline, "stage": st.stage, "tp_rank": place.tp_rank,
            "step_s": round(step_s, 6), "busy_s": round(trace.busy_s, 6), "recv_wait_s": round(trace.recv_wait_s, 6),
            "send_wait_s": round(trace.send_wait_s, 6), "sync_s": round(sync_s, 6), "optim_s": round(optim_s, 6),
            "emulated_sleep_s": round(emulated_sleep_s, 6),
            "compute_cpu_s": round(compute_cpu_s, 6), "mb_fwd_s": round(op_s["F"] / m, 6),
            "mb_bwd_s": round((op_s["B"] + op_s["W"]) / m, 6),
            "span_s": round(max((e["end_s"] for e in trace.events), default=0.0), 6),
            "events": [*(trace.events if detail else ()), *tail],
            **({"reductions": reductions} if detail and reductions else {})}


def step_record(*, plan: Plan, topo: Topology, step: int, loss: float, lr: float, grad_norm: float,
                ranks: list[dict[str, Any]]) -> dict[str, Any]:
    step_time = max(r["step_s"] for r in ranks)
    kinds: dict[str, dict[str, Any]] = {}
    for r in ranks:
        place = topo.place(r["rank"])
        kind = plan.cluster.kinds[place.stage.kind]
        k = kinds.setdefault(place.stage.kind, {"devices": 0, "flops": 0.0, "busy_s": 0.0,
                                                "emulated": kind.emulated,
                                                "emulated_slowdown": kind.emulated_slowdown})
        samples = place.micro_batch_size * place.num_micro_batches
        k["devices"] += 1
        k["flops"] += stage_flops_per_step(plan, place.stage, samples=samples) / place.stage.tp
        k["busy_s"] += r["busy_s"]
    for k in kinds.values():
        k["achieved_flops_per_s"] = k["flops"] / (k["devices"] * step_time) if step_time > 0 else 0.0
        k["busy_flops_per_s"] = k["flops"] / k["busy_s"] if k["busy_s"] > 0 else 0.0
        k["busy_s"] = round(k["busy_s"], 6)
    tokens = plan.tokens_per_step
    return {"step": step, "loss": loss, "lr": lr, "grad_norm": grad_norm, "step_time_s": round(step_time, 6),
            "tokens": tokens, "tokens_per_s": tokens / step_time if step_time > 0 else 0.0,
            "emulated": any(k["emulated"] for k in kinds.values()), "kinds": kinds, "ranks": ranks}
