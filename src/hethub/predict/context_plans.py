"""Context parallelism as the planner offers it: identical replicas fused into one pipeline whose
stages split each sequence ``cp`` ways (``runtime/context_parallel.py``), on the same devices.

Fusing ``cp`` replicas keeps every stage's layers, TP groups and devices: stage s of the fused
pipeline holds the replicas' stage-s devices CP-major (CP rank c is replica c's TP group) and runs
their micro-batches together. Each rank then keeps 1/cp of every activation (memory relief, so a
stage may recompute less, ``stage_modes``), does 1/cp of the compute of a micro-batch, and the
pipeline runs cp times the micro-batches (its fill and drain weigh 1/cp as much); the K/V ring's
passes and the TP collectives on s/cp tokens are priced by the stage model
(``seq_parallel.cp_ring_s``), so the predictor decides whether a fused plan is faster.

Offered where memory binds: some stage of the plan recomputes fully (only there can the freed
activations buy a faster mode), the sequence splits into 2cp load-balanced chunks, and the runtime
runs context parallelism (``runtimes.runtime_runs``). The degrees are 2 and 4 (``CP_DEGREES``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from hethub.plan import Pipeline, Plan, Recompute, zero23_refusal
from hethub.predict.host import HostModel
from hethub.predict.memory import DEFAULT_MEM_HEADROOM
from hethub.predict.predictor import predict
from hethub.predict.profiles import ProfileSet
from hethub.predict.result import Prediction
from hethub.predict.stage_modes import choose_recompute
from hethub.runtimes import runtime_runs

CP_DEGREES = (2, 4)


def cp_degrees(plan: Plan) -> tuple[int, ...]:
    """The context-parallel degrees offered for ``plan`` (see the module doc); () where none is."""
    stages = [s for p in plan.pipelines for s in p.stages]
    if any(s.cp > 1 for s in stages) or not any(s.recompute is Recompute.FULL for s in stages):
        return ()
    return tuple(c for c in CP_DEGREES if plan.seq_len % (2 * c) == 0 and runtime_runs(plan.runtime, cp=c))


def fuse_replicas(plan: Plan, cp: int) -> Plan | None:
    """``plan`` with each group of identical pipelines (micro-batch size, stage kinds, TP degrees and
    layer ranges) fused ``cp`` at a time into context-parallel pipelines (a group's leftover replicas
    stay as they are); None where no group has ``cp`` members."""
    groups: dict[tuple, list[int]] = {}
    for i, p in enumerate(plan.pipelines):
        key = (p.micro_batch_size, p.virtual_stages, tuple((s.kind, s.tp, s.layer_ranges) for s in p.stages))
        groups.setdefault(key, []).append(i)
    pipes: list[Pipeline] = []
    fused = False
    for members in groups.values():
        full = len(members) - len(members) % cp
        for j in range(0, full, cp):
            pipes.append(_fused([plan.pipelines[i] for i in members[j:j + cp]]))
            fused = True
        pipes += [plan.pipelines[i] for i in members[full:]]
    if not fused:
        return None
    pipes.sort(key=lambda p: p.stages[0].devices[0])
    return replace(plan, pipelines=tuple(pipes))


def _fused(replicas: Sequence[Pipeline]) -> Pipeline:
    first = replicas[0]
    stages = tuple(replace(s, devices=tuple(d for r in replicas for d in r.stages[si].devices), cp=len(replicas))
                   for si, s in enumerate(first.stages))
    return replace(first, stages=stages, num_micro_batches=sum(r.num_micro_batches for r in replicas))


def cp_candidates(scored: Sequence[tuple[Plan, Prediction]], *, profiles: ProfileSet | None,
                  host: HostModel | None, config: Any = None) -> list[tuple[Plan, Prediction]]:
    """Each of ``scored``'s plans fused at each degree offered (``cp_degrees``), every stage given its
    fastest mode that fits again, predicted; those that fit and are valid (ZeRO-2/3's equal
    micro-batch counts), fastest first. ``config``: the planner's (its headroom, whether it may
    recompute and use SP; the defaults where None)."""
    mem_headroom = getattr(config, "mem_headroom", DEFAULT_MEM_HEADROOM)
    allow_recompute = getattr(config, "allow_recompute", True)
    allow_sp = getattr(config, "sequence_parallel", True)
    out = []
    for plan, _ in scored:
        for cp in cp_degrees(plan):
            trial = fuse_replicas(plan, cp)
            if trial is None or (trial.zero_stage >= 2 and zero23_refusal(trial) is not None):
                continue
            trial = choose_recompute(trial, allow_recompute=allow_recompute, mem_headroom=mem_headroom,
                                     allow_sp=allow_sp).validate()
            pred = predict(trial, profiles=profiles, host=host, mem_headroom=mem_headroom)
            if pred.fits_memory:
                out.append((trial, pred))
    return sorted(out, key=lambda x: x[1].step_time_s)


def cp_note(scored: Sequence[tuple[Plan, Prediction]], *, starts: Sequence[tuple[Plan, Prediction]]) -> str:
    """What context parallelism did for the plan chosen (``scored[0]``): its degree and gain over the
    best plan without it, the best context-parallel plan it beat, or why none was offered (``starts``:
    the plans it was offered on)."""
    best = scored[0]
    with_cp = next((x for x in scored if any(s.cp > 1 for p in x[0].pipelines for s in p.stages)), None)
    without = next((x for x in scored if all(s.cp == 1 for p in x[0].pipelines for s in p.stages)), None)
    if with_cp is None:
        offered = any(cp_degrees(plan) for plan, _ in starts)
        return ("context parallelism: none offered (no stage of the best plans recomputes fully, or the sequence "
                "does not split into 2 x cp chunks)" if not offered else
                "context parallelism: offered, but no best plan has identical replicas to fuse, or no fused one "
                "fits and is valid")
    cp = max(s.cp for p in with_cp[0].pipelines for s in p.stages)
    if with_cp is best and without is not None:
        return (f"context parallelism: cp {cp} chosen (predicted step {best[1].step_time_s:.3f} s vs "
                f"{without[1].step_time_s:.3f} s without: {without[1].step_time_s / best[1].step_time_s:.3f}x)")
    return (f"context parallelism: not chosen (its best, cp {cp}, predicted step {with_cp[1].step_time_s:.3f} s vs "
            f"{best[1].step_time_s:.3f} s)")
