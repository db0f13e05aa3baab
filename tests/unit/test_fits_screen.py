"""The search's memory screen (layout_assemble.py, ``PlanCosts.stage_shape(p2p_bound=True)``): the
point-to-point buffers at the closed-form bound ``max_live_messages(in_flight)`` whole messages are
never below the exact replay of the stage's order, so a stage that fits with the bound fits exactly,
and the screened checks answer as the exact ones do."""

from __future__ import annotations

import random

import pytest

from hethub.plan import Pipeline, Plan, Recompute, Stage
from hethub.predict.memory.p2p import MessageBytes, p2p_buffer_bytes
from hethub.predict.stage_fits import StageFits
from hethub.predict.stage_modes import choose_recompute, fits_some_mode
from hethub.schedules import get_schedule
from hethub.schedules.messages import max_live_messages
from hethub.spec.cluster import parse_cluster
from hethub.spec.model import get_model


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1", "gpipe"])
def test_the_bound_is_never_below_the_replay(schedule: str) -> None:
    # Every message at the whole size (a TP piece is at most that): the peak is monotone in each size.
    whole = MessageBytes(f_sent=1.0, f_received=1.0, b_sent=1.0, b_received=1.0)
    sched = get_schedule(schedule)
    for p in range(1, 9):
        for m in range(1, 3 * p + 4):
            for stage in range(p):
                held = sched.in_flight(stage=stage, num_stages=p, num_micro_batches=m)
                got = p2p_buffer_bytes(schedule, whole, stage=stage, num_stages=p, num_micro_batches=m)
                assert got <= max_live_messages(held), (schedule, p, m, stage, got, held)


def _plan(rng: random.Random, schedule: str) -> Plan:
    cluster = parse_cluster({"name": "screen", "group": [
        {"kind": "a100-40gb", "nodes": 1, "devices_per_node": 8},
        {"kind": "v100-16gb", "nodes": 1, "devices_per_node": 8}]}, where="test")
    model = get_model("llama-2-7b")
    free = {"a100-40gb": list(range(8)), "v100-16gb": list(range(8, 16))}
    pipes = []
    for _ in range(rng.choice([1, 2])):
        n = rng.choice([1, 2, 3, 4])
        cuts = sorted(rng.sample(range(1, model.num_layers), n - 1))
        bounds = [0, *cuts, model.num_layers]
        stages = []
        for i in range(n):
            kind = rng.choice([k for k, ids in free.items() if ids] or ["a100-40gb"])
            if not free[kind]:
                break
            stages.append(Stage(kind=kind, devices=(free[kind].pop(0),), layers=(bounds[i], bounds[i + 1]),
                                embedding=i == 0, head=i == n - 1,
                                recompute=rng.choice(list(Recompute))))
        if len(stages) == n:
            pipes.append(Pipeline(micro_batch_size=rng.choice([1, 2]), num_micro_batches=rng.randint(1, 12),
                                  stages=tuple(stages)))
    total = sum(p.micro_batch_size * p.num_micro_batches for p in pipes)
    return Plan(model=model, cluster=cluster, global_batch=total, seq_len=rng.choice([1024, 4096]),
                pipelines=tuple(pipes), schedule=schedule, precision="bf16-mixed", strategy="hethub")


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1", "gpipe"])
def test_screened_checks_answer_as_the_exact_ones(schedule: str) -> None:
    rng = random.Random(11)
    seen_both = set()
    for _ in range(60):
        plan = _plan(rng, schedule)
        if not plan.pipelines:
            continue
        for headroom in (0.1, 0.5, 0.8):
            exact = StageFits(plan, mem_headroom=headroom)
            bound = StageFits(plan, mem_headroom=headroom, p2p_bound=True)
            for mode in Recompute:
                e, b = exact.under(mode), bound.under(mode)
                assert all(e[k] for k in b if b[k]), (schedule, mode)  # the bound fits only where exact fits
                seen_both.update(e.values())
            modes = list(Recompute)
            exact_any = all(any(exact.under(m)[k] for m in modes) for k in exact.under(modes[0]))
            assert fits_some_mode(plan, mem_headroom=headroom) == exact_any
            chosen = choose_recompute(plan, mem_headroom=headroom)
            want = [next((m for m in (Recompute.NONE, Recompute.SELECTIVE, Recompute.FULL)
                          if exact.under(m)[(pi, si)]), s.recompute)
                    for pi, p in enumerate(plan.pipelines) for si, s in enumerate(p.stages)]
            assert [s.recompute for p in chosen.pipelines for s in p.stages] == want
    assert seen_both == {True, False}  # the cases cover stages that fit and stages that do not
