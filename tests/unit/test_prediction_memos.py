"""The shortcuts a prediction and the scoring's floors take on plans of many replicas give exactly
the plain path's results (``hethub.memo.reference_path``), on random plans of replicas: a stage's
derived fields kept on the frozen record (``plan_parts.kept_field``), ``PlanCosts.op_times`` kept
per pipeline, ``boundary_s`` kept by the hop's devices, ``exposed_sync_groups`` kept by plan, groups
and backward, the two-level all-reduce kept by its arguments, the search's free nodes kept by
cluster, and ``Plan.validate``'s device checks kept per (kind, devices, CP degree)."""

from __future__ import annotations

import dataclasses
import itertools
import pickle
import random

import pytest

from conftest import small_cluster, tiny_model, two_islands
from hethub.errors import PlanError
from hethub.layout_assemble import allocate_devices
from hethub.memo import clear_caches, reference_path
from hethub.plan import Pipeline, Plan, Recompute, Stage
from hethub.plan_parts import interleave
from hethub.predict.plan_costs import PlanCosts
from hethub.predict.predictor import floor_reaches, last_finish_s, predict, step_floor_s, sync_tail_s
from hethub.predict.sharding import stage_elems_of
from hethub.predict.sync import sync_groups
from hethub.predict.sync_overlap import exposed_sync_groups
from hethub.predict.sync_rules import two_level_allreduce_time_s
from hethub.search.split import PipeCost, Slot
from hethub.spec.cluster import Cluster, Link

CLUSTER = small_cluster(fast=8, slow=8, per_node=2)
# The kinds in two vendor islands: syncs across them take the bridge's two-level all-reduce.
BRIDGED = two_islands(CLUSTER)


def _random_plan(rng: random.Random, *, seq_len: int = 32, cluster: Cluster = CLUSTER) -> Plan:
    """Two to four pipelines of one to three stages on random nodes of CLUSTER, TP 1 or 2 (a node),
    sometimes SP or CP 2, a random layer split, micro-batch size and count, schedule and sharding."""
    model = tiny_model()
    nodes = {k: [list(range(i, i + 2)) for i in range(0 if k == "fast" else 8, 8 if k == "fast" else 16, 2)]
             for k in ("fast", "slow")}
    for ns in nodes.values():
        rng.shuffle(ns)
    cp = 2 if rng.random() < 0.2 else 1
    schedule = rng.choice(["1f1b", "zb-h1", "gpipe", "interleaved"])
    pipes = []
    for _ in range(rng.randint(2, 4)):
        n = rng.randint(2 if schedule == "interleaved" else 1, 3)
        cuts = sorted(rng.sample(range(1, model.num_layers), n - 1))
        bounds = [0, *cuts, model.num_layers]
        stages = []
        for si in range(n):
            kind = rng.choice([k for k in nodes if len(nodes[k]) >= cp] or ["none"])
            if kind == "none":
                break
            node = nodes[kind].pop()
            tp = 1 if cp == 2 else rng.choice([1, 2])
            devices = tuple(node[:tp]) if cp == 1 else (node[0], nodes[kind].pop()[0])
            sp = tp == 2 and rng.random() < 0.3
            stages.append(Stage(kind, devices, (bounds[si], bounds[si + 1]), embedding=si == 0, head=si == n - 1,
                                recompute=rng.choice(list(Recompute)), cp=cp, sequence_parallel=sp))
        if len(stages) < n:
            break
        p = Pipeline(rng.choice([1, 2]), rng.randint(n, 6), tuple(stages))
        if schedule == "interleaved":
            p = interleave(p, [[1, 1] if s.num_layers == 2 else [s.num_layers - 1, 1] if s.num_layers > 1
                                else [1, 0] for s in p.stages]) if all(s.num_layers >= 1 for s in p.stages) else p
        pipes.append(p)
    if schedule == "interleaved" and not all(p.virtual_stages > 1 for p in pipes):
        schedule = "1f1b"
        pipes = [dataclasses.replace(p, stages=tuple(dataclasses.replace(s, layers=s.layer_ranges[0], chunks=())
                                                     for s in p.stages)) if p.virtual_stages > 1 else p
                 for p in pipes]
    sharding = rng.choice(["none", "none", "zero1"]) if len(pipes) > 1 else "none"
    plan = Plan(model=model, cluster=cluster, global_batch=sum(p.num_samples for p in pipes), seq_len=seq_len,
                pipelines=tuple(pipes), schedule=schedule, optimizer_sharding=sharding)
    try:
        return plan.validate()
    except PlanError:  # a split the interleaving could not keep contiguous: plain stages instead
        return _random_plan(rng, seq_len=seq_len, cluster=cluster)


