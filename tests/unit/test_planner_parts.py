"""The planner's building blocks: layer split, batch allocation, device placement, closed form."""

import heapq
import itertools
import math

from hypothesis import given, settings
from hypothesis import strategies as st

from hethub.layout_assemble import allocate_devices
from hethub.predict.predictor import predict
from hethub.search import PlannerConfig
from hethub.search.combine import Group, allocate
from hethub.search.split import PipeCost, Slot
from hethub.search.templates import Searcher
from hethub.spec.cluster import parse_cluster
from hethub.spec.model import get_model


def _pipe(base: float, per: float) -> PipeCost:
    # fwd + bwd = per, and a fill/drain that makes base_s = base.
    return PipeCost(slots=(Slot("k", 1),), mbs=1, layers=(1,), recompute=(False,), fwd_s=(per / 3 + base / 2,),
                    bwd_s=(2 * per / 3 + base / 2,), update_s=(0.0,), p2p_s=(), params=(1.0,), schedule="gpipe")


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.floats(0.5, 5), st.floats(0.1, 3), st.integers(1, 3)), min_size=1, max_size=4),
       st.integers(1, 40))
def test_allocation_matches_greedy_min_max(specs, total):
    groups = [Group(_pipe(b, p), c) for b, p, c in specs]
    counts, makespan = allocate(groups, total)
    assert sum(sum(c) for c in counts) == total
    # Reference: give each micro-batch to the pipeline whose finish grows least.
    pipes = [g.pipe for g in groups for _ in range(g.count)]
    ms = [0] * len(pipes)
    heap = [(p.time_s(1), i) for i, p in enumerate(pipes)]
    heapq.heapify(heap)
    for _ in range(total):
        _, i = heapq.heappop(heap)
        ms[i] += 1
        heapq.heappush(heap, (pipes[i].time_s(ms[i] + 1), i))
    greedy = max(p.time_s(m) for p, m in zip(pipes, ms, strict=True) if m)
    assert makespan <= greedy * (1 + 1e-9)


def _searcher(cluster, model, **cfg):
    return Searcher(cluster=cluster, model=model, config=PlannerConfig(**cfg), profiles=None)


def test_split_minimises_the_bottleneck_like_brute_force():
    cluster = parse_cluster({"name": "two", "group": [{"kind": "a100-80gb", "nodes": 1, "devices_per_node": 4},
                                                      {"kind": "v100-16gb", "nodes": 1, "devices_per_node": 4}]},
                            where="test")
    model = get_model("llama-2-7b")
    s = _searcher(cluster, model, global_batch=64, seq_len=1024, micro_batch_sizes=(1,))
    slots = (Slot("a100-80gb", 2), Slot("v100-16gb", 4), Slot("a100-80gb", 1))
    best = s.splits(slots, 1)[0]
    bottleneck = max(f + b for f, b in zip(best.fwd_s, best.bwd_s, strict=True))
    brute = math.inf
    n = model.num_layers
    for a in range(n + 1):
        for b in range(1, n - a + 1):
            pc = s.fixed(slots, (a, b, n - a - b), 1)
            if pc is not None:
                brute = min(brute, max(f + bw for f, bw in zip(pc.fwd_s, pc.bwd_s, strict=True)))
    assert bottleneck <= brute * (1 + 1e-9)


def test_closed_form_stage_costs_agree_with_the_predictor():
    cluster = parse_cluster({"name": "one", "group": [{"kind": "h100-sxm", "nodes": 2, "devices_per_node": 8}]},
                            where="test")
    model = get_model("llama-2-13b")
    s = _searcher(cluster, model, global_batch=32, seq_len=2048)
    from hethub.layout_assemble import build_plan
    from hethub.search.combine import estimate

    pipe = s.splits((Slot("h100-sxm", 4),) * 2, 2)[0]
    est = estimate([Group(pipe, 2)], total_mb=16, links=s.links, model=model, precision="bf16-mixed")
    plan = build_plan(cluster=cluster, model=model, est=est, global_batch=32, seq_len=2048, schedule="1f1b",
                      precision="bf16-mixed", strategy="hethub")
    pred = predict(plan)
    for sp in pred.stages:
        assert math.isclose(sp.fwd_s, pipe.fwd_s[sp.stage], rel_tol=1e-9)
        assert math.isclose(sp.bwd_s, pipe.bwd_s[sp.stage], rel_tol=1e-9)
    assert pred.fits_memory
    assert math.isclose(est.step_time_s, pred.step_time_s, rel_tol=0.05)


