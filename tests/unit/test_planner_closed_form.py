"""The planner's closed forms agree with the predictor's rules where that is cheap, and its
mixed-pipeline search prunes only with floors that hold (search/mixed.py)."""

import itertools
import math
import random
import statistics

import hethub.search.mixed as families_mod
from hethub.predict.comm import boundary_time_s
from hethub.predict.memory import act_bytes_for
from hethub.schedules import get_schedule
from hethub.schedules.classic import round_trip_period_s
from hethub.schedules.simulate import simulate_pipeline_time
from hethub.search import PlannerConfig
from hethub.search.combine import Group
from hethub.search.mixed import _box_core, _box_level, _boxes_level, _rate_level, _split, families
from hethub.search.split import Slot
from hethub.search.sync_floors import SyncFloors
from hethub.search.templates import Searcher
from hethub.spec.cluster import parse_cluster
from hethub.spec.model import ModelSpec

NETWORK = {"inter_node_bw_bytes_per_s": 25e9, "inter_node_latency_s": 10e-6,
           "cross_kind_bw_bytes_per_s": 12.5e9, "cross_kind_latency_s": 40e-6}
SMALL = ModelSpec(name="m6x4k", num_layers=6, hidden_size=4096, num_heads=32, num_kv_heads=32, ffn_hidden_size=11008,
                  vocab_size=32000, max_seq_len=4096)


def test_round_trip_period_brings_1f1b_closed_form_to_the_simulation():
    # Random pipelines with hops up to about a stage's forward: the bottleneck-only period was up to
    # ~26 % low against the event simulation; with the round-trip floor the closed form is within a
    # few % and closer on average.
    rng, sched = random.Random(7), get_schedule("1f1b")
    old, new = [], []
    for _ in range(200):
        p = rng.randint(2, 8)
        fwd = tuple(rng.uniform(0.5, 2) for _ in range(p))
        bwd = tuple(2 * f * rng.uniform(0.8, 1.2) for f in fwd)
        p2p = (*(rng.choice([0.02, rng.uniform(0, 1.5)]) for _ in range(p - 1)), 0.0)
        m = rng.randint(2 * p, 40)
        sim = max(simulate_pipeline_time(fwd_s=list(fwd), bwd_s=list(bwd), p2p_s=list(p2p), num_micro_batches=m,
                                         schedule="1f1b"))
        plain = sched.per_micro_batch_s(fwd_s=fwd, bwd_s=bwd)
        for per, out in ((plain, old), (max(plain, round_trip_period_s(fwd, bwd, p2p)), new)):
            out.append((sched.fill_drain_s(fwd_s=fwd, bwd_s=bwd, p2p_s=p2p, per_micro_batch_s=per) + m * per) / sim)
    assert min(old) < 0.8
    assert min(new) > 0.93
    assert statistics.mean(abs(r - 1) for r in new) < 0.6 * statistics.mean(abs(r - 1) for r in old)


def test_round_trip_period_of_a_uniform_pipeline_is_the_documented_term():
    # Equal stages w and hops c: the whole pipeline's window gives w + 2 c (p - 1) / p.
    w, c, p = 3.0, 0.25, 5
    assert round_trip_period_s((1.0,) * p, (2.0,) * p, (c,) * (p - 1) + (0.0,)) == w + 2 * c * (p - 1) / p


def _cluster():
    return parse_cluster({"name": "t", "network": NETWORK, "group": [
        {"kind": "a100-40gb", "nodes": 2, "devices_per_node": 4},
        {"kind": "mi300x", "nodes": 1, "devices_per_node": 8}]}, where="test")


def test_hop_time_is_the_predictors_rule_on_representative_devices():
    cluster = _cluster()
    s = Searcher(cluster=cluster, model=SMALL, config=PlannerConfig(global_batch=16, seq_len=1024), profiles=None)
    numel = 2 * 1024 * SMALL.hidden_size
    nbytes = numel * act_bytes_for("bf16-mixed")
    a100 = [d.id for d in cluster.devices if d.kind == "a100-40gb"]
    mi = [d.id for d in cluster.devices if d.kind == "mi300x"]
    cases = [  # (from, to, senders, receivers): same node, across nodes, across kinds (split and not)
        (Slot("a100-40gb", 2), Slot("a100-40gb", 2), a100[0:2], a100[2:4]),
        (Slot("a100-40gb", 4), Slot("a100-40gb", 4), a100[0:4], a100[4:8]),
        (Slot("a100-40gb", 2), Slot("mi300x", 2), a100[0:2], mi[0:2]),
        (Slot("mi300x", 1), Slot("a100-40gb", 4), mi[0:1], a100[0:4]),
    ]
    for a, b, snd, rcv in cases:
        want = boundary_time_s(cluster, senders=snd, receivers=rcv, numel=numel, nbytes=nbytes)
        assert s.links.hop_s(a, b, numel=numel, nbytes=nbytes) == want
    # a single sender feeding four receivers on another node sends each its quarter (one copy through
    # its NIC, not four; layout.split_hop), then the receivers all-gather on their fast intra-node link
    one = s.links.hop_s(Slot("mi300x", 1), Slot("a100-40gb", 1), numel=numel, nbytes=nbytes)
    four = s.links.hop_s(Slot("mi300x", 1), Slot("a100-40gb", 4), numel=numel, nbytes=nbytes)
    assert one < four < 1.5 * one


