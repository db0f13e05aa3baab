"""The planner's pruning: every bound it skips work with must hold, and skipping must not change
what the search keeps (its top templates, its finalists, the allocation it prices)."""

import itertools
import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import hethub.search.bounds as bounds
import hethub.search.templates as templates
from hethub.predict.holding import smallest_holding
from hethub.predict.water import finish_lines, lines_level_beside, water_level
from hethub.search import PlannerConfig
from hethub.search.bounds import PipeFloor, pipe_floor, rate_bound
from hethub.search.combine import Group, allocate
from hethub.search.hetero import TOP_PER_KIND, Results, _top_distinct
from hethub.search.split import CostBook, Job, Slot, StageCost
from hethub.search.templates import Searcher
from hethub.spec.cluster import parse_cluster
from hethub.spec.model import get_model

KINDS = ("h100-sxm", "a100-80gb", "v100-16gb")


def _cluster(nodes: int = 4):
    return parse_cluster({"name": "three", "group": [{"kind": k, "nodes": nodes, "devices_per_node": 8}
                                                     for k in KINDS]}, where="test")


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 5), st.floats(0.01, 3), st.integers(1, 40)), min_size=1, max_size=6),
       st.integers(1, 3000))
def test_water_level_is_the_allocation_makespan(specs, total):
    groups = [Group(PipeFloor(a, b), c) for a, b, c in specs]
    _, makespan = allocate(groups, total)
    assert water_level(groups, total) == pytest.approx(makespan, rel=1e-9)


def _scan_max_layers(sm: StageCost, emb: bool, head: bool, in_flight: int, limit: int) -> int:
    fits = [n for n in range(limit + 1)
            if sm.memory_bytes(n, emb=emb, head=head, in_flight=in_flight) <= sm.capacity_bytes]
    return -1 if not fits else max(fits)


def test_max_layers_is_what_a_scan_of_stage_memory_finds():
    cluster = _cluster(1)
    for model_name, precision in (("llama-2-13b", "bf16-mixed"), ("llama-2-70b", "fp32")):
        model = get_model(model_name)
        book = CostBook(Job(model=model, seq_len=4096, precision=precision, schedule="1f1b"), cluster)
        for kind, tp, mbs, rc in itertools.product(KINDS, (1, 8), (1, 4), (False, True)):
            sm = book.stage(kind, tp=tp, mbs=mbs, recompute=rc)
            for emb, head, in_flight in itertools.product((False, True), (False, True), (1, 3, 17)):
                assert sm.max_layers(emb=emb, head=head, in_flight=in_flight, limit=model.num_layers) == \
                    _scan_max_layers(sm, emb, head, in_flight, model.num_layers)


@pytest.mark.parametrize(("model_name", "mbs", "schedule"),
                         [("llama-2-13b", 2, "1f1b"), ("llama-2-70b", 1, "1f1b"), ("llama-2-70b", 4, "1f1b"),
                          ("llama-2-70b", 2, "gpipe"), ("llama-2-70b", 2, "zb-h1"), ("llama-2-13b", 4, "zb-h1")])