def test_devices_are_packed_largest_tp_first_inside_nodes():
    cluster = parse_cluster({"name": "n", "group": [{"kind": "a100-80gb", "nodes": 2, "devices_per_node": 8}]},
                            where="test")
    pipes = [PipeCost(slots=(Slot("a100-80gb", t),) * n, mbs=1, layers=(1,) * n, recompute=(False,) * n,
                      fwd_s=(1.0,) * n, bwd_s=(1.0,) * n, update_s=(0.0,) * n, p2p_s=(0.0,) * (n - 1),
                      params=(1.0,) * n, schedule="1f1b") for t, n in ((1, 2), (4, 2), (2, 3))]
    out = allocate_devices(cluster, pipes)
    used = list(itertools.chain.from_iterable(itertools.chain.from_iterable(out)))
    assert len(used) == len(set(used)) == 2 + 8 + 6
    for stages in out:
        for devs in stages:
            assert len({cluster.devices[d].node for d in devs}) == 1


def test_reused_searches_enumerate_a_job_once(monkeypatch):
    # --compare's rows: within reused_searches a job's enumeration (mixed shapes, each kind alone) is
    # made once and priced by every search that asks it again (the same config, or another strategy),
    # with the plan it gives alone.
    from dataclasses import replace

    import hethub.search.planner as planner
    from conftest import small_cluster, tiny_model

    cluster, model = small_cluster(), tiny_model()
    config = PlannerConfig(global_batch=8, seq_len=32, micro_batch_sizes=(1, 2), polish=False)
    made, real = [], planner.enumerate_shapes
    monkeypatch.setattr(planner, "enumerate_shapes", lambda enums, **kw: made.append(kw) or real(enums, **kw))
    with planner.reused_searches():
        first = planner.make_plan(cluster=cluster, model=model, config=config)
        again = planner.make_plan(cluster=cluster, model=model, config=PlannerConfig(**vars(config)))
        planner.make_plan(cluster=cluster, model=model, config=replace(config, strategy="homogeneous"))
    assert made == [{"mixed": True, "alone": True}]
    assert again.plan.pipelines == first.plan.pipelines
    with planner.reused_searches():  # the kind-alone shapes first, the mixed ones when a row asks them
        planner.make_plan(cluster=cluster, model=model, config=replace(config, strategy="homogeneous"))
        assert planner.make_plan(cluster=cluster, model=model, config=config).plan.pipelines == first.plan.pipelines
    assert made[1:] == [{"mixed": False, "alone": True}, {"mixed": True, "alone": False}]
    alone = planner.make_plan(cluster=cluster, model=model, config=config)  # outside: enumerated again
    assert len(made) == 4 and alone.plan.pipelines == first.plan.pipelines


def test_the_default_path_gives_the_same_plan_under_a_slow_clock(monkeypatch):
    # The polish's budget is counted in predictions (planner.POLISH_BUDGETS), so a loaded machine,
    # here a clock that runs 1,000x fast, changes nothing the search chooses.
    import time

    import hethub.search.planner as planner

    cluster = parse_cluster({"name": "two", "group": [{"kind": "a100-80gb", "nodes": 1, "devices_per_node": 4},
                                                      {"kind": "v100-16gb", "nodes": 1, "devices_per_node": 4}]},
                            where="test")
    config = PlannerConfig(global_batch=32, seq_len=1024, schedule="auto", optimizer_sharding="auto")
    model = get_model("llama-2-7b")
    calm = planner.make_plan(cluster=cluster, model=model, config=config)
    real = time.perf_counter
    monkeypatch.setattr(time, "perf_counter", lambda: 1000 * real())
    busy = planner.make_plan(cluster=cluster, model=model, config=config)
    assert busy.plan.to_dict()["pipelines"] == calm.plan.to_dict()["pipelines"]
    assert busy.prediction.step_time_s == calm.prediction.step_time_s
    assert busy.search_time_s > 100 * calm.search_time_s  # the clock did run fast


def test_the_polish_budget_is_set_by_the_plan_size_alone():
    # planner.polish_budget: POLISH_BUDGETS on plans up to POLISH_FULL_DEVICES devices, then fewer
    # predictions as each costs more (budget x devices bounded), never none; the plan fixes it.
    from types import SimpleNamespace

    import hethub.search.planner as planner

    def budgets(devices):
        return tuple(planner.polish_budget(i, SimpleNamespace(world_size=devices)) for i in range(3))

    full = planner.POLISH_FULL_DEVICES
    assert budgets(8) == budgets(full) == planner.POLISH_BUDGETS == (16, 6, 6)
    assert budgets(2 * full) == (8, 3, 3) and budgets(4 * full) == (4, 1, 1) and budgets(64 * full) == (1, 1, 1)
    for n in (full, 2 * full, 4 * full):
        assert budgets(n)[0] * n <= planner.POLISH_BUDGETS[0] * full


