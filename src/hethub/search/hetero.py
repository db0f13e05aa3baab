"""The combination search: which templates, how many of each, and what the leftovers do.

Per micro-batch size: keep the best few kind-pure templates per kind (templates.py), take every
choice of one template (or none) per kind and replicate it as often as the kind's devices allow;
fill the leftover devices with the best smaller template of the same kind. Then, for the most
promising choices, hand leftover devices (and, optionally, one or two of a kind's pipelines, or a
whole unused kind) to identical mixed-kind pipelines, over kind orders, TP degrees and replica
counts. Every candidate is priced in closed form (combine.estimate); the planner re-scores the best
with the full predictor, so a candidate whose allocation alone (a lower bound of its step) is behind
the current finalists is neither split nor synced: it could not become one.
"""

from __future__ import annotations

import heapq
import itertools

from hethub.memo import reference
from hethub.predict.finalist_places import Results
from hethub.predict.finalist_places import plan_key as plan_key  # re-exported: finalists and variants read these
from hethub.predict.finalist_places import size_key as size_key
from hethub.search.bounds import BLIND, EXACT
from hethub.search.combine import Estimate, Group, estimate_samples, water_level, water_level_samples
from hethub.search.mixed import price_mixed
from hethub.search.templates import TOP_PER_KIND, Ranked, Searcher

TOP_FOR_MIXED = 4
SMALL_POOL = 32  # devices up to which mixed pipelines may also take one released pure pipeline
MBS_KEEP = 0.9


def _top_distinct(ranked: list[Ranked], n: int, *, by_size: bool = False) -> list[Ranked]:
    out, seen = [], set()
    for r in ranked:
        key = (r.pipe.slots[0].tp, len(r.pipe.slots), any(r.pipe.recompute), r.pipe.mbs if by_size else 0)
        if key not in seen and r.rate > 0:
            seen.add(key)
            out.append(r)
        if len(out) == n:
            break
    return out