def test_rate_bound_is_above_every_split_of_the_template(model_name, mbs, schedule):
    # llama-2-70b at micro-batch 4 and beyond: every stage recomputes, where the bound's mode-aware
    # bottleneck (bounds.Capacity.mode_bottleneck) does the tightening and so must stay below the splits.
    cluster = _cluster()
    s = Searcher(cluster=cluster, model=get_model(model_name),
                 config=PlannerConfig(global_batch=256, seq_len=4096, schedule=schedule), profiles=None)
    for kind, share in itertools.product(KINDS, (1.0, 0.3)):
        n = s.counts[kind]
        for tp in s.tps[kind]:
            for p in range(1, min(n // tp, s.model.num_layers) + 1):
                bound = rate_bound(s.book, s.links, kind=kind, tp=tp, mbs=mbs, p=p, kind_devices=n,
                                   global_batch=256, share=share)
                pipes = s.splits((Slot(kind, tp),) * p, mbs)
                if bound == 0:
                    assert not pipes
                for pipe in pipes:
                    assert s.rate(pipe, kind_devices=n, share=share) <= bound * (1 + 1e-9)


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(("llama-2-13b", "llama-2-70b")), st.sampled_from(("1f1b", "zb-h1", "gpipe")),
       st.sampled_from(KINDS), st.sampled_from((1, 2, 4, 8)), st.sampled_from((1, 2, 4)), st.integers(1, 82))
def test_loose_rate_bounds_are_above_the_bound_and_every_split(model_name, schedule, kind, tp, mbs, p):
    # GRID reads each stage's capacity at a smaller in-flight count (`bounds._grid`), so it holds only
    # because a stage holding more micro-batches holds no more layers (the test below).
    s = Searcher(cluster=_cluster(), model=get_model(model_name),
                 config=PlannerConfig(global_batch=256, seq_len=4096, schedule=schedule), profiles=None)
    n = s.counts[kind]
    if tp not in s.tps[kind] or p * tp > n:
        return
    exact, grid, blind = (rate_bound(s.book, s.links, kind=kind, tp=tp, mbs=mbs, p=p, kind_devices=n, global_batch=256,
                                     share=0.5, loose=tier) for tier in (bounds.EXACT, bounds.GRID, bounds.BLIND))
    assert blind >= exact and grid >= exact
    for pipe in s.splits((Slot(kind, tp),) * p, mbs):
        assert s.rate(pipe, kind_devices=n, share=0.5) <= exact * (1 + 1e-9)


@settings(max_examples=30, deadline=None)
@given(st.sampled_from(KINDS), st.sampled_from((1, 8)), st.sampled_from((1, 4)), st.integers(0, 5),
       st.booleans(), st.booleans(), st.integers(1, 90))
def test_a_stage_holding_more_micro_batches_holds_no_more_layers(kind, tp, mbs, mode, emb, head, in_flight):
    model = get_model("llama-2-70b")
    book = CostBook(Job(model=model, seq_len=4096, precision="bf16-mixed", schedule="1f1b"), _cluster(1))
    modes = book.modes(kind, tp=tp, mbs=mbs)
    sm = modes[mode % len(modes)]
    caps = [sm.max_layers(emb=emb, head=head, in_flight=f, limit=model.num_layers) for f in (in_flight, in_flight + 1)]
    assert caps[0] >= caps[1]
    assert in_flight >= bounds._grid(in_flight) >= in_flight * 4 / 5


def test_the_grid_bound_is_tighter_where_memory_binds_and_spares_exact_bounds(monkeypatch):
    # llama-2-70b on single H100s: most stage counts recompute or do not fit, which the memory-blind
    # bound cannot see; the seeds then compute fewer exact bounds (and the same seeds) than with it alone.
    def searcher() -> Searcher:
        return Searcher(cluster=_cluster(), model=get_model("llama-2-70b"), profiles=None,
                        config=PlannerConfig(global_batch=256, seq_len=4096, schedule="zb-h1"))

    s, kind = searcher(), "h100-sxm"
    tighter = 0
    for p in range(1, 33):
        args = dict(kind=kind, tp=1, mbs=2, p=p, kind_devices=32, global_batch=256, share=1.0)
        grid, blind = (rate_bound(s.book, s.links, **args, loose=t) for t in (bounds.GRID, bounds.BLIND))
        tighter += grid < blind * 0.95
    assert tighter >= 10
    real, counted = bounds.rate_bound, []

    def counting(*args, loose: int = bounds.EXACT, blind: bool = False, **kw) -> float:
        counted.append(loose == bounds.EXACT)
        return real(*args, loose=bounds.BLIND if blind and loose == bounds.GRID else loose, **kw)

    seen = []
    for blind in (False, True):
        monkeypatch.setattr(templates, "rate_bound", lambda *a, blind=blind, **kw: counting(*a, blind=blind, **kw))
        counted.clear()
        seen.append((searcher().seeds(kind, 2, share=1.0), sum(counted)))
    assert seen[0][0] == seen[1][0] and seen[0][1] < seen[1][1]


def test_pipe_floor_is_below_every_split_of_a_mixed_pipeline():
    cluster = _cluster()
    s = Searcher(cluster=cluster, model=get_model("llama-2-13b"), config=PlannerConfig(global_batch=256, seq_len=2048),
                 profiles=None)
    # Several stages in the last segment: the head's base once, not once per stage (a floor above
    # real splits by ~0.3% before); TP-1 middle stages: each holds at least one layer.
    for segs in ((("h100-sxm", 4, 2), ("a100-80gb", 4, 2)), (("v100-16gb", 8, 3), ("h100-sxm", 2, 1)),
                 (("a100-80gb", 1, 5), ("v100-16gb", 4, 4), ("h100-sxm", 8, 1)),
                 (("a100-80gb", 4, 2), ("h100-sxm", 1, 8)), (("h100-sxm", 1, 24), ("a100-80gb", 1, 6))):
        for mbs in (1, 2):
            floor = pipe_floor(s.book, s.links, segs, mbs)
            pipes = s.mixed(segs, mbs)
            assert pipes and floor is not None
            for pipe in pipes:
                for m in (1, 2, 7, 64):
                    assert floor.time_s(m) <= pipe.time_s(m) * (1 + 1e-9), (segs, mbs, m)


@pytest.mark.parametrize(("model_name", "sizes"), [("llama-2-13b", (1, 2, 4)), ("llama-2-70b", (4, 1))])
def test_pruned_scan_keeps_the_top_templates_and_their_rates(monkeypatch, model_name, sizes):
    # The pruned scan splits its seeds first (Searcher._seeds), then skips stage counts under the bar;
    # llama-2-70b recomputes everywhere at micro-batch 4, where the rate bound's mode-aware bottleneck
    # prunes. Kind-alone shares (1.0) and the combined search's, each size after the others.
    cluster = _cluster(6)  # 144 devices: the scan prunes
    model = get_model(model_name)

    def tops():
        s = Searcher(cluster=cluster, model=model, config=PlannerConfig(global_batch=512, seq_len=4096),
                     profiles=None)
        return {(k, b, share): [(r.pipe.layers, r.pipe.recompute, r.rate)
                                for r in _top_distinct(s.pure(k, b, share=share), TOP_PER_KIND)]
                for k in KINDS for b in sizes for share in (s.share[k], 1.0)}

    pruned = tops()
    # Unpruned, with the large cluster's layer splits (SMALL_CLUSTER also turns on the slack splits
    # that trade bottleneck for fill and drain, which may find another split of a stage count).
    split_layers = templates.split_layers
    monkeypatch.setattr(templates, "split_layers", lambda *a, **kw: split_layers(*a, **{**kw, "slacks": (1.0,)}))
    monkeypatch.setattr(templates, "SMALL_CLUSTER", 10**9)
    assert tops() == pruned


def test_results_track_the_best_distinct_candidates():
    cluster = _cluster(1)
    s = Searcher(cluster=cluster, model=get_model("llama-2-7b"), config=PlannerConfig(global_batch=64, seq_len=2048),
                 profiles=None)
    ests = []
    for kind, tp, p in itertools.product(KINDS, (2, 4), (1, 2, 4)):
        for pipe in s.splits((Slot(kind, tp),) * p, 2):
            ests.append(s.estimate([Group(pipe, 8 // (tp * p) or 1)], 2))
    results = Results(keep=5)
    for est in ests + ests:  # duplicates take one place
        results.add(est)
    best = sorted({e.step_time_s for e in ests if e is not None})[:5]
    assert [step for step, *_ in results._best.entries] == best
    assert not results.may_enter(best[-1] * 1.001) and results.may_enter(best[-1] * 0.999)


def test_merged_bound_takes_each_kinds_best_fitting_part_over_the_variants():
    from types import SimpleNamespace

    from hethub.commands.compare import merged_bound

    def result(parts, relaxed=()):
        return SimpleNamespace(upper_bound_by_kind=parts, relaxed_kinds=frozenset(relaxed))

    # A relaxed-memory part (no plan that fits) loses to a smaller part that fits from another search.
    parts, relaxed = merged_bound([result({"a": 10.0, "b": 5.0}, relaxed={"b"}), result({"a": 8.0, "b": 4.0})])
    assert parts == {"a": 10.0, "b": 4.0} and relaxed == frozenset()
    # Where no search fits a kind, its best relaxed part stands, and it is reported as relaxed.
    parts, relaxed = merged_bound([result({"a": 7.0, "b": 5.0}, relaxed={"b"}), result({"a": 9.0, "b": 6.0}, {"b"})])
    assert parts == {"a": 9.0, "b": 6.0} and relaxed == frozenset({"b"})


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_pipe_floor_per_recompute_mode_is_below_random_splits(schedule):
    # The floors take each recomputation mode with its own capacity and cost (none, selective, full);
    # on random mixed pipelines of a large model, where stages need full recomputation, every split
    # (with and without recomputation) must stay above the floor, and the no-recomputation floor above
    # nothing but the no-recomputation splits. ZB-H1: its fill floor (a third of the work).
    import random

    from hethub.search.split import split_layers

    rng = random.Random(17)
    cluster = _cluster()
    checked = 0
    for model_name, seq in (("llama-2-70b", 4096), ("llama-2-13b", 4096), ("llama-3-8b", 8192)):
        s = Searcher(cluster=cluster, model=get_model(model_name),
                     config=PlannerConfig(global_batch=256, seq_len=seq, schedule=schedule), profiles=None)
        for _ in range(12):
            kinds = rng.sample(KINDS, rng.choice((2, 3)))
            segs = tuple((k, rng.choice(s.tps[k]), rng.randint(1, 12)) for k in kinds)
            mbs = rng.choice((1, 2))
            hint = s.in_flight_hint(sum(t * n for _, t, n in segs), mbs)
            slots = s.mixed_slots(segs)
            for recompute in (True, False):
                floor = pipe_floor(s.book, s.links, segs, mbs, in_flight_hint=hint, recompute=recompute)
                pipes = split_layers(s.book, slots, mbs=mbs, allow_recompute=recompute, hops=s.links.pipe_hops,
                                     in_flight_hint=hint, slacks=(1.0, 1.5, float("inf")))
                if floor is None:
                    assert not pipes
                for pipe in pipes:
                    checked += 1
                    for m in (1, 4, 32):
                        assert floor.time_s(m) <= pipe.time_s(m) * (1 + 1e-9), (segs, mbs, recompute, m)
    assert checked > 40


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 6),
                          st.lists(st.tuples(st.integers(-1, 12), st.floats(0.1, 3), st.floats(0, 4)), min_size=1,
                                   max_size=3)), min_size=1, max_size=5),
       st.integers(1, 40), st.floats(0, 20))
def test_smallest_holding_is_the_first_time_the_stages_hold_every_layer(groups, n_layers, lo):
    # Brute force: a stage holds the most j whose some mode has capacity >= j and base + j w <= B (-1
    # before its cheapest base); the answer is the least candidate time >= lo where the stages hold L.
    caps = [(k, tuple(modes)) for k, modes in groups]

    def held(b: float) -> int:
        total = 0
        for k, modes in caps:
            fits = [j for cap, w, base in modes for j in range(cap + 1) if base + j * w <= b]
            total += k * max(fits, default=-1)
        return total

    times = sorted({lo} | {base + j * w for _, modes in caps for cap, w, base in modes for j in range(cap + 1)
                           if base + j * w >= lo})
    want = next((b for b in times if held(b) >= n_layers), None)
    got = smallest_holding(caps, n_layers, lo)
    if want is None:
        assert got is None
    else:
        assert got is not None and got <= want and got == pytest.approx(want, rel=1e-9, abs=1e-12)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 5), st.floats(0.05, 3), st.integers(1, 6)), max_size=4),
       st.floats(0, 6), st.floats(0.05, 2), st.integers(0, 12), st.integers(1, 120))