def test_the_default_path_shows_one_progress_bar(monkeypatch):
    # `hethub plan`'s defaults (schedule and sharding auto) price every variant from one enumeration
    # per sharding inside one search: one bar, where six searches each showed their own.
    import hethub.search.planner as planner

    bars = []
    real = planner.progress

    def counted(*args, **kwargs):
        bars.append(kwargs.get("desc"))
        return real(*args, **kwargs)

    monkeypatch.setattr(planner, "progress", counted)
    cluster = parse_cluster({"name": "two", "group": [{"kind": "a100-80gb", "nodes": 1, "devices_per_node": 4},
                                                      {"kind": "v100-16gb", "nodes": 1, "devices_per_node": 4}]},
                            where="test")
    result = planner.make_plan(cluster=cluster, model=get_model("llama-2-7b"),
                               config=PlannerConfig(global_batch=32, seq_len=1024, schedule="auto",
                                                    optimizer_sharding="auto", micro_batch_sizes=(1, 2)))
    assert bars == ["plan two"]
    assert any(n.startswith("schedule ") for n in result.notes)
    assert any(n.startswith("optimizer sharding: ") for n in result.notes)


def test_a_search_pauses_the_collector_and_leaves_no_reference_cycles():
    # memo.search_scope, which make_plan opens: the collector is off during the search and as it was after; a
    # search's caches hold no reference cycles, so they are freed when it returns, not by the collector.
    import gc

    import hethub.search.planner as planner

    cluster = parse_cluster({"name": "two", "group": [{"kind": "a100-80gb", "nodes": 1, "devices_per_node": 8},
                                                      {"kind": "v100-16gb", "nodes": 1, "devices_per_node": 8}]},
                            where="test")
    seen = []
    search = planner._make_plan

    def spy(**kw):
        seen.append(gc.isenabled())
        return search(**kw)

    was = gc.isenabled()
    try:
        gc.enable()
        gc.collect()
        planner._make_plan = spy
        planner.make_plan(cluster=cluster, model=get_model("llama-2-7b"),
                          config=PlannerConfig(global_batch=32, seq_len=1024, polish=False, micro_batch_sizes=(1, 2)))
        assert seen == [False] and gc.isenabled()
        gc.disable()
        planner.make_plan(cluster=cluster, model=get_model("llama-2-7b"),
                          config=PlannerConfig(global_batch=32, seq_len=1024, polish=False, micro_batch_sizes=(1, 2)))
        assert not gc.isenabled()  # a caller's paused collector stays paused
        assert gc.collect() == 0
    finally:
        planner._make_plan = search
        if was:
            gc.enable()


def test_the_second_fan_out_starts_the_groups_then_the_kind_parts_largest_pool_first():
    from hethub.search.planner import task_order

    assert task_order(3, [65, 12, 76]) == [0, 1, 2, 5, 3, 4]
    assert task_order(1, [5, 7, 5]) == [0, 2, 1, 3]  # ties in kind order
    assert task_order(2, []) == [0, 1]


def test_the_kind_alone_searches_are_tasks_after_the_mixed_ones(monkeypatch):
    # Cut apart, the enumeration gives what each searcher's mixed and kind-alone searches give in turn.
    import hethub.search.variants as variants
    from conftest import small_cluster, tiny_model
    from hethub.predict.stage_links import LinkBook

    config = PlannerConfig(global_batch=8, seq_len=32, micro_batch_sizes=(1, 2), schedule="auto")
    cluster = small_cluster()
    enums = [v.searcher(config, cluster=cluster, model=tiny_model(), profiles=None, holders=8,
                        links=LinkBook(cluster, runtime=config.runtime))
             for v in variants.enumeration_variants(*variants.variants_of(config))]
    sizes, real = [], variants.fan_out
    monkeypatch.setattr(variants, "fan_out", lambda tasks, **kw: sizes.append(len(tasks)) or real(tasks, **kw))
    shapes, alone = variants.enumerate_shapes(enums)
    assert len(enums) == 2 and sizes == [4]
    assert shapes == variants._in_turns([variants._mixed(s) for s in enums])
    each = [variants._alone(s) for s in enums]
    assert alone == {k: variants._in_turns([e[i] for e in each]) for i, k in enumerate(enums[0].counts)}
    assert variants.enumerate_shapes(enums, mixed=False) == ([], alone) and sizes[-1] == 2
    assert variants.enumerate_shapes(enums, alone=False) == (shapes, {}) and sizes[-1] == 2