def _fill(s: Searcher, kind: str, mbs: int, share: float, left: int) -> tuple[list[Group], int]:
    """Greedily give leftover devices of one kind to the best-rated template that still fits.

    Templates the scan skipped (templates.Searcher.pure) are split first while their rate bound
    beats the best fitting one, highest bound first, one stage count at a time (its templates may
    raise the bar over the rest), so the choice is the one among all scanned templates. Kept per
    searcher: the combination search asks the same leftovers for every choice of the other kinds.
    """
    key = (kind, mbs, share, left)
    if key in s.fills:
        return list(s.fills[key][0]), s.fills[key][1]
    groups: list[Group] = []
    while left > 0:
        ranked = s.pure(kind, mbs, share=share)
        best = next((r for r in ranked if r.rate > 0 and r.pipe.num_devices <= left), None)
        # The skipped stage count of highest rate bound that fits and could beat it, split one at a time:
        # its templates may raise the bar above the others' bounds.
        floor = best.rate if best else 0.0
        top = s.top_skipped(kind, mbs, share=share, above=floor, want=lambda tp, p, left=left: tp * p <= left)
        if top is not None:
            _, tp, p = top
            s.complete(kind, mbs, share=share, want=lambda tp_, p_, tp=tp, p=p: (tp_, p_) == (tp, p))
            continue
        if best is None:
            break
        groups.append(Group(best.pipe, left // best.pipe.num_devices))
        left %= best.pipe.num_devices
    s.fills[key] = (groups, left)
    return list(groups), left


def search(s: Searcher, *, kinds_alone: bool = False, first: int | None = None) -> list[Estimate]:
    """Closed-form-ranked candidate plans, best first. kinds_alone: only single-kind plans; first: only
    as far as the first ``first`` distinct plans (all of them with kinds_alone)."""
    results = Results(s.config.finalists + s.config.top_k, fits=s.fits, per_size=s.config.per_size_finalists)
    solo = {k: e for k in (s.counts if kinds_alone else []) if (e := _alone_all_sizes(s, results, k)) is not None}
    sizes = [] if kinds_alone else _promising_mbs(s)
    for mbs in sizes:
        _search_size(s, results, mbs)
    _per_replica_sizes(s, results, sizes)
    # The best single-group plan of each kind is always a finalist: its closed form is the predictor's
    # (identical pipelines), whereas a candidate with leftover fill can be rated a few % high.
    items = results.ranked(None if kinds_alone else first)
    for est in sorted(solo.values(), key=lambda e: e.step_time_s):
        if est not in items[: results.keep]:
            items.remove(est)
            items.insert(max(0, min(len(items), results.keep) - 1), est)
    return items


def _search_size(s: Searcher, results: Results[Estimate], mbs: int) -> None:
    """One micro-batch size's candidates into `results`: every choice of a top template (or none) per
    kind, replicated, leftovers filled; aligned kind-pure pipelines; and mixed pipelines around the
    best choices (`search`)."""
    ranked = {k: s.pure(k, mbs, share=s.share[k]) for k in s.counts}
    base, aligned = _base_choices(s, ranked, mbs), _aligned_groups(s, ranked, mbs)
    for _, est, _ in base:
        results.add(est)
    total = s.total_mb(mbs)
    for groups in aligned:
        if results.may_enter(water_level(groups, total)):
            results.add(s.estimate(groups, mbs))
    base = sorted(base, key=lambda x: x[0])
    # The best choices whose pure groups fit memory as laid out (Searcher.fits: replicas of other
    # TP degrees add full-size gradient copies), plus the all-unused one.
    chosen = [b for b in base if b[1] is None and all(r is None for _, r in b[2])]
    for b in base:
        if len(chosen) > TOP_FOR_MIXED:
            break
        if b[1] is not None and s.fits(b[1]):
            chosen.append(b)
    todo: list[tuple[list[Group], dict[str, int]]] = []
    for _, _, choice in chosen:
        todo += _mixed_around(s, choice)
    price_mixed(s, results, todo, mbs)


def _base_choices(s: Searcher, ranked: dict[str, list[Ranked]], mbs: int) -> list[tuple]:
    """(step, estimate or None, choice) of every choice of one of each kind's top templates or none,
    replicated over the kind, its leftovers filled (`_fill`), in product order."""
    kinds = list(s.counts)
    tops = {k: _top_distinct(ranked[k], TOP_PER_KIND) for k in kinds}
    base: list[tuple[float, Estimate | None, list[tuple[str, Ranked | None]]]] = []
    for choice in itertools.product(*[[None, *tops[k]] for k in kinds]):
        groups: list[Group] = []
        for k, r in zip(kinds, choice, strict=True):
            if r is not None:
                c = s.counts[k] // r.pipe.num_devices
                fill, _ = _fill(s, k, mbs, s.share[k], s.counts[k] - c * r.pipe.num_devices)
                groups += [Group(r.pipe, c), *fill]
        est = s.estimate(groups, mbs) if groups else None
        base.append((est.step_time_s if est else float("inf"), est, list(zip(kinds, choice, strict=True))))
    return base


def _per_replica_sizes(s: Searcher, results: Results[Estimate], sizes: list[int]) -> None:
    """Kind-pure choices whose kinds run different micro-batch sizes (a memory-poor kind at 1 beside
    a rich one at 4): every choice of one of each kind's top templates over all `sizes` (or none),
    replicated over the kind, leftovers filled at the template's size, the batch split in samples.
    Choices of one size were priced by the per-size search above. Templates are rated in samples/s
    per device whatever their size, so one ranking serves. Mixed pipelines stay at one size per
    candidate (those beside pure groups of other sizes are not searched)."""
    if len(sizes) < 2:
        return
    kinds = list(s.counts)
    tops = {}
    for k in kinds:
        ranked = sorted((r for b in sizes for r in s.pure(k, b, share=s.share[k])), key=lambda r: -r.rate)
        tops[k] = _top_distinct(ranked, TOP_PER_KIND, by_size=True)
    for choice in itertools.product(*[[None, *tops[k]] for k in kinds]):
        used = [(k, r) for k, r in zip(kinds, choice, strict=True) if r is not None]
        if len({r.pipe.mbs for _, r in used}) < 2:
            continue
        groups: list[Group] = []
        for k, r in used:
            d = r.pipe.num_devices
            c = s.counts[k] // d
            groups += [Group(r.pipe, c), *_fill(s, k, r.pipe.mbs, s.share[k], s.counts[k] - c * d)[0]]
        if results.may_enter(water_level_samples(groups, s.config.global_batch)):
            results.add(estimate_samples(groups, total_samples=s.config.global_batch, links=s.links, model=s.model,
                                         precision=s.config.precision, equal=s.config.equal_shares))


def _alone_all_sizes(s: Searcher, results: Results[Estimate], kind: str) -> Estimate | None:
    """The kind's best single-group plan over every usable micro-batch size. Sizes are tried best
    template rate first; a size is skipped only where every device at its best template rate (or
    rate bound) is below a plan found at an earlier size (`_alone`'s own stopping rule, no
    heuristic). The bound (commands/compare.merged_bound) reads these plans."""
    sizes = list(s.config.usable_micro_batch_sizes)

    def top(b: int) -> float:
        rate = max([r.rate for r in s.pure(kind, b, share=1.0)] + [0.0])
        return max(rate, *s.top_skipped(kind, b, share=1.0, above=rate, want=lambda tp, p: True) or [0.0])

    # Sizes in that order, a heap keyed by upper bounds of top until their turn (the largest BLIND bound, then
    # bounds `Searcher.top_above` tightens only below the next key, down to the largest bound: `top_bound`), then
    # by top (the same order): a size a bound rules out is never scanned (reference: top). An entry's tier:
    # the bound its key is (BLIND: a loose one; None: top).
    heap = [(-top(b), i, None) if reference() else (-s.top_bound(kind, b, share=1.0, loose=True), i, BLIND)
            for i, b in enumerate(sizes)]
    heapq.heapify(heap)
    exact, best = None, 0.0
    while heap:
        key, i, tier = heapq.heappop(heap)
        if -key * s.counts[kind] < best * (1 - 1e-9):
            continue
        if tier == BLIND:  # popped, so at least the next key: tightened at least once, or the bound
            bound, sure = s.top_above(kind, sizes[i], share=1.0, above=-heap[0][0] if heap else 0.0)
            heapq.heappush(heap, (-bound, i, EXACT if sure else BLIND))
            continue
        if tier == EXACT:
            heapq.heappush(heap, (-top(sizes[i]), i, None))
            continue
        found, best_b = _alone(s, results, kind, sizes[i])
        best = max(best, best_b)
        if found is not None and (exact is None or found.step_time_s < exact.step_time_s):
            exact = found
    return exact


def _alone(s: Searcher, results: Results[Estimate], kind: str, mbs: int) -> tuple[Estimate | None, float]:
    """Every template of one kind (replicated over the kind, leftovers filled), not just the top few.

    Templates are rated per *used* device, so a slightly slower one that divides the kind's devices
    evenly can beat the top-rated ones once their leftovers are counted (HETHUB-768: pp16 on 640
    devices). A template of rate r over d devices, replicated c = n // d times, reaches at most
    r c d + r_max (n - c d) samples/s (the leftover devices at the best rate of any template), so
    templates are tried best optimistic value first until that value is below the best estimate found;
    templates the scan skipped enter with their rate bound (bounds.rate_bound) in place of r and are
    split only when that could win. Returns the best single-group plan and the best rate found.
    """
    n, total = s.counts[kind], s.config.global_batch
    exact: Estimate | None = None
    ranked = s.pure(kind, mbs, share=1.0)
    r_max = max([r.rate for r in ranked] + [0.0])
    r_max = max(r_max, *s.top_skipped(kind, mbs, share=1.0, above=r_max, want=lambda tp, p: True) or [0.0])

    def optimistic(rate: float, d: int) -> float:
        used = n // d * d
        return rate * used + r_max * (n - used)

    # A max-heap of (optimistic value, tie, template or skipped (tp, stages, whether its bound is read)),
    # a skipped count keyed by its loose bound until its turn, then by its bound (Searcher.skipped_upper).
    heap: list[tuple[float, int, object]] = []
    for i, r in enumerate(ranked):
        if r.rate > 0:
            heap.append((-optimistic(r.rate, r.pipe.num_devices), i, r))
    for j, (tp, p, bound, known) in enumerate(s.skipped_upper(kind, mbs, share=1.0)):
        heap.append((-optimistic(bound, tp * p), len(ranked) + j, (tp, p, known)))
    heapq.heapify(heap)
    tie, best, seen = len(heap), 0.0, set()
    while heap:
        opt, i, item = heapq.heappop(heap)
        if -opt < best * (1 - 1e-9):
            break
        if isinstance(item, tuple) and not item[2]:
            for tp, p, bound in s.skipped(kind, mbs, share=1.0, want=lambda tp, p, item=item: (tp, p) == item[:2]):
                heapq.heappush(heap, (-optimistic(bound, tp * p), i, (tp, p, True)))
            continue
        if isinstance(item, tuple):  # a skipped stage count: split it now and queue its templates
            before = {id(r.pipe) for r in s.pure(kind, mbs, share=1.0)}
            s.complete(kind, mbs, share=1.0, want=lambda tp_, p_, item=item: (tp_, p_) == item[:2])
            for r in s.pure(kind, mbs, share=1.0):
                if id(r.pipe) not in before and r.rate > 0:
                    heapq.heappush(heap, (-optimistic(r.rate, r.pipe.num_devices), tie, r))
                    tie += 1
            continue
        r = item
        key = (r.pipe.slots, r.pipe.layers, r.pipe.recompute)
        if key in seen:
            continue
        seen.add(key)
        c = n // r.pipe.num_devices
        fill, _ = _fill(s, kind, mbs, 1.0, n - c * r.pipe.num_devices)
        est = s.estimate([Group(r.pipe, c), *fill], mbs)
        results.add(est)
        if est is not None and len(est.groups) == 1:  # only exact closed forms raise the bar
            best = max(best, total / est.step_time_s)
        if fill:  # the template alone too: leaving the leftovers idle can predict better than filling
            alone = s.estimate([Group(r.pipe, c)], mbs)
            results.add(alone)
            if alone is not None:
                est, best = alone, max(best, total / alone.step_time_s)
        if est is not None and len(est.groups) == 1 and (exact is None or est.step_time_s < exact.step_time_s):
            exact = est
    return exact, best


def _promising_mbs(s: Searcher) -> list[int]:
    """Micro-batch sizes worth combining: on large clusters, those within MBS_KEEP of some kind's best
    pure-template rate (the combination search costs far more than the template scan). A kind whose best rate
    bound at a size is below MBS_KEEP of its rate at an earlier size is not scanned there: its rate there could
    neither keep the size nor raise the kind's best. Elsewhere only its best rate is found (`Searcher.best_rate`):
    the sizes kept are scanned in full by their search (`_search_size`), the others never."""
    sizes = list(s.config.usable_micro_batch_sizes)
    if sum(s.counts.values()) <= SMALL_POOL:
        return sizes
    best: dict[tuple[str, int], float] = {}
    for b, k in itertools.product(sizes, s.counts):
        bar = MBS_KEEP * max([best[k, a] for a in sizes if (k, a) in best] + [0.0])
        rate = (max((r.rate for r in s.pure(k, b, share=s.share[k])), default=0.0) if reference()  # the plain rule
                else s.best_rate(k, b, share=s.share[k], bar=bar))
        if rate is not None:
            best[k, b] = rate
    top = {k: max(best.get((k, b), 0.0) for b in sizes) for k in s.counts}
    return [b for b in sizes if any(top[k] > 0 and best.get((k, b), 0.0) >= MBS_KEEP * top[k] for k in s.counts)]


def _mixed_around(s: Searcher, choice: list[tuple[str, Ranked | None]]) -> list[tuple[list[Group], dict[str, int]]]:
    """Variants of one pure choice whose leftover (or, on small clusters, one released pipeline's)
    devices form mixed pipelines: (pure groups, pool of devices) each (mixed.price_mixed)."""
    used = [(k, r) for k, r in choice if r is not None]
    releases = [0, 1] if used and sum(s.counts.values()) <= SMALL_POOL else [0]
    out = []
    for release in releases:
        pure: list[Group] = []
        pool: dict[str, int] = {k: s.counts[k] for k, r in choice if r is None}
        for k, r in used:
            c = max(0, s.counts[k] // r.pipe.num_devices - release)
            pure.append(Group(r.pipe, c))
            pool[k] = s.counts[k] - c * r.pipe.num_devices
        out.append(([g for g in pure if g.count > 0], pool))
    return out


def _aligned_groups(s: Searcher, ranked: dict[str, list[Ranked]], mbs: int) -> list[list[Group]]:
    """Kind-pure pipelines of every kind with the same stage count AND the same layer boundaries: each
    candidate's groups (`_search_size` prices those that could enter the finalists).

    Replicas whose stage boundaries differ chain their per-layer gradient syncs (a stage waits for
    holders that wait for other holders); aligned replicas sync each stage's layers independently.
    Within one kind-pure pipeline the balanced split hardly depends on the kind, so aligning costs
    little. The reference split is the one of the kind with the most compute.
    """
    kinds = sorted(s.counts, key=lambda k: -s.counts[k] * s.cluster.kinds[k].effective_flops)
    stage_counts = {len(r.pipe.slots) for k in kinds for r in _top_distinct(ranked[k], TOP_PER_KIND)}
    out = []
    for p in sorted(stage_counts):
        per_kind = {k: [r for r in ranked[k] if len(r.pipe.slots) == p and r.rate > 0][:2] for k in kinds}
        for k in kinds:  # the scan may have skipped templates of p stages that would be among the top 2: split
            # best rate bound first, while one left could beat the second (`complete` keeps `ranked` sorted)
            while (top := s.top_skipped(k, mbs, share=s.share[k], above=per_kind[k][1].rate if len(per_kind[k]) == 2
                                        else 0.0, want=lambda tp, p_, p=p: p_ == p)) is not None:
                s.complete(k, mbs, share=s.share[k], want=lambda tp, p_, top=top: (tp, p_) == top[1:])
                per_kind[k] = [r for r in ranked[k] if len(r.pipe.slots) == p and r.rate > 0][:2]
        for choice in itertools.product(*[[None, *per_kind[k]] for k in kinds]):
            used = [(k, r) for k, r in zip(kinds, choice, strict=True) if r is not None]
            if len(used) < 2:
                continue
            ref = used[0][1].pipe.layers
            groups = []
            for k, r in used:
                pipe = s.fixed(r.pipe.slots, ref, mbs)
                if pipe is None:
                    break
                groups.append(Group(pipe, s.counts[k] // pipe.num_devices))
            else:
                out.append(groups)
    return out
