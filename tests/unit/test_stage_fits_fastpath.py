"""The laid-out plans' memory checks at scale give the plain rules' answers exactly: each stage's
optimizer slice found per stage (``sharding.stage_elems_of``) equals the largest over its ranks of the
per-rank split (``rank_shards``) on random layouts (mixed and equal TP degrees in one sync group, CP,
ranks in any order, ties and zero weights); ``split_elems`` is the largest-remainder rule; and
``StageFits.under``, ``ModeFits.fits``, ``fits_some_mode`` and ``choose_recompute`` answer as on the reference path
(hethub/memo.py) for plans covering ZeRO 0-3, equal and proportional shares, SP, CP, interleaving
and replicas that differ only in their sequence parallelism, for all stages or some; the screen's
bounds on each stage's slice (``stage_elems_bounds``) hold the exact slice; and the layout caches
tell plans apart by everything their values depend on."""

from __future__ import annotations

import itertools
import random
from dataclasses import replace

import pytest

from conftest import EXAMPLES, small_cluster, tiny_model
from hethub.errors import PlanError
from hethub.layout import split_elems, stage_places
from hethub.memo import clear_caches, reference_path
from hethub.plan import Pipeline, Plan, Recompute, Stage
from hethub.plan_parts import interleave
from hethub.predict import shard_memory
from hethub.predict.memory import StageMemory
from hethub.predict.plan_costs import PlanCosts
from hethub.predict.predictor import predict
from hethub.predict.sharding import (
    bucket_sums,
    buckets,
    layout_key,
    rank_shards,
    rank_weights,
    stage_elems_bounds,
    stage_elems_of,
    stage_shard_elems,
)
from hethub.predict.stage_fits import StageFits
from hethub.predict.stage_modes import ModeFits, choose_recompute, fits_some_mode, stage_modes
from hethub.predict.zero23_bytes import zero23_stage_bytes
from hethub.spec.model import ModelSpec


def _plain_split(n: int, weights: list[float]) -> list[int]:
    """The largest-remainder rule as written before split_elems grouped equal weights."""
    w = [max(0.0, float(x)) for x in weights]
    total = sum(w)
    if total <= 0:
        w, total = [1.0] * len(weights), float(len(weights))
    exact = [n * x / total for x in w]
    sizes = [int(e) for e in exact]
    order = sorted(range(len(w)), key=lambda i: (-(exact[i] - sizes[i]), i))
    for i in order[:n - sum(sizes)]:
        sizes[i] += 1
    return sizes


def test_split_elems_is_the_largest_remainder_rule() -> None:
    rng = random.Random(7)
    for _ in range(5_000):
        pool = [rng.choice([0.0, -1.0, 0.1, 1 / 3, 2.0, 3e9 + 0.5, rng.random(), rng.uniform(-1, 5)]) for _ in range(3)]
        w = [rng.choice(pool) for _ in range(rng.randint(0, 12))]
        n = rng.choice([0, 1, 3, 7, 12345, 40_000_000, rng.randint(0, 10**9)])
        assert split_elems(n, w) == _plain_split(n, w), (n, w)


def _random_plan(rng: random.Random, sharding: str, model: ModelSpec | None = None) -> Plan | None:
    cluster = small_cluster(fast=16, slow=16, per_node=8)
    model = model or tiny_model(8)
    free = {"fast": list(range(16)), "slow": list(range(16, 32))}
    for ids in free.values():
        rng.shuffle(ids)  # a stage's devices, so its ranks, in any order
    pipes = []
    for _ in range(rng.randint(2, 4)):
        n, cp = rng.randint(1, 3), rng.choice([1, 1, 2])
        cuts = sorted(rng.sample(range(1, model.num_layers), n - 1))
        bounds = [0, *cuts, model.num_layers]
        stages = []
        for i in range(n):
            kind = rng.choice(["fast", "slow"])
            tp = rng.choice([1, 2, 2, 4])
            if len(free[kind]) < tp * cp:
                return None
            devs, free[kind] = tuple(free[kind][:tp * cp]), free[kind][tp * cp:]
            stages.append(Stage(kind, devs, (bounds[i], bounds[i + 1]), embedding=i == 0, head=i == n - 1, cp=cp))
        pipes.append(Pipeline(1, rng.randint(1, 4), tuple(stages)))
    try:
        return Plan(model=model, cluster=cluster, global_batch=sum(p.num_samples for p in pipes), seq_len=32,
                    pipelines=tuple(pipes), optimizer_sharding=sharding).validate()
    except PlanError:
        return None