def test_box_floors_are_below_every_member_they_stand_for():
    # The branch-and-bound drops a box when its floor cannot enter the finalists: a box's floor (and
    # each of its halves', down to single shapes) must be below the closed-form step of every candidate
    # in it (replica count, stage count per kind, order, split), here checked exhaustively on a small pool.
    cluster = _cluster()
    for schedule in ("1f1b", "gpipe", "zb-h1"):
        s = Searcher(cluster=cluster, model=SMALL, config=PlannerConfig(global_batch=16, seq_len=1024,
                                                                        schedule=schedule), profiles=None)
        mbs, checked = 2, 0
        ctx = SyncFloors(s, [])
        for fam, (root,) in families(s, dict(s.counts), mbs):
            best: dict[tuple, float] = {}  # (c, stage counts) -> best closed-form step of that shape
            for c in range(1, root[1] + 1):
                for ns in itertools.product(*[range(1, min(h, n // c) + 1) for h, n in zip(root[3], fam.slots,
                                                                                          strict=True)]):
                    for order in itertools.permutations(range(len(ns))):
                        segs = tuple((fam.subset[i], fam.tps[i], ns[i]) for i in order)
                        for pipe in s.mixed(segs, mbs):
                            est = s.estimate([Group(pipe, c)], mbs)
                            if est is not None:
                                best[(c, ns)] = min(best.get((c, ns), math.inf), est.step_time_s)
            checked += _boxes_below_members(s, ctx, fam=fam, root=root, best=best, mbs=mbs)
        assert checked > 100


def test_mixed_floors_beside_pure_groups_are_below_every_member():
    # Beside pure groups of different stage counts, the layer syncs chain through the replicas (a
    # stage runs its blocks in layer order): tail_floor prices the pure groups' longest chain and one
    # mixed stage's rings. Box and order floors must stay below every member's closed-form step.
    cluster = _cluster()
    s = Searcher(cluster=cluster, model=SMALL, config=PlannerConfig(global_batch=64, seq_len=1024), profiles=None)
    mbs, checked = 2, 0
    kinds = list(s.counts)
    # One pure pipeline of each of two kinds, with different stage counts (so their boundaries differ),
    # the best-ranked such pair that the allocator gives both some micro-batches.
    ranked = [[r.pipe for r in s.pure(kind, mbs, share=1.0) if r.pipe.num_devices <= s.counts[kind] // 2]
              for kind in kinds[:2]]
    pure = next([Group(a, 1), Group(b, 1)] for a in ranked[0] for b in ranked[1]
                if len(a.slots) != len(b.slots) and len(s.estimate([Group(a, 1), Group(b, 1)], mbs).groups) == 2)
    ctx = SyncFloors(s, pure)
    pool = {k: s.counts[k] - sum(g.pipe.devices_by_kind().get(k, 0) for g in pure) for k in kinds}
    assert ctx.tail_floor((), 1, 0) > 0
    for fam, (root,) in families(s, pool, mbs):
        best: dict[tuple, float] = {}
        for c in range(1, root[1] + 1):
            for ns in itertools.product(*[range(1, min(h, n // c) + 1) for h, n in zip(root[3], fam.slots,
                                                                                      strict=True)]):
                for order in itertools.permutations(range(len(ns))):
                    segs = tuple((fam.subset[i], fam.tps[i], ns[i]) for i in order)
                    devices = sum(t * n for _, t, n in segs)
                    for pipe in s.mixed(segs, mbs):
                        est = s.estimate([*pure, Group(pipe, c)], mbs)
                        # An allocation that gives a pure group no micro-batch is the candidate of
                        # another pure choice (that kind's "none"), which the search prices beside
                        # other floors: these floors, which count the pure groups' syncs, need not
                        # bound it.
                        if est is not None and len(est.groups) == len(pure) + 1:
                            best[(c, ns)] = min(best.get((c, ns), math.inf), est.step_time_s)
                            assert ctx.tail_floor(segs, c, devices) <= est.step_time_s
        checked += _boxes_below_members(s, ctx, fam=fam, root=root, best=best, mbs=mbs)
    assert checked > 20


def _boxes_below_members(s, ctx, *, fam, root, best: dict[tuple, float], mbs: int) -> int:
    """Walk the box tree from `root` as the search splits it and assert every box's floor is at most
    the best closed-form step of the shapes (c, stage counts) inside it; returns the boxes checked."""
    checked, boxes = 0, [root]
    if best:  # the family's rate floors, under which price_mixed floors none of its boxes yet
        assert _rate_level(ctx, fam, s.total_mb(mbs)) <= min(best.values()) * (1 + 1e-9), fam.subset
        cores = [(root, _box_core(s, fam, root, refine=False))]
        assert _boxes_level(ctx, fam, cores, s.total_mb(mbs)) <= min(best.values()) * (1 + 1e-9), fam.subset
    while boxes:
        box = boxes.pop()
        clo, chi, lo, hi = box
        inside = [v for (c, ns), v in best.items() if clo <= c <= chi
                  and all(a <= n <= b for a, n, b in zip(lo, ns, hi, strict=True))]
        level = _box_level(s, ctx, fam, box, mbs)
        loose = _box_level(s, ctx, fam, box, mbs, refine=False)  # the heap's first floor of a box
        if inside:
            checked += 1
            assert level is not None and level <= min(inside) * (1 + 1e-9), (fam.subset, fam.tps, box)
            assert loose is not None and loose <= level * (1 + 1e-12), (fam.subset, fam.tps, box)
        boxes += _split(fam, box)
    return checked


def test_spread_box_floors_are_below_their_members(monkeypatch):
    # Pools over COMPLETE_POOL devices are searched in single-shape boxes (c pipelines of n_k stages
    # per kind, c spread over the replica counts). The family's floor from its boxes' bottlenecks
    # (_boxes_level) and each box's loose floor must stay below every member's closed-form step.
    monkeypatch.setattr(families_mod, "COMPLETE_POOL", 0)
    for schedule in ("1f1b", "zb-h1"):
        s = Searcher(cluster=_cluster(), model=SMALL, config=PlannerConfig(global_batch=32, seq_len=1024,
                                                                        schedule=schedule), profiles=None)
        mbs, total, checked = 2, s.total_mb(2), 0
        ctx = SyncFloors(s, [])
        for fam, boxes in families(s, dict(s.counts), mbs):
            cores = [(box, _box_core(s, fam, box, refine=False)) for box in boxes]
            steps = []
            for (c, _, ns, _), core in cores:
                best = math.inf
                for order in itertools.permutations(range(len(ns))):
                    segs = tuple((fam.subset[i], fam.tps[i], ns[i]) for i in order)
                    for pipe in s.mixed(segs, mbs):
                        est = s.estimate([Group(pipe, c)], mbs)
                        if est is not None and est.groups == (Group(pipe, c),):  # every pipeline used
                            best = min(best, est.step_time_s)
                if best < math.inf:
                    assert core is not None
                    level = _box_level(s, ctx, fam, (c, c, ns, ns), mbs, refine=False, core=core)
                    assert level is not None and level <= best * (1 + 1e-9), (fam.subset, fam.tps, c, ns)
                    steps.append(best)
            if steps:
                assert _boxes_level(ctx, fam, cores, total) <= min(steps) * (1 + 1e-9), (fam.subset, fam.tps)
                checked += 1
        assert checked > 10


def test_family_bottleneck_by_runs_is_the_stage_by_stage_one():
    # Family.bottleneck reads a kind's stages at 1F1B's in-flight counts 1 .. t off runs of equal modes
    # (_held_runs); the floor must be the one its stage-by-stage grouping gives (taken here by passing
    # the same counts as a list, which the runs' check does not take for 1 .. p), past its memo.
    s = Searcher(cluster=_cluster(), model=ModelSpec(name="m40", num_layers=40, hidden_size=4096, num_heads=32,
                                                     num_kv_heads=32, ffn_hidden_size=11008, vocab_size=32000,
                                                     max_seq_len=4096),
                 config=PlannerConfig(global_batch=32, seq_len=4096), profiles=None)
    rng, checked = random.Random(3), 0
    for fam, _ in families(s, dict(s.counts), 1):
        for _ in range(20):
            top = tuple(rng.randint(0, 12) for _ in fam.subset)
            flights = tuple(range(1, rng.randint(2, 30) + 1))
            got = fam.bottleneck(top, flights)
            assert got == fam._bottleneck(top, list(flights))  # type: ignore[arg-type]
            checked += got is not None
    assert checked > 50