def _plans(seed: int, n: int, *, cluster: Cluster = CLUSTER) -> list[Plan]:
    rng = random.Random(seed)
    return [_random_plan(rng, seq_len=rng.choice([32, 64]), cluster=cluster) for _ in range(n)]


def _recomputed(plan: Plan) -> Plan:
    """``plan`` with every stage recomputing in full."""
    return dataclasses.replace(plan, pipelines=tuple(dataclasses.replace(p, stages=tuple(
        dataclasses.replace(s, recompute=Recompute.FULL) for s in p.stages)) for p in plan.pipelines)).validate()


def _swapped(plan: Plan) -> Plan:
    """``plan`` with the devices of its first two stages of one kind and grid swapped (else as it is)."""
    at = [(pi, si) for pi, p in enumerate(plan.pipelines) for si in range(len(p.stages))]
    stage = {x: plan.pipelines[x[0]].stages[x[1]] for x in at}
    pairs = [(a, b) for a, b in itertools.combinations(at, 2) if (stage[a].kind, len(stage[a].devices), stage[a].cp)
             == (stage[b].kind, len(stage[b].devices), stage[b].cp)]
    if not pairs:
        return plan
    a, b = pairs[0]
    devices = {a: stage[b].devices, b: stage[a].devices}
    return dataclasses.replace(plan, pipelines=tuple(dataclasses.replace(p, stages=tuple(
        dataclasses.replace(s, devices=devices.get((pi, si), s.devices)) for si, s in enumerate(p.stages)))
        for pi, p in enumerate(plan.pipelines))).validate()


def _moved(plan: Plan) -> Plan:
    """``plan`` with the first layer of the first pipeline's second stage moved to its first (plain
    stages with a layer to spare; else as it is)."""
    p = plan.pipelines[0]
    if len(p.stages) < 2 or p.virtual_stages > 1 or p.stages[1].num_layers < 2:
        return plan
    (a, b), (c, d) = p.stages[0].layers, p.stages[1].layers
    stages = (dataclasses.replace(p.stages[0], layers=(a, b + 1)), dataclasses.replace(p.stages[1], layers=(c + 1, d)),
              *p.stages[2:])
    return dataclasses.replace(plan, pipelines=(dataclasses.replace(p, stages=stages), *plan.pipelines[1:])).validate()


def _floors(plans: list[Plan]) -> list[tuple]:
    """The scoring's floors (one PlanCosts shared by plans of one job, as score_plans shares it), then
    each plan's prediction, op_times asked twice with the first answer changed in between."""
    out, costs = [], {}
    for plan in plans:
        c = costs.setdefault(plan.seq_len, PlanCosts(plan, None))
        ops = [c.op_times(p) for p in plan.pipelines]
        for lists in ops:
            for x in lists:
                x.append(-1.0)  # a caller's change must not reach the next reader
        tail, last = sync_tail_s(plan, costs=c, tight=True), last_finish_s(plan, costs=c)
        bar = (last + tail) * (1 - 1e-12)  # the last finish's screen, at its edge and about it
        reached = [floor_reaches(plan, b, costs=c, tight=True) for b in (bar * 0.999, bar, bar * 1.001, 1e-9)]
        out.append((step_floor_s(plan, costs=c, tight=True), tail, last, reached,
                    [c.op_times(p) for p in plan.pipelines], predict(plan)))
    return out


def _equal(got: list[tuple], ref: list[tuple]) -> None:
    for g, r in zip(got, ref, strict=True):
        assert g[:5] == r[:5]
        for f in dataclasses.fields(r[5]):
            assert getattr(g[5], f.name) == getattr(r[5], f.name), f.name


@pytest.mark.parametrize("seed", range(4))
def test_floors_and_predictions_equal_the_plain_path_on_random_replicas(seed: int) -> None:
    plans = _plans(seed, 6) + _plans(seed + 100, 3, cluster=BRIDGED)
    # The same pipelines (objects) in plans of another precision or sequence length; ZeRO-1 layouts
    # again with other recomputation, and with two stages' devices swapped.
    plans += [dataclasses.replace(plans[0], precision="fp32").validate(),
              dataclasses.replace(plans[1], seq_len=96 - plans[1].seq_len).validate()]
    for plan in [dataclasses.replace(p, optimizer_sharding="zero1") for p in plans[:4] if len(p.pipelines) > 1]:
        plans += [plan.validate(), _recomputed(plan), _swapped(plan)]
    with reference_path():
        ref = _floors(plans)
    clear_caches()
    _equal(_floors(plans), ref)
    _equal(_floors(plans), ref)  # from the memos the first pass filled


