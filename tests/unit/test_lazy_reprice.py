"""The variants' lazy memory checks change no plan: `memo.Ranked` (each shape's fastest fitting split,
checked only where the order is read that far) reads to its reader exactly what the eager rule
(every split checked, the fitting ones sorted stably, the enumeration's first shapes moved up) gives
it, on random orders, ties, checks and readers; and the planner's default path returns the same
plans, predictions and bounds with the laziness on as on the reference path (every split checked),
while checking fewer splits."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, replace

import pytest

from conftest import EXAMPLES, laid_out_layouts
from hethub.memo import Ranked, reference_path
from hethub.plan import Recompute
from hethub.predict.plan_costs import PlanCosts
from hethub.predict.predictor import predict, step_floor_s
from hethub.predict.stage_modes import ModeFits, choose_recompute, modes_floor_s
from hethub.search import PlannerConfig, finalists, make_plan, templates
from hethub.spec.cluster import load_cluster
from hethub.spec.model import get_model


@dataclass(frozen=True)
class Alt:
    """A split: its group (shape), its closed-form time, whether it fits, its plan identity and size."""

    group: int
    time_s: float
    fits: bool
    ident: int
    size: int


def _eager(options: list[list[Alt]], lead: int, firsts: int) -> tuple[list[Alt], int]:
    """What `variants.priced_plans` fed `finalists.finalist_plans` before the laziness: each shape's
    fitting split of least time (the first on a tie), sorted stably, the first shapes moved up."""
    got = []
    for i, opts in enumerate(options):
        best = None
        for a in opts:
            if a.fits and (best is None or a.time_s < best.time_s):
                best = a
        if best is not None:
            got.append((i, best))
    got.sort(key=lambda x: x[1].time_s)
    moved = [a for i, a in got[lead:] if i < firsts]
    return [a for _, a in got[:lead]] + moved + [a for _, a in got[lead:]], len(moved)


def _reader(ests, *, keep: int, per_size: int, refused: set[int], offered: set[int]) -> list[Alt]:
    """`finalist_plans`'s reading, its layouts replaced by ``refused`` (after its identity is seen)
    and ``offered`` (before), on a list or a `Ranked` order."""
    out, seen, taken = [], set(), Counter()

    def full(a: Alt) -> bool:
        return len(out) >= keep and taken[a.size if per_size else ()] >= per_size
    for a in ests.read(lambda e: not full(e)) if isinstance(ests, Ranked) else ests:
        if a.ident in seen or full(a):
            continue
        if a.ident not in offered:
            continue
        seen.add(a.ident)
        if a.ident in refused:
            continue
        taken[a.size if per_size else ()] += 1
        out.append(a)
        if len(out) >= keep and not per_size:
            break
    return out


@pytest.mark.parametrize("seed", range(6))
def test_ranked_reads_what_the_eager_rule_gives(seed):
    rng = random.Random(seed)
    for _ in range(300):
        times = [rng.choice([1.0, 2.0, 2.5, 3.0]) for _ in range(4)] + [rng.random() * 4 for _ in range(4)]
        options = []
        for i in range(rng.randint(0, 14)):
            size = rng.choice([1, 2, 4])  # one size for a shape's splits, as a shape's splits share it
            options.append([Alt(i, rng.choice(times), rng.random() < 0.6, rng.randint(0, 9), size)
                            for _ in range(rng.choice([0, 1, 2, 2, 3]))])
        lead, firsts = rng.randint(0, 6), rng.randint(0, 8)
        reading = dict(keep=rng.randint(1, 5), per_size=rng.choice([0, 1, 2, 6]),
                       refused=set(rng.sample(range(10), rng.randint(0, 3))),
                       offered=set(rng.sample(range(10), rng.randint(7, 10))))
        eager, moved = _eager(options, lead, firsts)
        want = _reader(eager, **reading)
        for reference in (False, True):
            checked = []

            def check(a: Alt, log=checked) -> bool:
                log.append(a)
                return a.fits
            if reference:
                with reference_path():
                    order = Ranked(options, key=lambda a: a.time_s, check=check)
            else:
                order = Ranked(options, key=lambda a: a.time_s, check=check)
            assert order.promote(lead, range(firsts)) == moved
            assert _reader(order, **reading) == want, (options, lead, firsts, reading)
            assert len({id(a) for a in checked}) == len(checked)  # no split checked twice
            if reference:
                assert len(checked) == sum(map(len, options))  # the plain rule checks every split


def _plan(cluster, model, cfg):
    r = make_plan(cluster=cluster, model=model, config=cfg)
    strip = [p.to_dict() for p, _ in r.alternatives]
    for d in strip:
        d.pop("meta", None)
    return (strip, [x.step_time_s for _, x in r.alternatives], r.upper_bound_by_kind, r.notes, r.relaxed_kinds)


CONFIGS = {
    "default": dict(schedule="auto", optimizer_sharding="auto"),
    "zero2": dict(schedule="auto", optimizer_sharding="zero2"),
    "zero3": dict(schedule="1f1b", optimizer_sharding="zero3"),
    "megatron": dict(schedule="auto", optimizer_sharding="auto", runtime="megatron"),
    "deepspeed": dict(schedule="auto", optimizer_sharding="auto", runtime="deepspeed"),
    "per-size-0": dict(schedule="auto", optimizer_sharding="auto", finalists_per_size=0, top_k=3),
    "homogeneous": dict(schedule="auto", optimizer_sharding="auto", strategy="homogeneous"),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CONFIGS))
def test_lazy_checks_give_the_reference_plans(name, monkeypatch):
    """Two kinds whose stages mix TP degrees where memory binds, so `Searcher.fits` checks for real."""
    cluster, model = load_cluster(EXAMPLES / "nvidia-amd-32.toml"), get_model("llama-2-7b")
    cfg = PlannerConfig(global_batch=64, seq_len=2048, micro_batch_sizes=(1, 2), **CONFIGS[name])
    calls = []
    plain = templates.fits_some_mode_kept
    monkeypatch.setattr(templates, "fits_some_mode_kept", lambda *a, **k: calls.append(1) or plain(*a, **k))
    with reference_path():
        want = _plan(cluster, model, cfg)
    eager = len(calls)
    calls.clear()
    assert _plan(cluster, model, cfg) == want
    assert len(calls) < eager if name == "default" else len(calls) <= eager


def test_priced_and_alone_plans_equal_the_reference_ones(monkeypatch):
    """The variants' pricing alone (the fast tier's check): one enumeration's shapes and each kind's
    alone shapes priced under unsharded, ZeRO-1 and ZeRO-2 variants, the first shapes moved up."""
    from hethub.predict.scoring import Screen
    from hethub.predict.stage_links import LinkBook
    from hethub.search.variants import Variant, alone_plans, enumerate_shapes, priced_plans

    cluster, model = load_cluster(EXAMPLES / "nvidia-amd-32.toml"), get_model("llama-2-7b")
    cfg = PlannerConfig(global_batch=64, seq_len=2048, micro_batch_sizes=(1, 2), schedule="auto",
                        optimizer_sharding="auto")
    links = LinkBook(cluster)
    enum = [Variant("zb-h1", "zero1").searcher(cfg, cluster=cluster, model=model, profiles=None, links=links,
                                               holders=64)]
    shapes, alone = enumerate_shapes(enum)
    calls, laid = [], []
    plain, choose = templates.fits_some_mode_kept, finalists.choose_modes
    monkeypatch.setattr(templates, "fits_some_mode_kept", lambda *a, **k: calls.append(1) or plain(*a, **k))
    monkeypatch.setattr(finalists, "choose_modes", lambda p, **k: laid.append(
        (p, {n: v for n, v in k.items() if n not in ("fits", "orders")})) or choose(p, **k))

    def priced() -> list:
        out = []
        for v in (Variant("zb-h1", "none"), Variant("1f1b", "zero1"), Variant("zb-h1", "zero2")):
            s = v.searcher(cfg, cluster=cluster, model=model, profiles=None, links=links, holders=4)
            # Its first three: what the screen (keep 3) keeps exact, in any order of prediction (test_floor_order.py).
            got = priced_plans(s, config=cfg, shapes=shapes, screen=Screen(3), firsts=3)[:3]
            got += [(p, None) for ests in alone.values() for p in alone_plans([s], ests, config=cfg)]
            out += [(p.to_dict(), r and r.step_time_s) for p, r in got]
        return out
    with reference_path():
        want = priced()
    eager, layouts = len(calls), len(laid)
    calls.clear()
    assert priced() == want
    # Fewer checks; no more layouts (priced_plans takes every layout before it predicts: score_plans' floor order).
    assert len(calls) < eager and len(laid) <= 2 * layouts
    _floors_hold(laid[:layouts], rng=random.Random(5))


def _floors_hold(laid: list, *, rng: random.Random) -> int:
    """`modes_floor_s`, which lets `finalist_plans` skip a layout, is below the step floor the
    scoring screens with (`step_floor_s` of the laid-out plan) and the predicted step, on the
    planner's candidates as laid out and with their stages' own modes drawn at random; so is its
    tighter form, which leaves out the modes `ModeFits` proves over memory, and it is no looser.
    Returns how many floors the tighter form raised."""
    assert laid
    tighter = 0
    for n, (plan, k) in enumerate(laid):
        modes = dict(allow_recompute=k["allow_recompute"], allow_sp=k["allow_sp"])
        drawn = replace(plan, pipelines=tuple(replace(p, stages=tuple(
            replace(st, recompute=rng.choice(list(Recompute)), sequence_parallel=st.tp > 1 and rng.random() < 0.5)
            for st in p.stages)) for p in plan.pipelines))
        for pre in (plan, drawn):
            post = choose_recompute(pre, **k)
            floor = modes_floor_s(pre, costs=PlanCosts(pre, None), **modes)
            fits = ModeFits(pre, k["mem_headroom"])
            tight = modes_floor_s(pre, costs=PlanCosts(pre, None), fits=fits, **modes)
            assert choose_recompute(pre, fits=fits, **k) == post  # the floor's proofs serve the choice as they are
            assert floor <= tight <= step_floor_s(post)
            assert n % 8 or tight <= predict(post).step_time_s
            tighter += floor < tight
    return tighter


def test_the_tighter_modes_floor_holds_where_memory_binds(monkeypatch):
    """`_floors_hold` on the candidates a search lays out where memory binds (V100s' stages recompute),
    so that `ModeFits` refuses some stages' faster modes and the tighter floor rises above the plain one."""
    laid = laid_out_layouts(monkeypatch, global_batch=64)
    assert _floors_hold(laid[::4], rng=random.Random(7)) > 0



def test_plans_over_memory_are_screened_as_the_scoring_drops_them(monkeypatch):
    """`finalist_plans` leaves out a plan with a stage no mode fits where `may_fit_below` proves it over
    memory (the scoring would predict it and drop it): the plan, its alternatives, the notes and the
    bound's parts are the reference path's, which predicts every such plan, and some were left out."""
    cluster, model = load_cluster(EXAMPLES / "a100-v100-32.toml"), get_model("llama-2-7b")
    cfg = PlannerConfig(global_batch=64, seq_len=2048, micro_batch_sizes=(1, 2), schedule="auto",
                        optimizer_sharding="auto", top_k=3)
    refused = []
    plain = finalists.may_fit_below
    monkeypatch.setenv("HETHUB_PLAN_WORKERS", "1")  # the checks counted in this process
    monkeypatch.setattr(finalists, "may_fit_below", lambda p, **k: plain(p, **k) or refused.append(p))

    def planned() -> tuple:
        r = make_plan(cluster=cluster, model=model, config=cfg)
        return [(p, x.step_time_s) for p, x in r.alternatives], r.notes, r.upper_bound_by_kind  # meta aside
    with reference_path():
        want = planned()
    assert not refused
    assert planned() == want
    assert refused and not any(predict(p, mem_headroom=cfg.mem_headroom).fits_memory for p in refused)
