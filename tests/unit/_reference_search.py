"""A slow reference search for tests and benchmarks: no truncation, no heuristic pruning.

`make_plan` keeps the top few templates per kind, scans stage counts with patience and spreads
mixed replica counts geometrically. This search enumerates, per micro-batch size, the whole of this
sub-space of the documented plan space (docs/planner.md):

* each kind either unused, or **any** of its kind-pure templates (every TP degree that fits, every
  stage count from 1 to the most that fit, every split variant `Searcher.splits` makes) replicated
  as often as the kind's devices allow (leftovers idle);
* plus at most one group of identical mixed pipelines over the kinds left unused: every subset of
  them (two or more), every order, every TP degree per kind, every stage count per kind and every
  replica count.

Candidates are priced in closed form (`combine.estimate`), the best `finalists` are scored with
`predict()` like the planner's; the only pruning is proven, and changes how many candidates are
priced, never which are kept (same plan as the plain enumeration on all 30 test instances): a
candidate whose allocation makespan (for mixed pipelines, under `bounds.pipe_floor`'s floor: the
memory-free one to order them, the tight one before splitting) cannot get among the finalists is
not priced (the step only adds syncs and updates to the makespan). To skip even the makespan of
most combinations, each kind's few best pure templates are priced first; their finalists' step is
a bound, and a combination whose pipelines cannot finish the global batch's micro-batches by it
(counted per group, erring upwards) is dropped before its water level is computed. A combination
that may enter by its water level is priced only if it may also by the level plus `_PostFloor`,
a floor under what the step adds after the makespan (the barriers, the slowest single stage's
gradient syncs, the largest update). Each kind-pure group's own such floor (the group alone) is a
floor under it for every combination that keeps the group, since more kept groups only add: it
lowers what the group may finish by the bound in the count above, and combinations are taken in
order of their level plus the largest own floor of a group they keep, stopping at the first that
cannot enter. It is
exponential in the number of kinds: use it on small instances (tests/unit/test_reference_search.py).
"""

from __future__ import annotations

import bisect
import itertools
import math
from dataclasses import dataclass

from hethub.plan import Plan
from hethub.predict.comm import allreduce_floor_s, small_allreduce_time_s
from hethub.predict.profiles import ProfileSet
from hethub.predict.result import Prediction
from hethub.predict.scoring import score_plans
from hethub.search.bounds import PipeFloor, pipe_floor
from hethub.search.combine import Group, water_level
from hethub.search.config import PlannerConfig
from hethub.search.finalists import finalist_plans
from hethub.search.hetero import Results
from hethub.search.split import PipeCost, Slot
from hethub.search.templates import Searcher
from hethub.spec.cluster import Cluster, Link
from hethub.spec.model import ModelSpec

SEED_PER_KIND = 4  # templates per kind whose pure combinations are priced first, to set the bound


@dataclass(frozen=True)
class ReferenceResult:
    plan: Plan
    prediction: Prediction
    candidates: int  # closed-form candidates priced


