"""The scoring's tight step floor (``step_floor_s(tight=True) + sync_tail_s(tight=True)``: each op with its
point-to-point posts, each hop's transfer in the fill and the drain, and a sharded optimizer's sync at
the least slices any split has) is below the predicted step of random plans covering every schedule,
ZeRO 0-3, recomputation, sequence parallelism, CP, interleaving, all three transfer modes and sync
groups inside one vendor island and across two (the bridge's exchange); and it is tighter than the
polish's floor where it has something to add."""

from __future__ import annotations

import random

from conftest import small_cluster, two_islands
from hethub.errors import PlanError
from hethub.plan import Pipeline, Plan, Recompute, Stage
from hethub.plan_parts import with_chunks
from hethub.predict.fabrics import FABRICS, NVLS
from hethub.predict.plan_costs import PlanCosts
from hethub.predict.predictor import (
    floor_reaches,
    last_finish_s,
    pipeline_floor_s,
    predict,
    step_floor_s,
    sync_tail_s,
)
from hethub.predict.sync import sync_groups
from hethub.predict.sync_rules import holder_exchange
from hethub.schedules.simulate import finish_floor_s, simulate_pipeline_time
from hethub.spec.model import ModelSpec

MODEL = ModelSpec(name="f", num_layers=8, hidden_size=256, num_heads=8, num_kv_heads=4, ffn_hidden_size=704,
                  vocab_size=1024, max_seq_len=256)


def _cluster(islands: int):
    c = small_cluster(fast=16, slow=16, per_node=8)
    return c if islands == 1 else two_islands(c)


def _random_plan(rng: random.Random, islands: int) -> Plan | None:
    free = {"fast": list(range(16)), "slow": list(range(16, 32))}
    schedule = rng.choice(["1f1b", "zb-h1", "gpipe", "interleaved"])
    sharding = rng.choice(["none", "zero1", "zero1", "zero2", "zero3"])
    m, mbs = rng.randint(1, 6), rng.choice([1, 2])
    pipes = []
    for _ in range(rng.randint(1, 3)):
        n, cp = rng.randint(1, 4), rng.choice([1, 1, 1, 2])
        cuts = sorted(rng.sample(range(1, MODEL.num_layers), n - 1))
        bounds = [0, *cuts, MODEL.num_layers]
        stages = []
        for i in range(n):
            kind, tp = rng.choice(["fast", "slow"]), rng.choice([1, 2, 4])
            if len(free[kind]) < tp * cp:
                return None
            devs, free[kind] = tuple(free[kind][:tp * cp]), free[kind][tp * cp:]
            stages.append(Stage(kind, devs, (bounds[i], bounds[i + 1]), embedding=i == 0, head=i == n - 1, cp=cp,
                                recompute=rng.choice(list(Recompute)), sequence_parallel=tp > 1 and rng.random() < .3))
        pipe = Pipeline(mbs, m if sharding in ("zero2", "zero3") else rng.randint(1, 6), tuple(stages))
        if schedule == "interleaved" and rng.random() < 0.5 and all(s.num_layers >= 2 for s in stages) and cp == 1:
            pipe = with_chunks(pipe, 2)
        pipes.append(pipe)
    try:
        return Plan(model=MODEL, cluster=_cluster(islands), global_batch=sum(p.num_samples for p in pipes),
                    seq_len=64, pipelines=tuple(pipes), schedule=schedule, optimizer_sharding=sharding,
                    p2p=rng.choice(["async", "async", "blocking", "lockstep"])).validate()
    except (PlanError, ValueError):
        return None


def _bridged(plan: Plan) -> bool:
    return any(len(holder_exchange(plan, g.holders).islands) > 1 for g in sync_groups(plan) if g.participants > 1)