def test_water_level_beside_a_stream_is_the_first_time_the_batch_is_done(specs, start, per, at_start, total):
    # mixed._rate_level's floor: brute force over every finish time of the groups and the stream.
    groups = [Group(PipeFloor(a, b), c) for a, b, c in specs]

    def finished(t: float) -> int:
        stream = at_start + math.floor((t - start) / per + 1e-12) if t >= start else 0
        return sum(c * max(0, math.floor((t - a) / b + 1e-12)) for a, b, c in specs) + stream

    times = sorted({a + k * b for a, b, _ in specs for k in range(1, total + 1)}
                   | {start + k * per for k in range(0, total + 1)})
    want = next(t for t in times if finished(t) >= total)
    got = lines_level_beside(finish_lines(groups), total, start_s=start, per_s=per, at_start=at_start)
    assert got == pytest.approx(want, rel=1e-9, abs=1e-12)


def _segment_memory_stage_by_stage(book, kind, tp, mbs, flights, first, last, n_modes, mid):
    """segments.segment_memory as a plain loop over the stages (its definition)."""
    from hethub.search.bounds import stage_modes
    by_cap, plain, one, n = {}, 0, [], len(flights)
    for i, f in enumerate(flights):
        emb, head = first and i == 0, last and i == n - 1
        modes = stage_modes(book, kind, tp, mbs, emb, head, f)[:n_modes]
        if max(c for c, _, _ in modes) < 0:
            return None
        one.append(0.0 if emb or head else min([w for c, w, _ in modes if c >= 1] or [mid]))
        by_cap[modes] = by_cap.get(modes, 0) + 1
        plain += max(modes[0][0], 0)
    held = sum(k * max(c for c, _, _ in modes) for modes, k in by_cap.items())
    return by_cap, plain, one[0], one[-1], max(one), held