def test_the_per_stage_slices_are_the_largest_rank_slices() -> None:
    rng = random.Random(3)
    checked = mixed = same_tp = 0
    while checked < 60:
        plan = _random_plan(rng, "zero1")
        if plan is None:
            continue
        places = stage_places(plan)
        pool = [rng.choice([0.0, -2.0, 1.0, 1 / 3, rng.random() * 1e10]) for _ in range(3)]
        for weights in ({(st.pipeline, st.stage): rng.choice(pool) for st in places},
                        {(st.pipeline, st.stage): rng.random() * 1e10 for st in places},
                        {(st.pipeline, st.stage): 0.0 for st in places}):
            want = stage_shard_elems(plan, rank_shards(plan, rank_weights(plan, weights)))
            assert stage_elems_of(plan, weights) == want
            # The screen's bounds hold the exact slices between them, part by part.
            lo_m, hi_m, lo_ma, hi_ma = stage_elems_bounds(plan, list(weights.values()))
            for i, st in enumerate(places):
                moment, master = want[(st.pipeline, st.stage)]
                assert lo_m[i] <= moment <= hi_m[i] and lo_ma[i] <= master <= hi_ma[i]
        tps = {len({st.tp for st in places if st.pipeline == pi}) for pi in range(len(plan.pipelines))}
        mixed += max(tps) > 1
        same_tp += min(tps) == 1
        checked += 1
    assert mixed and same_tp  # both kinds of sync groups were drawn


NONE, SELECTIVE, FULL = Recompute.NONE, Recompute.SELECTIVE, Recompute.FULL


def _plan(pipes: list[Pipeline], *, schedule: str = "1f1b", sharding: str = "none", shares: str = "proportional",
          ) -> Plan:
    return Plan(model=tiny_model(), cluster=small_cluster(fast=8, slow=8, per_node=4),
                global_batch=sum(p.num_samples for p in pipes), seq_len=32, pipelines=tuple(pipes),
                schedule=schedule, optimizer_sharding=sharding, optimizer_shares=shares).validate()


def _replicas(*, sp: tuple[bool, bool] = (False, False)) -> list[Pipeline]:
    return [Pipeline(1, 4, (Stage("fast", (2 * i, 2 * i + 1), (0, 3), embedding=True, sequence_parallel=sp[i]),
                            Stage("slow", (8 + i,), (3, 6), head=True))) for i in range(2)]


def _plans() -> dict[str, Plan]:
    out = {f"{z}-{shares}": _plan(_replicas(), sharding=z, shares=shares)
           for z in ("none", "zero1", "zero2", "zero3") for shares in ("proportional", "equal")}
    out["replicas-differing-in-sp"] = _plan(_replicas(sp=(True, False)))
    out["replicas-differing-in-sp-zero1"] = _plan(_replicas(sp=(False, True)), sharding="zero1")
    out["mixed-tp-sync-group"] = _plan(
        [Pipeline(1, 4, (Stage("fast", (0, 1), (0, 3), embedding=True), Stage("slow", (8,), (3, 6), head=True))),
         Pipeline(1, 4, (Stage("fast", (4,), (0, 2), embedding=True), Stage("slow", (9, 10), (2, 6), head=True)))],
        sharding="zero2")
    out["cp"] = _plan([Pipeline(1, 4, (Stage("fast", (0, 1), (0, 3), embedding=True, cp=2),
                                       Stage("slow", (8, 9), (3, 6), head=True, cp=2))),
                       Pipeline(1, 4, (Stage("fast", (2, 3), (0, 3), embedding=True, cp=2),
                                       Stage("slow", (10, 11), (3, 6), head=True, cp=2)))], sharding="zero1")
    out["interleaved"] = _plan([interleave(Pipeline(1, 8, (Stage("fast", (i,), (0, 1), embedding=True),
                                                           Stage("slow", (8 + i,), (1, 2), head=True))),
                                           [[2, 1], [1, 2]]) for i in range(2)], schedule="interleaved",
                               sharding="zero1")
    return out


PLANS = _plans()