def test_boundaries_equal_the_plain_path_for_every_pair_size_and_piece() -> None:
    # Every ordered pair of stages of several plans (other sequence lengths, precisions and grids share
    # devices), at two micro-batch sizes, flat or not: one memo serves them all, in this mixed order.
    plans = _plans(7, 8)
    plans += [dataclasses.replace(p, precision="fp32").validate() for p in plans[:3]]

    def prices() -> list[float]:
        out = []
        for plan in plans:
            costs = PlanCosts(plan, None)
            stages = [s for p in plan.pipelines for s in p.stages]
            for a, b in itertools.permutations(stages, 2):
                out += [costs.boundary_s(a, b, mbs=mbs, flat=flat) for mbs in (1, 2) for flat in (True, False)]
        return out

    with reference_path():
        ref = prices()
    clear_caches()
    assert prices() == ref
    assert prices() == ref


def test_exposed_sync_memo_reads_the_backward_and_the_groups() -> None:
    plans = [p for p in _plans(11, 12) if not p.sharded_optimizer and p.zero_stage < 2][:4]
    assert plans

    def exposed() -> list[list]:
        out = []
        for plan in plans:
            groups = sync_groups(plan)
            stages = [(pi, si) for pi, p in enumerate(plan.pipelines) for si in range(len(p.stages))]
            for scale in (1e-3, 1e-9, 2e-3, 1e-3):  # the buckets hidden, exposed, hidden
                backward = {x: scale * (1 + i % 3) for i, x in enumerate(stages)}
                out.append(exposed_sync_groups(plan, groups, backward_s=backward))
                out.append(exposed_sync_groups(plan, groups[:-1], backward_s=backward))
                for elems in (2000, 7000):  # several buckets per group, one after another
                    out.append(exposed_sync_groups(plan, groups, backward_s=backward, bucket_elems=elems))
        return out

    with reference_path():
        ref = exposed()
    clear_caches()
    assert exposed() == ref


def test_two_level_allreduce_memo_reads_every_argument() -> None:
    rng = random.Random(3)
    links = [Link(rng.choice([10e9, 25e9]), rng.choice([1e-5, 3e-5])) for _ in range(4)]
    calls = [dict(elems=rng.choice([1000, 4096, 10**6]), elem_bytes=rng.choice([2.0, 4.0]),
                  island_links=rng.sample(links, 2), island_sizes=[rng.randint(1, 4), rng.randint(1, 4)],
                  bridge=rng.choice(links)) for _ in range(60)]
    with reference_path():
        ref = [two_level_allreduce_time_s(**kw) for kw in calls]
    clear_caches()
    assert [two_level_allreduce_time_s(**kw) for kw in calls] == ref


def test_free_nodes_are_handed_out_afresh_each_time() -> None:
    rng = random.Random(5)
    layouts = []
    for _ in range(20):
        pipes = []
        for _ in range(rng.randint(1, 3)):
            slots = tuple(Slot(rng.choice(["fast", "slow"]), rng.choice([1, 2])) for _ in range(rng.randint(1, 2)))
            n = len(slots)
            pipes.append(PipeCost(slots=slots, mbs=1, layers=(1,) * n, recompute=(False,) * n, fwd_s=(1.0,) * n,
                                  bwd_s=(1.0,) * n, update_s=(0.0,) * n, p2p_s=(0.0,) * (n - 1), params=(1.0,) * n,
                                  schedule="1f1b"))
        layouts.append(pipes)
    with reference_path():
        ref = [allocate_devices(CLUSTER, pipes) for pipes in layouts]
    clear_caches()
    assert [allocate_devices(CLUSTER, pipes) for pipes in layouts] == ref


def _broken(plan: Plan, rng: random.Random) -> Plan:
    """``plan`` with one stage's devices made wrong: another kind's, a TP group over two nodes, a
    device twice (in the stage or in another), or one past the cluster."""
    pi = rng.randrange(len(plan.pipelines))
    p = plan.pipelines[pi]
    si = rng.randrange(len(p.stages))
    s = p.stages[si]
    other = "slow" if s.kind == "fast" else "fast"
    wrong = rng.choice([
        (next(d.id for d in CLUSTER.devices if d.kind == other),) * len(s.devices),
        (s.devices[0], s.devices[0] + 2 if s.devices[0] % 8 < 6 else s.devices[0] - 2) if len(s.devices) == 2
        else (CLUSTER.num_devices,),
        (s.devices[0],) * len(s.devices),
        plan.pipelines[(pi + 1) % len(plan.pipelines)].stages[0].devices[:1] * len(s.devices),
    ])
    stages = tuple(dataclasses.replace(x, devices=wrong) if i == si else x for i, x in enumerate(p.stages))
    pipes = tuple(dataclasses.replace(q, stages=stages) if i == pi else q for i, q in enumerate(plan.pipelines))
    return dataclasses.replace(plan, pipelines=pipes)