def test_the_tight_floor_is_below_every_predicted_step() -> None:
    rng = random.Random(11)
    seen: set[tuple] = set()
    checked = tighter = 0
    while checked < 240:
        plan = _random_plan(rng, islands=1 + checked % 2)
        if plan is None:
            continue
        costs = PlanCosts(plan, None)
        step = predict(plan).step_time_s
        tight = step_floor_s(plan, costs=costs, tight=True) + sync_tail_s(plan, costs=costs, tight=True)
        loose = step_floor_s(plan, costs=costs) + sync_tail_s(plan, costs=costs)
        assert loose <= tight <= step, (plan.schedule, plan.optimizer_sharding, plan.p2p, loose, tight, step)
        assert not floor_reaches(plan, step * (1 + 1e-9), costs=costs, tight=True)
        # The pipelines as the prediction simulates them: with the tail, the step itself where unsharded.
        finish = last_finish_s(plan, costs=costs)
        assert finish + sync_tail_s(plan, costs=costs, tight=True) <= step * (1 + 1e-12)
        if not plan.sharded_optimizer:
            assert floor_reaches(plan, step * (1 - 1e-9), costs=costs, tight=True)
        tighter += tight > loose * (1 + 1e-9)
        seen.add((plan.schedule, plan.zero_stage, plan.p2p, any(p.virtual_stages > 1 for p in plan.pipelines),
                  _bridged(plan)))
        checked += 1
    # Every schedule, ZeRO stage and transfer mode was drawn, chunked and bridged plans too.
    assert {s[0] for s in seen} == {"1f1b", "zb-h1", "gpipe", "interleaved"}
    assert {s[1] for s in seen} == {0, 1, 2, 3} and {s[2] for s in seen} == {"async", "blocking", "lockstep"}
    assert any(s[3] for s in seen) and any(s[4] and s[1] >= 1 for s in seen)
    assert tighter > checked // 2  # it adds something on most plans


def test_a_sharded_plans_tail_counts_its_sync() -> None:
    """Under ZeRO-2/3 the per-micro-batch reductions are most of a data-parallel step: the loose floor
    leaves them out, the tight one prices them."""
    rng = random.Random(5)
    found = 0
    while found < 5:
        plan = _random_plan(rng, islands=1)
        if plan is None or plan.zero_stage < 2 or len(plan.pipelines) < 2:
            continue
        costs = PlanCosts(plan, None)
        assert sync_tail_s(plan, costs=costs) == 0.0 < sync_tail_s(plan, costs=costs, tight=True)
        found += 1


def test_every_fabric_curve_makes_transfer_time_grow_with_bytes() -> None:
    """The sharded floor prices each group at the least largest slice: a floor only where a transfer's
    time grows with its bytes, which the curves' shapes below 1 give (time ~ b^(1 - shape) + b)."""
    assert all(f.shape < 1 for f in (*FABRICS.values(), NVLS))


def test_the_schedules_finish_floor_is_below_the_simulation() -> None:
    """``finish_floor_s`` under the event simulation's last finish on random pipelines of every schedule
    without chunks, async and blocking sends, slow hops and mid-pipeline bottlenecks; the first
    backward's round trip makes it tighter than fill, work and drain alone on most."""
    rng = random.Random(3)
    above = 0
    for i in range(400):
        n, m = rng.randint(1, 8), rng.randint(1, 20)
        f = [rng.uniform(0.1, 1.0) * rng.choice([1, 1, 3]) for _ in range(n)]
        b = [x * rng.uniform(1.5, 2.5) for x in f]
        hops = [rng.choice([0.0, 0.01, 0.3, 2.0]) for _ in range(n - 1)]
        schedule = ["1f1b", "gpipe", "zb-h1"][i % 3]
        floor = finish_floor_s(fwd_s=f, bwd_s=b, p2p_s=hops, num_micro_batches=m, schedule=schedule)
        for p2p in ("async", "blocking"):
            sim = max(simulate_pipeline_time(fwd_s=f, bwd_s=b, p2p_s=hops, num_micro_batches=m, schedule=schedule,
                                             p2p=p2p))
            assert floor <= sim, (schedule, p2p, n, m, floor, sim)
        above += floor > pipeline_floor_s(f, b, num_micro_batches=m, drain=schedule != "zb-h1") * (1 + 1e-9)
    assert above > 200