def _tight(plan: Plan) -> list[float]:
    """Headrooms just above and below each stage's predicted peak under each mode: answers at the edge."""
    out = set()
    for mode in Recompute:
        pred = predict(replace(plan, pipelines=tuple(replace(p, stages=tuple(replace(s, recompute=mode)
                                                                             for s in p.stages))
                                                     for p in plan.pipelines)))
        for sp in pred.stages:
            edge = 1 - sp.peak_mem_bytes / sp.device_mem_bytes
            out.update((edge * (1 - 1e-9), edge * (1 + 1e-9)))
    edges = sorted(out)
    return edges[::max(1, len(edges) // 6)]


def _answers(plan: Plan, headrooms: list[float]) -> tuple:
    out = []
    some = [(pi, si) for pi, p in enumerate(plan.pipelines) for si in range(len(p.stages))][1::2]
    for headroom in headrooms:
        fits = StageFits(plan, mem_headroom=headroom)
        bound = StageFits(plan, mem_headroom=headroom, p2p_bound=True)
        out += [fits.under(mode) for mode in (None, *Recompute)] + [bound.under(mode) for mode in (None, *Recompute)]
        out += [fits.under(mode, asked=some) for mode in Recompute]  # some stages asked: their answers
        modes = ModeFits(plan, headroom)  # each stage's answer alone, as choose_recompute reads it
        out.append([modes.fits(m, sid) for sid, ms in stage_modes(plan).items() for m in ms])
        for kw in ({}, {"allow_sp": False}, {"allow_recompute": False}):
            out.append(fits_some_mode(plan, mem_headroom=headroom, **kw))
            out.append(choose_recompute(plan, mem_headroom=headroom, **kw))
    return tuple(out)


@pytest.mark.parametrize("name", sorted(PLANS))
def test_fits_and_modes_answer_as_the_plain_rules(name: str) -> None:
    plan = PLANS[name]
    with reference_path():
        headrooms = _tight(plan)
        want = _answers(plan, headrooms)
    clear_caches()
    assert _answers(plan, headrooms) == want
    assert _answers(plan, headrooms) == want  # again, from the memos the first call filled
    for headroom in headrooms:  # a sibling with the other buffers (shared twins, shapes anew) is a fresh one's
        for bound in (False, True):
            sibling = StageFits(plan, mem_headroom=headroom, p2p_bound=not bound).with_bound(bound)
            fresh = StageFits(plan, mem_headroom=headroom, p2p_bound=bound)
            assert [sibling.under(m) for m in Recompute] == [fresh.under(m) for m in Recompute]
    # At the edge the answers differ between headrooms: the comparison could fail.
    assert len({a for a in want if isinstance(a, bool)}) == 2


def _near_twin(field: str) -> list[Pipeline]:
    """Two replicas but for one input of a stage's memory (``memory_twins``' key) in the second."""
    a, b = _replicas()
    first = b.stages[0]
    if field == "recompute":
        b = replace(b, stages=(replace(first, recompute=FULL), *b.stages[1:]))
    elif field == "layers":
        b = replace(b, stages=(replace(first, layers=(0, 2)), replace(b.stages[1], layers=(2, 6))))
    elif field == "micro_batch_size":
        b = replace(b, micro_batch_size=2)
    else:
        b = replace(b, num_micro_batches=1)
    return [a, b]


@pytest.mark.parametrize("field", ["recompute", "layers", "micro_batch_size", "num_micro_batches"])
@pytest.mark.parametrize("sharding", ["none", "zero1"])
def test_replicas_share_memory_only_where_every_input_is_equal(field: str, sharding: str) -> None:
    # Pipelines differing in one input of their stages' memory each get their own (predict and StageFits
    # share a replica's), as on the reference path, which shares nothing; their memories differ, so a
    # key without that input would fail here (the layer ranges' change shows in the sync shape too).
    plan = _plan(_near_twin(field), sharding=sharding)

    def answers() -> tuple:
        stages = predict(plan).stages
        return (tuple((sp.peak_mem_bytes, sp.activations_bytes) for sp in stages),
                tuple(StageFits(plan, mem_headroom=h).under() for h in _tight(plan)))

    with reference_path():
        want = answers()
    assert want[0][0] != want[0][2]  # the first stages of the two pipelines
    clear_caches()
    assert answers() == want


@pytest.mark.parametrize("name", sorted(PLANS))
def test_the_memory_floor_is_under_the_memory_and_screens_hopeless_plans(name: str) -> None:
    # StageFits.over names only stages under() says do not fit (a floor too high, e.g. with the optimizer
    # slice or the point-to-point buffers in it, names one at the edge that does fit); it names some; and
    # where it finds a stage over under every mode, the plain rules' fits_some_mode says no too.
    plan = PLANS[name]
    with reference_path():
        headrooms = _tight(plan)
    named, hopeless = 0, []
    for headroom in headrooms:
        for bound in (False, True):
            fits = StageFits(plan, mem_headroom=headroom, p2p_bound=bound)
            for mode in (None, *Recompute):
                ok = fits.under(mode)
                over = fits.over(mode, asked=list(ok))
                assert not any(ok[sid] for sid in over), (headroom, bound, mode)
                named += len(over)
        modes = stage_modes(plan)
        if ModeFits(plan, headroom).hopeless(modes):
            hopeless.append(headroom)
    assert named and hopeless
    with reference_path():
        assert not any(fits_some_mode(plan, mem_headroom=h) for h in hopeless)
        assert not any(ModeFits(plan, h).hopeless(stage_modes(plan)) for h in hopeless)  # off


@pytest.mark.slow
def test_a_real_searchs_candidates_answer_as_the_plain_rules(monkeypatch: pytest.MonkeyPatch) -> None:
    # Every laid-out candidate a default-path search checks in this process, replayed on the reference
    # path: the same answers mode by mode.
    import hethub.predict.stage_modes as stage_modes
    from hethub.search import PlannerConfig, make_plan
    from hethub.spec.cluster import load_cluster
    from hethub.spec.model import get_model

    asked: list[tuple[Plan, float, list]] = []

    class Recorded(stage_modes.ModeFits):
        def __init__(self, plan: Plan, mem_headroom: float) -> None:
            super().__init__(plan, mem_headroom)
            asked.append((plan, mem_headroom, []))
            self.calls = asked[-1][2]

        def __call__(self, mode: stage_modes.Mode, asked: list | None = None) -> dict[tuple[int, int], bool]:
            out = super().__call__(mode, asked)
            self.calls.append((mode, asked, out))
            return out

        def fits(self, mode: stage_modes.Mode, sid: tuple[int, int]) -> bool:  # choose_recompute's per stage
            out = super().fits(mode, sid)
            self.calls.append((mode, (sid,), {sid: out}))
            return out

    monkeypatch.setattr(stage_modes, "ModeFits", Recorded)
    make_plan(cluster=load_cluster(EXAMPLES / "a100-v100-32.toml"), model=get_model("llama-2-7b"),
              config=PlannerConfig(global_batch=256, seq_len=2048))
    monkeypatch.undo()
    assert any(not all(out.values()) for _, _, calls in asked for _, _, out in calls)  # some candidates do not fit
    with reference_path():
        for plan, headroom, calls in asked:
            fits = stage_modes.ModeFits(plan, headroom)
            assert [(mode, stages, fits(mode, stages)) for mode, stages, _ in calls] == calls


def test_the_screen_decides_away_from_the_edge_and_defers_at_it(monkeypatch: pytest.MonkeyPatch) -> None:
    # Both paths of StageFits.under on sharded plans run in the comparisons above: the screen's answer,
    # and the exact split where a stage's bounds straddle its usable bytes.
    seen: list[bool] = []
    screen = shard_memory.screened_fits

    def counted(*args: object, **kw: object) -> dict | None:
        out = screen(*args, **kw)  # type: ignore[arg-type]
        seen.append(out is not None)
        return out

    monkeypatch.setattr("hethub.predict.stage_fits.screened_fits", counted)
    plan = PLANS["zero1-proportional"]
    with reference_path():
        headrooms = _tight(plan)
    for headroom in headrooms:
        StageFits(plan, mem_headroom=headroom).under()
    assert True in seen and False in seen


def _layout_plan(*, split: int = 3, tp: int = 2, embed_first: bool = True, kinds: tuple[str, str] = ("fast", "slow"),
                 sharding: str = "zero1") -> Plan:
    def pipe(i: int) -> Pipeline:
        first = Stage(kinds[0], tuple(range(4 * i, 4 * i + tp)), (0, split), embedding=embed_first)
        last = Stage(kinds[1], (8 + 4 * i,), (split, 6), head=True, embedding=not embed_first)
        return Pipeline(1, 4, (first, last))
    return Plan(model=_MODEL, cluster=_CLUSTER, global_batch=8, seq_len=32, pipelines=(pipe(0), pipe(1)),
                optimizer_sharding=sharding)


_MODEL, _CLUSTER = tiny_model(), small_cluster(fast=8, slow=8, per_node=4)


def test_the_layout_caches_see_every_input_of_their_values() -> None:
    # Plans sharing a layout share its BucketSums (the other plan's kinds, sharding); a near miss (the
    # layer split, a holder's TP degree, where the embedding sits) gets its own, equal to a cold one's.
    base = _layout_plan()
    shared = [_layout_plan(kinds=("slow", "fast")), _layout_plan(sharding="zero2")]
    near = [_layout_plan(split=2), _layout_plan(tp=1), _layout_plan(embed_first=False)]
    clear_caches()
    first = bucket_sums(base)
    for plan in shared:
        assert layout_key(plan) == layout_key(base) and bucket_sums(plan) is first
    for plan in near:
        assert layout_key(plan) != layout_key(base)
        warm = bucket_sums(plan)
        clear_caches()
        assert warm == bucket_sums(plan) != first
        bucket_sums(base)  # warm again for the next
    # And the fit answers of each plan after the others equal the plain rules'.
    for plan in [base, *shared, *near]:
        with reference_path():
            want = [StageFits(plan, mem_headroom=h).under(m) for h in (0.0, 0.5) for m in Recompute]
        assert [StageFits(plan, mem_headroom=h).under(m) for h in (0.0, 0.5) for m in Recompute] == want


def test_the_held_bytes_and_buffer_memos_see_every_input_of_their_values() -> None:
    # ZeRO-2/3's held bytes are kept by layout, ZeRO stage, TP and precision; the point-to-point
    # buffers by pipeline shape with the micro-batch count's peak class. A plan differing from a warm
    # one in any of those gets its own value, equal to a cold one's and unlike the warm one's.
    base = _layout_plan(sharding="zero3")
    near = [_layout_plan(sharding="zero2"), replace(base, kind_settings={"fast": {"precision": "fp32"}})]
    clear_caches()
    first = zero23_stage_bytes(base)
    for plan in near:
        warm = zero23_stage_bytes(plan)
        clear_caches()
        assert warm == zero23_stage_bytes(plan) != first
        zero23_stage_bytes(base)
    assert zero23_stage_bytes(replace(base, global_batch=16)) is zero23_stage_bytes(base)

    def p2p(plan: Plan) -> list[float]:
        return [PlanCosts(plan, None).p2p_bytes(0, si) for si in range(len(plan.pipelines[0].stages))]

    three = [Stage("fast", (i,), (2 * i, 2 * i + 2), embedding=i == 0, head=i == 2) for i in range(3)]
    for schedule in ("gpipe", "1f1b", "zb-h1"):
        one = _plan([Pipeline(1, 2, tuple(three))], schedule=schedule)  # one model: its id is in the key
        plans = [replace(one, pipelines=(Pipeline(1, m, tuple(three)),), global_batch=m) for m in (2, 3, 8, 12)]
        clear_caches()
        warm = [p2p(plan) for plan in plans]
        with reference_path():
            assert warm == [p2p(plan) for plan in plans]
        if schedule == "gpipe":  # its buffers grow with the count: each its own
            assert len({tuple(w) for w in warm}) == len(plans)


def test_with_parts_is_replace() -> None:
    mem = StageMemory(*(float(i + 1) for i in range(8)), fragmentation_ratio=0.1, framework_context_bytes=9.0,
                      comm_buffers_bytes=10.0, gathered_bytes=11.0, p2p_buffers_bytes=12.0)
    mem.total_bytes  # noqa: B018 - a cached value that must not be carried over
    changed = mem.with_parts(grads_bytes=100.0, gathered_bytes=0.0)
    assert changed == replace(mem, grads_bytes=100.0, gathered_bytes=0.0)
    assert changed.total_bytes == replace(mem, grads_bytes=100.0, gathered_bytes=0.0).total_bytes != mem.total_bytes
    with pytest.raises(TypeError, match="no field"):
        mem.with_parts(grad_bytes=1.0)


def _sums_by_rule(plan: Plan) -> list:
    """``buckets``' sums as ``BucketSums`` holds them (in any order): per bucket its elements, whether
    mixed, and each holder's stage index and members in one line."""
    index = {(st.pipeline, st.stage): i for i, st in enumerate(stage_places(plan))}
    return sorted((b.elems(plan.model), b.mixed, tuple(sorted((index[(h.pipeline, h.stage)],
                                                               len(h.ranks) if b.mixed else h.cp) for h in b.holders)))
                  for b in buckets(plan))


def test_the_bucket_sums_by_layer_runs_are_the_buckets() -> None:
    # Runs of layers between stage boundaries, merged by holder set, against the per-unit grouping, for
    # untied, tied and learned-position models, chunked stages and CP.
    rng = random.Random(11)
    base = tiny_model(8)
    models = [base, replace(base, tied_embeddings=True), replace(base, arch="gpt", tied_embeddings=True),
              replace(base, arch="gpt")]
    plans = [PLANS["interleaved"], PLANS["cp"], PLANS["mixed-tp-sync-group"]]
    while len(plans) < 60:
        plan = _random_plan(rng, "zero1", models[len(plans) % len(models)])
        if plan is not None:
            plans.append(plan)
    for plan in plans:
        clear_caches()
        sums = bucket_sums(plan)
        got = sorted((n, m, tuple(sorted(zip(st, c, strict=True))))
                     for n, m, st, c in zip(sums.elems, sums.mixed, sums.stages, sums.counts, strict=True))
        assert got == _sums_by_rule(plan)


def test_the_total_is_the_sum_of_the_parts_bit_for_bit() -> None:
    # StageMemory.total_bytes adds the parts without building them; on values with ties between the
    # phases (the peak's choice), zeros and magnitudes whose sums round, it equals their plain sum.
    rng = random.Random(11)
    pool = [0.0, 1.0, 3.0, 0.1, 0.2, 0.3, 2.0**53, 1e9 + 0.5, 7e10 / 3]
    for _ in range(20_000):
        values = [rng.choice(pool) if rng.random() < 0.7 else rng.uniform(0, 1e11) for _ in range(12)]
        mem = StageMemory(*values[:8], fragmentation_ratio=rng.choice([0.0, 0.05, 1 / 3]),
                          framework_context_bytes=values[8], comm_buffers_bytes=values[9], gathered_bytes=values[10],
                          p2p_buffers_bytes=values[11])
        twin = mem.with_parts()  # nothing cached
        assert mem.total_bytes == sum(twin.parts.values()), values


def test_the_memory_lines_total_is_each_parts_line() -> None:
    # _MemoryLines.total writes each part's _Line.at out; on random lines it gives their sums bit for bit.
    from hethub.predict.stage_cost import _Line, _MemoryLines

    rng = random.Random(5)

    def line() -> _Line:
        return _Line(*(rng.choice([0.0, 1 / 3, 2.0**40, rng.uniform(0, 1e10)]) for _ in range(3)))

    for _ in range(5_000):
        lines = _MemoryLines(line(), line(), line(), line(), rng.uniform(0, 1e9), rng.uniform(0, 1e9),
                             rng.choice([0.0, 0.05]), rng.uniform(0, 1e9))
        n, f = rng.choice([0, 1, 2, 7, 80]), rng.choice([1, 2, 3.5, 17])
        fb = f * lines.acts.at(n) + (lines.work0 if n == 0 else lines.work1)
        top = max(fb, lines.sync.at(n), lines.step.at(n))
        assert lines.total(n, f) == (lines.persistent.at(n) + top) * (1 + lines.frag) + lines.outside


def test_the_sync_shape_from_two_pipelines_of_each_layout_is_the_rules() -> None:
    # plan_costs.sync_shape finds the shape on two pipelines of each layout (each stage's TP degree and
    # layer ranges) and copies it to the others; on random layouts (mixed TP degrees, CP) with each
    # pipeline repeated zero to three times, in any order, it equals the rule run on every pipeline.
    from hethub.predict.plan_costs import sync_shape

    rng = random.Random(13)
    checked = reduced = 0
    while checked < 80:
        plan = _random_plan(rng, "none")
        if plan is None:
            continue
        pipes = [p for p in plan.pipelines for _ in range(rng.choice([1, 1, 2, 3, 4]))]
        rng.shuffle(pipes)
        # devices repeat: the shape does not read them; one layout alone too
        for case in (replace(plan, pipelines=tuple(pipes)), replace(plan, pipelines=(pipes[0],) * len(pipes))):
            with reference_path():
                want = sync_shape(case)
            # Pipelines of one layout have one shape (memory_twins relies on it).
            for (a, sa), (b, sb) in itertools.combinations(enumerate(case.pipelines), 2):
                if [(s.tp, s.layer_ranges) for s in sa.stages] == [(s.tp, s.layer_ranges) for s in sb.stages]:
                    assert all(want[(a, si)] == want[(b, si)] for si in range(len(sa.stages)))
            clear_caches()
            assert sync_shape(case) == want
            reduced += len(case.pipelines) > len(set(case.pipelines)) + 1
        checked += 1
    assert reduced
