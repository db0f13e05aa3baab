"""The mixed search prices a candidate only where its step with its order's sync floor
(`SyncFloors.order_floor`) in place of the exact gradient syncs could still enter the finalists
(`combine.estimate`'s ``may_enter``). That floor must be at most the candidate's closed-form step
wherever every pipeline gets micro-batches (the sync floor counts every replica's ring): checked on
random candidates beside random pure groups."""

import dataclasses
import math
import random
from collections.abc import Iterator

import pytest
from test_reference_search import instance

from hethub.memo import reference_path
from hethub.predict import closed_step
from hethub.predict.closed_step import step_time_s
from hethub.schedules.zero_bubble import ZeroBubbleH1
from hethub.search import hetero
from hethub.search.combine import Group, allocate
from hethub.search.mixed import families
from hethub.search.sync_floors import SyncFloors
from hethub.search.templates import Searcher


def _pure_groups(s: Searcher, mbs: int, rng: random.Random) -> list[Group]:
    """Random kind-pure groups as the combination search holds them: a top template of some kinds,
    replicated over part or all of the kind (the rest is the mixed pipelines' pool)."""
    out = []
    for kind in s.counts:
        ranked = [r.pipe for r in s.pure(kind, mbs, share=s.share[kind])[:4] if r.rate > 0]
        if ranked and rng.random() < 0.7:
            pipe = rng.choice(ranked)
            most = s.counts[kind] // pipe.num_devices
            if most:
                out.append(Group(pipe, rng.randint(max(1, most // 2), most)))
    return out


def random_orders(s: Searcher, pure: list[Group], mbs: int, rng: random.Random, *, tries: int,
                  ) -> Iterator[tuple[int, tuple[tuple[str, int, int], ...]]]:
    """(replicas c, segments in pipeline order) of random mixed candidates the search's boxes hold beside
    `pure`: ``tries`` per box, a count drawn per segment within the box and the pool, in a random order."""
    pool = {k: n - sum(g.count * g.pipe.devices_by_kind().get(k, 0) for g in pure) for k, n in s.counts.items()}
    for fam, boxes in families(s, pool, mbs):
        for clo, chi, lo, hi in boxes:
            for _ in range(tries):
                c = rng.randint(clo, chi)
                top = [min(b, n // c) for b, n in zip(hi, fam.slots, strict=True)]
                if any(a > b for a, b in zip(lo, top, strict=True)):
                    continue
                ns = [rng.randint(a, b) for a, b in zip(lo, top, strict=True)]
                order = rng.sample(range(len(ns)), len(ns))
                yield c, tuple((fam.subset[i], fam.tps[i], ns[i]) for i in order)


def floor_and_steps(s: Searcher, pure: list[Group], mbs: int, rng: random.Random, *, tries: int):
    """(step floor, sync floor, step, split's sync floor, exact sync span) of random mixed candidates beside
    `pure` whose allocation keeps every pipeline (the step floor with the order's sync floor)."""
    ctx, total = SyncFloors(s, pure), s.total_mb(mbs)
    out = []
    for c, segs in random_orders(s, pure, mbs, rng, tries=tries):
        after = ctx.order_floor(segs, c, sum(t * n for _, t, n in segs))
        for pipe in s.mixed(segs, mbs):
            groups = [*pure, Group(pipe, c)]
            alloc, est = allocate(groups, total), s.estimate(groups, mbs)
            if est is not None and all(len(m) == g.count for g, m in zip(groups, alloc[0], strict=True)):
                times = [g.pipe.time_s(max(m)) for g, m in zip(groups, alloc[0], strict=True)]
                floor = step_time_s(groups, times, links=s.links, model=s.model, precision=s.config.precision,
                                    sync_floor_s=after)
                synced = step_time_s(groups, times, links=s.links, model=s.model,
                                     precision=s.config.precision, sync_floor_s=0.0)
                out.append((floor, after, est.step_time_s, ctx.split_floor(pipe.slots, pipe.layers, c),
                            est.step_time_s - synced))
                # The pruned estimate is the plain one wherever it is let in, and None where not,
                # whatever the bar (asked of the makespan plus `after` first, then of this floor).
                for bar in (math.inf, 0.0, floor * (1 - 1e-9), floor * (1 + 1e-9), alloc[1] + after):
                    assert s.estimate(groups, mbs, after_s=after, may_enter=lambda t, bar=bar: t < bar) == (
                        est if floor < bar else None)
    return out


# 1, 10, 11, 16: two vendor islands; 27 (the slowest, one island as 3 and 40) in the slow tier.
@pytest.mark.parametrize("seed", [1, 3, 10, 11, 16, pytest.param(27, marks=pytest.mark.slow), 40])
def test_makespan_plus_order_floor_is_below_the_step(seed):
    cluster, model, config = instance(seed)
    s = Searcher(cluster=cluster, model=model, config=config, profiles=None)
    rng = random.Random(seed)
    pairs = []
    for mbs in (1, 2):
        for _ in range(3):
            pairs += floor_and_steps(s, _pure_groups(s, mbs, rng), mbs, rng, tries=3)
    assert len(pairs) > 20
    bad = [(f, a, t) for f, a, t, _, _ in pairs if f > t * (1 + 1e-12)]
    assert not bad, f"{len(bad)} of {len(pairs)} floors above their step, e.g. {bad[0]}"
    assert sum(a > 0 for _, a, _, _, _ in pairs) > len(pairs) / 2  # the sync floor is what the pruning gains
    # The split's floor (its boundaries known) is under the exact syncs too, and tighter than the order's
    # wherever pure groups chain the syncs through the mixed stages.
    bad = [(x, span) for _, _, _, x, span in pairs if x > span * (1 + 1e-9) + 1e-12]
    assert not bad, f"{len(bad)} of {len(pairs)} split floors above their syncs, e.g. {bad[0]}"
    assert sum(x > a * 1.5 for _, a, _, x, _ in pairs) > len(pairs) / 4


def _search(cluster, model, config):
    """hetero.search's candidates as (step, groups, allocation), and how many splits it made."""
    s = Searcher(cluster=cluster, model=model, config=config, profiles=None)
    splits = []
    split_part = s.split_part
    s.split_part = lambda *a, **k: splits.append(a) or split_part(*a, **k)
    return [(e.step_time_s, e.groups, e.micro_batches) for e in hetero.search(s)], len(splits), s.config


# 11: 1F1B's fill floor (the whole work) for ZB-H1 loses a best candidate here; 16: ties in the best.
@pytest.mark.parametrize("seed", [11, 16])
def test_zero_bubble_fill_floor_keeps_the_plain_rules_best_candidates(seed, monkeypatch):
    # ZB-H1's fill floor (ZeroBubbleH1.fill_work_floor_s) lifts every floor the search prunes with
    # (pipe_floor, the mixed boxes', the templates' rate bound). Under the plain rule (the fill at
    # least one period) and every shortcut off (memo.reference_path()), the search must keep the same
    # best candidates (ties in any order), while the floor saves splits; below them what is priced may differ.
    cluster, model, config = instance(seed)
    config = dataclasses.replace(config, schedule="zb-h1")
    got, splits, config = _search(cluster, model, config)
    monkeypatch.setattr(ZeroBubbleH1, "fill_work_floor_s", lambda self, *, work_s, bottleneck_s: bottleneck_s)
    with reference_path():
        plain, plain_splits, _ = _search(cluster, model, config)
    keys = list(dict.fromkeys((g, m) for _, g, m in plain))
    bar = next(t for t, g, m in plain if (g, m) == keys[min(len(keys), config.finalists + config.top_k) - 1])
    assert {c for c in got if c[0] <= bar} == {c for c in plain if c[0] <= bar}
    assert splits < plain_splits


def _best(found: list[tuple], keep: int) -> set[tuple]:
    """The candidates at or above the `keep`-th distinct one's step: the kept ones, ties included."""
    keys = list(dict.fromkeys((g, m) for _, g, m in found))
    bar = next(t for t, g, m in found if (g, m) == keys[min(len(keys), keep) - 1])
    return {c for c in found if c[0] <= bar}


# 16 (ties in the best), 40: a split floor three times too high loses a best candidate; 1, 10 (two vendor
# islands, 15-30 s) in the slow tier.
@pytest.mark.parametrize("seed", [16, 40, *(pytest.param(i, marks=pytest.mark.slow) for i in (1, 10))])
def test_split_sync_floor_keeps_the_plain_rules_best_candidates(seed, monkeypatch):
    # A mixed split is priced only where its step with its own sync floor (SyncFloors.split_floor) could
    # enter. Under the plain rule (the order's floor alone) and every shortcut off (memo.reference_path()),
    # the search must keep the same best candidates (ties in any order), for fewer exact syncs.
    cluster, model, config = instance(seed)
    synced, exact = [], closed_step._synced_s
    monkeypatch.setattr(closed_step, "_synced_s", lambda *a, **k: synced.append(1) or exact(*a, **k))
    got, _, config = _search(cluster, model, config)
    fast = len(synced)
    monkeypatch.setattr(SyncFloors, "split_floor", lambda self, slots, layers, c: 0.0)
    with reference_path():
        plain, _, _ = _search(cluster, model, config)
    assert _best(got, config.finalists + config.top_k) == _best(plain, config.finalists + config.top_k)
    assert fast < len(synced) - fast