def test_segment_memory_by_runs_is_the_stage_by_stage_sum():
    # pipe_floor's segments read their middle stages off runs of equal modes (counts running down by
    # one, as 1F1B gives them) or count by count: both must be the stage-by-stage loop exactly.
    from hethub.predict.holding import undominated
    from hethub.search.bounds import segment_memory
    s = Searcher(cluster=_cluster(4), model=get_model("llama-2-70b"),
                 config=PlannerConfig(global_batch=256, seq_len=4096), profiles=None)
    checked = infeasible = 0
    for kind, tp, mbs, n_modes in itertools.product(KINDS, (1, 4), (1, 4), (1, 3)):
        for top, n in itertools.product((1, 2, 5, 17, 40, 82), (1, 2, 3, 9, 40)):
            if n > top:
                continue
            # Counts running down by one (1F1B), alike (ZB-H1), up, the GRID bound's rounded runs, and repeats apart.
            for flights in (tuple(range(top, top - n, -1)), (top,) * n, tuple(range(1, n + 1)),
                            tuple(map(bounds._grid, range(top, top - n, -1))), (top, 1) * (n // 2) + (top,) * (n % 2)):
                for first, last in itertools.product((False, True), repeat=2):
                    got = segment_memory(s.book, kind, tp, mbs, flights, first, last, n_modes, 0.5)
                    want = _segment_memory_stage_by_stage(s.book, kind, tp, mbs, flights, first, last, n_modes, 0.5)
                    if want is None:
                        assert got is None
                        infeasible += 1
                        continue
                    caps, plain, one_first, one_last, one_max, held, _ = got
                    groups: dict = {}
                    for k, modes in caps:
                        groups[modes] = groups.get(modes, 0) + k
                    by_cap, *rest = want  # the kept groups' modes are each stage's undominated ones
                    kept: dict = {}
                    for modes, k in by_cap.items():
                        kept[undominated(modes)] = kept.get(undominated(modes), 0) + k
                    assert (groups, plain, one_first, one_last, one_max, held) == (kept, *rest)
                    checked += 1
    assert checked > 1000 and infeasible > 50


def test_mode_bottleneck_is_the_segment_floor_of_its_stages():
    # Capacity.mode_bottleneck reads a middle stage's least one-layer work off the stage models (no
    # segment_terms) and the in-flight bounds alone (no capacity totals): the plain segment floor.
    from hethub.search.bounds import ALL_MODES, capacity, segment_memory, segment_terms
    def searcher() -> Searcher:  # a model object of its own: books share no floors (segment_memory keeps mid's)
        return Searcher(cluster=_cluster(4), model=get_model("llama-2-70b"),
                        config=PlannerConfig(global_batch=256, seq_len=4096), profiles=None)

    s, plain = searcher(), searcher()
    rng, checked = random.Random(3), 0
    for kind, tp, mbs, grid in itertools.product(KINDS, (1, 4), (1, 2, 8), (False, True)):
        caps = capacity(s.book, kind, tp=tp, mbs=mbs)
        for p in sorted(rng.sample(range(1, 83), 12)):
            lo = rng.uniform(0.0, 0.05)
            got = caps.mode_bottleneck(s.book, p, lo=lo, grid=grid)
            flights = tuple(caps.schedule.max_in_flight(stage=i, num_stages=p) for i in range(p))
            mid = segment_terms(plain.book, kind, tp, p, mbs, True, True, ALL_MODES)[4]
            seg = segment_memory(plain.book, kind, tp, mbs, tuple(map(bounds._grid, flights)) if grid else flights,
                                 True, True, ALL_MODES, mid)
            assert got == (None if seg is None else smallest_holding(seg[0], s.model.num_layers, lo))
            # what it left in the floors' cache for pipe_floor (whose mid is segment_terms')
            assert segment_memory(s.book, kind, tp, mbs, tuple(map(bounds._grid, flights)) if grid else flights,
                                  True, True, ALL_MODES, math.nan) == seg
            checked += got is not None
    assert checked > 50


def test_runs_count_each_value_of_a_range_of_counts():
    # holding.Runs: the floors read a range of in-flight counts' modes by runs of equal values.
    from hethub.predict.holding import Runs
    rng = random.Random(5)
    values = [rng.choice("aab") for _ in range(60)]
    runs = Runs()
    for v in values:
        runs.add(v)
    assert runs.last == 60 and len(runs.runs) < 60
    for _ in range(200):
        lo = rng.randint(1, 60)
        hi = rng.randint(lo, 60)
        got = runs.counts(lo, hi)
        assert sum(k for _, k in got) == hi - lo + 1 and all(k > 0 for _, k in got)
        assert [v for v, k in got for _ in range(k)] == values[lo - 1:hi]
        assert runs.value(hi) == values[hi - 1]