def test_validation_refuses_as_the_plain_checks_do() -> None:
    rng = random.Random(9)
    plans = _plans(13, 10)
    cases = [*plans, *(_broken(p, rng) for p in plans for _ in range(3))]
    for plan in plans:  # a device twice in one stage (the stage's own checks pass)
        for pi, p in enumerate(plan.pipelines):
            for si, s in enumerate(p.stages):
                if len(s.devices) == 2 and s.cp == 1:
                    twice = dataclasses.replace(s, devices=(s.devices[0],) * 2)
                    stages = tuple(twice if i == si else x for i, x in enumerate(p.stages))
                    cases.append(dataclasses.replace(plan, pipelines=tuple(
                        dataclasses.replace(q, stages=stages) if i == pi else q for i, q in enumerate(plan.pipelines))))

    with reference_path():
        ref = validate_answers(cases)
    assert ref[:len(plans)] == ["ok"] * len(plans) and ref.count("ok") < len(cases) - len(plans)
    assert sum("reuses device" in r for r in ref) > len(plans)
    clear_caches()
    assert validate_answers(cases) == ref
    assert validate_answers(cases) == ref


def validate_answers(plans: list[Plan]) -> list[str]:
    """Each plan's `Plan.validate` answer: "ok" or its PlanError's message."""
    out = []
    for plan in plans:
        try:
            plan.validate()
            out.append("ok")
        except PlanError as e:
            out.append(str(e))
    return out


def test_a_stages_kept_fields_are_its_own() -> None:
    # Derived once per record, from its own fields: fresh records (replace, pickling) derive their own.
    rng = random.Random(1)
    for _ in range(200):
        cp = rng.choice([1, 2])
        devices = tuple(rng.sample(range(16), cp * rng.choice([1, 2, 4])))
        a = rng.randrange(0, 6)
        chunks = rng.choice([(), ((a, a + 1), (a + 3, a + 5)), ((a, a), (a + 2, a + 3), (a + 4, a + 8))])
        s = Stage("fast", devices, chunks[0] if chunks else (a, a + rng.randrange(0, 4)), chunks=chunks, cp=cp)
        ranges = chunks or (s.layers,)
        assert (s.tp, s.layer_ranges, s.num_layers, s.num_chunks) == (
            len(devices) // cp, ranges, sum(b - a for a, b in ranges), len(ranges))
        moved = dataclasses.replace(s, devices=devices + devices, layers=(a, a + 2), chunks=())
        assert (moved.tp, moved.layer_ranges, moved.num_layers, moved.num_chunks) == (
            2 * len(devices) // cp, ((a, a + 2),), 2, 1)
        assert (s.tp, s.layer_ranges) == (len(devices) // cp, ranges)
        again = pickle.loads(pickle.dumps(s))
        assert again == s and (again.tp, again.num_layers) == (s.tp, s.num_layers)
        p = Pipeline(1, 4, (s,))
        assert p.virtual_stages == len(ranges)


def test_shard_split_by_layout_equals_the_plain_path() -> None:
    # The ZeRO-1 split per stage (its ranks' largest slices) under stage weights with ties (the remainder
    # then goes by rank order), of layouts asked again with other recomputation, with stages' devices
    # swapped (another rank order) and with a layer moved.
    rng = random.Random(21)
    plans = []
    for plan in _plans(23, 10):
        if len(plan.pipelines) > 1:
            plan = dataclasses.replace(plan, optimizer_sharding="zero1").validate()
            plans += [plan, _recomputed(plan), _swapped(plan), _recomputed(_swapped(plan))]
            plans.append(_moved(plan))
    weights = [{(pi, si): float(rng.choice([1, 1, 2])) for pi, p in enumerate(plan.pipelines)
                for si in range(len(p.stages))} for plan in plans]
    with reference_path():
        ref = [stage_elems_of(plan, w) for plan, w in zip(plans, weights, strict=True)]
    clear_caches()
    assert [stage_elems_of(plan, w) for plan, w in zip(plans, weights, strict=True)] == ref