def reference_plan(*, cluster: Cluster, model: ModelSpec, config: PlannerConfig,
                   profiles: ProfileSet | None = None) -> ReferenceResult | None:
    """The best plan of the space above under the predictor (None if nothing fits)."""
    s = Searcher(cluster=cluster, model=model, config=config, profiles=profiles)
    results = Results(config.finalists + config.top_k)
    kinds = list(s.counts)
    for mbs in config.usable_micro_batch_sizes:
        total = s.total_mb(mbs)
        pure = [[Group(p, s.counts[k] // p.num_devices) for p in _all_templates(s, k, mbs)] for k in kinds]
        seeded = _seed(s, results, pure, total, mbs)
        bound = _bound(results)
        post = _PostFloor(s)
        # Each kind-pure group's first finish and its own post floor: a combination that keeps it
        # (`_PostFloor`) steps at least its level plus that floor, since more kept groups only add.
        lead = [[(g.pipe.base_s + g.pipe.per_mb_s, post([g], math.inf)) for g in p] for p in pure]
        # What each finishes at most in a combination that may still be priced: by the bound less its
        # own floor if it is kept, else its first micro-batches only.
        able = [[max(_finishes_below(g, bound - f, total), _finishes_below(g, min(bound, first * (1 + 2e-9)), total))
                 for g, (first, f) in zip(p, fl, strict=True)] for p, fl in zip(pure, lead, strict=True)]
        mixed: dict[tuple[str, ...], _Options] = {}
        floors: dict[tuple, PipeFloor | None] = {}  # memory-free floors by segments, for every _Options
        tights: dict[tuple, PipeFloor | None] = {}  # the tight ones
        # (a floor under the step: the level plus the largest own floor of a kept group; the level;
        # the kind-pure groups; the mixed group's segments and replicas, or None)
        combos: list[tuple[float, float, list[Group], tuple | None, int]] = []
        for choice in itertools.product(*[range(-1, len(p)) for p in pure]):
            picked = [(i, j) for i, j in enumerate(choice) if j >= 0]
            groups = [pure[i][j] for i, j in picked]
            floors_of = [lead[i][j] for i, j in picked]
            have = sum(able[i][j] for i, j in picked)
            if groups and have >= total and choice not in seeded:
                level = water_level(groups, total)
                combos.append((_lifted(level, floors_of), level, groups, None, 0))
            unused = tuple(k for k, j in zip(kinds, choice, strict=True) if j < 0)
            opts = mixed.get(unused)
            if opts is None:
                opts = mixed[unused] = _Options(s, unused, mbs, bound, total, floors)
            for floor, segs, c in opts.able(total - have):
                level = water_level([*groups, Group(floor, c)], total)
                combos.append((_lifted(level, floors_of), level, groups, segs, c))
        combos.sort(key=lambda x: x[0])
        for lifted, level, groups, segs, c in combos:
            if not results.may_enter(lifted):
                break
            if segs is None:
                if results.may_enter(level + post(groups, level)):
                    results.add(s.estimate(groups, mbs))
                continue
            if not results.may_enter(level + post(groups, level)):  # the mixed group only adds to it
                continue
            if segs not in tights:  # memory included: tighter, and None if nothing fits
                tights[segs] = pipe_floor(s.book, s.links, segs, mbs)
            tight = tights[segs]
            if tight is None or not results.may_enter(water_level([*groups, Group(tight, c)], total)):
                continue
            for pipe in s.mixed(segs, mbs):
                gs = [*groups, Group(pipe, c)]
                level = water_level(gs, total)
                if results.may_enter(level) and results.may_enter(level + post(gs, level)):
                    results.add(s.estimate(gs, mbs))
    results.items.sort(key=lambda e: e.step_time_s)
    scored = score_plans(finalist_plans(s, results.items, config=config, strategy="reference"), profiles)
    if not scored:
        return None
    return ReferenceResult(plan=scored[0][0], prediction=scored[0][1], candidates=len(results.items))


def _lifted(level: float, floors_of: list[tuple[float, float]]) -> float:
    """``level`` plus the largest own post floor among the groups it keeps (first finish below it,
    as `_PostFloor` counts them): a floor under the step of every candidate the combination prices."""
    edge = level * (1 - 1e-9)
    return level + max((f for first, f in floors_of if first < edge), default=0.0)


def _seed(s: Searcher, results: Results, pure: list[list[Group]], total: int, mbs: int) -> set[tuple[int, ...]]:
    """Price the kind-pure combinations of each kind's SEED_PER_KIND best templates (by their level
    alone), so that `_bound` starts near the optimum; returns the choices priced (by template index)."""
    tops = [sorted(range(len(p)), key=lambda j, p=p: water_level([p[j]], total))[:SEED_PER_KIND] for p in pure]
    combos = []
    for choice in itertools.product(*[[-1, *t] for t in tops]):
        groups = [pure[i][j] for i, j in enumerate(choice) if j >= 0]
        if groups:
            combos.append((water_level(groups, total), choice, groups))
    combos.sort(key=lambda x: x[0])
    seeded = set()
    for level, choice, groups in combos:
        if not results.may_enter(level):
            break
        results.add(s.estimate(groups, mbs))
        seeded.add(choice)
    return seeded


def _bound(results: Results) -> float:
    """A step time no candidate reaching it can enter the kept ones with (inf while they are too few).
    The kept set only improves, so a combination with too few finishes below it never could."""
    best = results._best.entries  # the planner's kept (step, key, fit) entries, best first
    return best[-1][0] * (1 + 1e-6) if len(best) >= results.keep else math.inf


def _finishes_below(g: Group, bound_s: float, total: int) -> int:
    """Micro-batches ``g``'s pipelines finish by ``bound_s`` (at least; capped at ``total``).

    `water_level` is the total-th smallest finish a + k b (k >= 1, per pipeline), so a combination
    whose groups finish fewer than ``total`` by the bound has its level above it. The bound's margin
    (1e-6 over `Results.may_enter`'s 1e-9) dwarfs float rounding, so this errs only upwards."""
    a, b = g.pipe.base_s, g.pipe.per_mb_s
    if bound_s == math.inf or b <= 0:
        return total
    return min(total, g.count * max(0, math.floor((bound_s - a) / b)))


class _Options:
    """The mixed-pipeline groups over some unused kinds that can fit, each with `pipe_floor`'s floor,
    ordered by how many micro-batches they finish by the bound, most first."""

    def __init__(self, s: Searcher, kinds: tuple[str, ...], mbs: int, bound_s: float, total: int,
                 floors: dict[tuple, PipeFloor | None]) -> None:
        items = []
        for segs, c in _mixed_options(s, list(kinds)):
            if segs not in floors:
                floors[segs] = pipe_floor(s.book, s.links, segs, mbs)
            floor = floors[segs]
            if floor is not None:
                items.append((_finishes_below(Group(floor, c), bound_s, total), floor, segs, c))
        items.sort(key=lambda x: -x[0])
        self._neg = [-n for n, *_ in items]
        self._items = [(floor, segs, c) for _, floor, segs, c in items]

    def able(self, need: int) -> list[tuple[PipeFloor, tuple, int]]:
        """Those finishing at least ``need`` micro-batches by the bound."""
        return self._items[:bisect.bisect_right(self._neg, -need)]


def _all_templates(s: Searcher, kind: str, mbs: int) -> list[PipeCost]:
    out = []
    for tp in s.tps[kind]:
        for p in range(1, min(s.counts[kind] // tp, s.model.num_layers + 2) + 1):
            out += s.splits((Slot(kind, tp),) * p, mbs)
    return out


def _mixed_options(s: Searcher, kinds: list[str]) -> list[tuple[tuple, int]]:
    out = []
    for size in range(2, len(kinds) + 1):
        for subset in itertools.combinations(kinds, size):
            for tps in itertools.product(*[s.tps[k] for k in subset]):
                slots = [s.counts[k] // t for k, t in zip(subset, tps, strict=True)]
                for c in range(1, min(slots) + 1):
                    for ns in itertools.product(*[range(1, n // c + 1) for n in slots]):
                        if sum(ns) > s.model.num_layers + 2:
                            continue
                        for order in itertools.permutations(range(size)):
                            out.append((tuple((subset[i], tps[i], ns[i]) for i in order), c))
    return out


class _PostFloor:
    """A floor under what `combine.step_time_s` adds after the makespan, for groups whose makespan
    (the `water_level`, which `allocate` reaches) is ``level``.

    Why it is one: the groups whose first micro-batch finishes below the level (``kept``, less a
    1e-9 margin) get micro-batches; others may too, which only adds replicas, devices, kinds and
    smaller TP degrees, and each of those makes the terms below no smaller. After the makespan the
    step runs a world barrier (the loss), the gradient syncs, a second barrier (the norm), then each
    stage's update; both barriers leave every stage at one time, so the step is at least the level
    plus two world all-reduces plus the largest update plus, for any one stage, the rings it takes
    part in one after another (embedding, each of its layers, head). Each ring is priced no faster
    than it can be: its holders are one stage per kept group, so their kinds include every kept
    kind-pure group's kind and the stage's own (`LinkBook.replicas` over them, or a kind's fastest
    link where that set is one kind within a node), and their smallest TP degree is at most the
    stage's and the kind-pure groups'."""

    def __init__(self, s: Searcher) -> None:
        self.s = s
        self.gb = ModelSpec.state_bytes_per_param(s.config.precision)["grads"]
        m = s.model
        vh = m.vocab_size * m.hidden_size
        self.layer = (m.layer_matmul_params, m.layer_params - m.layer_matmul_params)
        self.emb = (vh, m.embedding_params - vh)
        self.head = (0 if m.tied_embeddings else vh, m.final_norm_params)
        self.tied = m.tied_embeddings
        self._links: dict[tuple, Link] = {}
        # By object ids (PipeCost hashes its tuples each time); the values hold the keys' objects.
        self._chains: dict[tuple, tuple[float, object]] = {}  # a pipe's longest single-stage sync chain
        self._floors: dict[tuple, tuple[float, object]] = {}  # the floor, by the kept groups
        self._worlds: dict[tuple, float] = {}  # a world all-reduce by (stages, kinds, devices)

    def __call__(self, groups: list[Group], level: float) -> float:
        kept = tuple(g for g in groups if g.pipe.base_s + g.pipe.per_mb_s < level * (1 - 1e-9))
        if not kept:
            return 0.0
        key = tuple((id(g.pipe), g.count) for g in kept)
        hit = self._floors.get(key)
        if hit is None:
            hit = self._floors[key] = (self._floor(kept), kept)
        return hit[0]

    def _floor(self, kept: tuple[Group, ...]) -> float:
        replicas = sum(g.count for g in kept)
        devices = sum(g.count * g.pipe.num_devices for g in kept)
        kinds = frozenset().union(*[g.pipe.kinds for g in kept])
        stages = sum(g.count * len(g.pipe.layers) for g in kept)
        key = (stages, kinds, devices)
        world_s = self._worlds.get(key)
        if world_s is None:
            world_s = self._worlds[key] = small_allreduce_time_s(
                nbytes=8.0, participants=stages, link=self.s.links.replicas(kinds, devices=devices))
        out = 2 * world_s + max(max(g.pipe.update_s) for g in kept)
        if replicas > 1:
            pure = [g.pipe for g in kept if len(g.pipe.kinds) == 1]
            pure_kinds = frozenset().union(*[p.kinds for p in pure])
            pure_tp = min([sl.tp for p in pure for sl in p.slots], default=None)
            chain = 0.0
            for g in kept:
                key = (id(g.pipe), replicas, devices, pure_kinds, pure_tp)
                hit = self._chains.get(key)
                if hit is None:
                    hit = self._chains[key] = (self._chain(g.pipe, replicas, devices, pure_kinds, pure_tp), g.pipe)
                chain = max(chain, hit[0])
            out += chain
        return out * (1 - 1e-9)

    def _chain(self, pipe, replicas: int, devices: int, pure_kinds: frozenset[str], pure_tp: int | None) -> float:
        last = len(pipe.slots) - 1
        out = 0.0
        for i, (sl, n) in enumerate(zip(pipe.slots, pipe.layers, strict=True)):
            kinds = pure_kinds | {sl.kind}
            tp = sl.tp if pure_tp is None else min(sl.tp, pure_tp)

            def ring(params: tuple[float, float], kinds=kinds, own=sl.kind, tp=tp) -> float:
                # The holders' smallest TP is at most tp: within a node the ring is fastest at tp,
                # across nodes at 1 (its rings share the NIC; search/sync_floors.py SyncFloors._ring).
                # At the best share of the line rate: a floor under the fused all-reduce of these
                # bytes; across vendor islands the two-level exchange's (LinkBook.bridge_floor_s).
                return min(min(allreduce_floor_s(nbytes=(nb := (params[0] / t + params[1]) * self.gb),
                                                 participants=replicas, link=self._link(kinds, own, devices, rings=t)),
                               self.s.links.bridge_floor_s(kinds, nbytes=nb, replicas=replicas)) for t in {1, tp})

            t = ring((n * self.layer[0], n * self.layer[1]))  # the stage's layers, fused or not
            if i == 0 or (self.tied and i == last):
                t += ring(self.emb)
            if i == last:
                t += ring(self.head)
            out = max(out, t)
        return out

    def _link(self, kinds: frozenset[str], own: str, devices: int, *, rings: int) -> Link:
        key = (kinds, devices, rings)
        link = self._links.get(key)
        if link is None:
            lb = self.s.links
            if len(kinds) == 1 and devices <= lb.node_size[own]:  # intra-node, or a superset's pairs
                a, b = lb.intra(own), lb.replicas(kinds, devices=lb.node_size[own] + 1, rings=rings)
                link = Link(max(a.bw_bytes_per_s, b.bw_bytes_per_s), min(a.latency_s, b.latency_s))
            else:  # the slowest pair over these kinds; more kinds only add pairs
                link = lb.replicas(kinds, devices=devices, rings=rings)
            self._links[key] = link
        return link
