"""The search's closed form evaluated fast gives exactly the plain rule's numbers.

`combine.step_time_s` walks each gradient-sync group's holders through the ends they last had
(`combine._sync_parts`, kept per layer split) instead of a cursor per stage, and recounts holders'
kinds only where a stage of another shape starts; `split.price` keeps each stage's terms. Here the
plain rule (a cursor per stage, every group's holders counted afresh: the rule as docs/planner.md
states it) is written out and compared bit for bit on random pipelines of several kinds, TP degrees,
empty stages, tied embeddings and schedules; and whole estimates and splits against
`memo.reference_path()` (every shortcut off)."""

import bisect
import itertools
import random
from collections import Counter
from dataclasses import replace

import pytest
from test_reference_search import instance

from hethub.layout import block_starts
from hethub.memo import reference_path
from hethub.predict.closed_step import step_time_s
from hethub.predict.comm import small_allreduce_time_s
from hethub.predict.stage_links import LinkBook, Slot
from hethub.schedules import get_schedule
from hethub.search.combine import Group, estimate
from hethub.search.split import PipeCost
from hethub.search.templates import Searcher
from hethub.spec.model import ModelSpec


def plain_step_time_s(groups, times_s, *, links, model, precision):
    """combine.step_time_s's rule, plainly: a cursor per stage, each sync group once all its holders are free."""
    replicas = sum(g.count for g in groups)
    total_devices = sum(g.count * g.pipe.num_devices for g in groups)
    cursor = [get_schedule(g.pipe.schedule, chunks=g.pipe.chunks).stage_finish_s(step_s=t, bwd_s=g.pipe.bwd_s,
                                                                                 p2p_s=g.pipe.p2p_s)
              for g, t in zip(groups, times_s, strict=True)]
    kinds = frozenset(sl.kind for g in groups for sl in g.pipe.slots)
    world_s = small_allreduce_time_s(nbytes=8.0, participants=sum(g.count * len(g.pipe.layers) for g in groups),
                                     link=links.replicas(kinds, devices=total_devices))

    def barrier():
        end = max(max(row) for row in cursor) + world_s
        for row in cursor:
            row[:] = [end] * len(row)

    barrier()
    if replicas > 1:
        gb = ModelSpec.state_bytes_per_param(precision)["grads"]
        h, v = model.hidden_size, model.vocab_size
        matmul, norm = model.layer_matmul_params, model.layer_params - model.layer_matmul_params
        starts = [block_starts(g.pipe.layers) for g in groups]
        cuts = sorted({a for st in starts for a in st if a < model.num_layers} | {0, model.num_layers})
        last = [len(g.pipe.layers) - 1 for g in groups]
        emb = [(gi, 0) for gi in range(len(groups))] + [
            (gi, last[gi]) for gi in range(len(groups)) if last[gi] > 0 and model.tied_embeddings]
        fused = {tuple(emb): [v * h, model.embedding_params - v * h]}
        parts = [(tuple((gi, bisect.bisect_right(starts[gi], a) - 1) for gi in range(len(groups))),
                  (b - a) * matmul, (b - a) * norm) for a, b in itertools.pairwise(cuts)]
        for hs, matrix, extra in [*parts, (tuple((gi, last[gi]) for gi in range(len(groups))),
                                           0 if model.tied_embeddings else v * h, model.final_norm_params)]:
            part = fused.setdefault(hs, [0.0, 0.0])
            part[0], part[1] = part[0] + matrix, part[1] + extra
        for hs, (matrix, extra) in fused.items():
            count = Counter()
            for gi, si in hs:
                count[groups[gi].pipe.slots[si].kind] += groups[gi].count
            tp = min(groups[gi].pipe.slots[si].tp for gi, si in hs)
            t = links.sync_allreduce_s(count, tp=tp, nbytes=(matrix / tp + extra) * gb, elem_bytes=gb,
                                       devices=total_devices)
            end = max(cursor[gi][si] for gi, si in hs) + t
            for gi, si in hs:
                cursor[gi][si] = end
    barrier()
    return max(c + u for g, row in zip(groups, cursor, strict=True) for c, u in zip(row, g.pipe.update_s, strict=True))


def random_split(rng, model):
    """Random layer counts, all with a boundary at the middle layer (the first or the last stage may hold
    only the embedding or the head)."""
    layers = []
    for n in (model.num_layers // 2, model.num_layers - model.num_layers // 2):
        p = rng.randint(1, min(3, n))
        half = [1] * p
        for _ in range(n - p):
            half[rng.randrange(p)] += 1
        layers += half
    if rng.random() < 0.3:
        layers.insert(rng.choice((0, len(layers))), 0)
    return layers


def random_pipe(rng, kinds, layers, schedule):
    """A pipeline of random stages over these layer counts: kinds in segments, TP degrees, times."""
    p = len(layers)
    kind = rng.choice(kinds)
    slots = []
    for _ in range(p):
        if rng.random() < 0.3:
            kind = rng.choice(kinds)
        slots.append(Slot(kind, rng.choice((1, 2, 4))))
    times = [tuple(rng.uniform(1e-3, 5e-2) for _ in range(p)) for _ in range(3)]
    return PipeCost(slots=tuple(slots), mbs=1, layers=tuple(layers), recompute=("none",) * p, fwd_s=times[0],
                    bwd_s=times[1], update_s=times[2], p2p_s=tuple(rng.uniform(0, 1e-3) for _ in range(p - 1)),
                    params=(1.0,) * p, schedule=schedule, chunks=2 if schedule == "interleaved" else 1)


@pytest.mark.parametrize("tied", [False, True])
def test_step_time_equals_the_plain_rule_bit_for_bit(tied):
    cluster, model, _ = instance(27)
    # A vocabulary large next to a layer: the embedding's sync group can outlast a chain of layers' groups.
    model = replace(model, tied_embeddings=tied, vocab_size=model.vocab_size * 8)
    links = LinkBook(cluster, runtime="hethub")
    kinds = sorted(cluster.kinds)
    rng = random.Random(7)
    # Splits with a common boundary: there every replica's stage ends at once, which restarts the chain of
    # sync groups (with tied embeddings a last stage then waits for the embedding's group).
    splits = [random_split(rng, model) for _ in range(4)]
    pipes = [random_pipe(rng, kinds, rng.choice(splits), rng.choice(("1f1b", "zb-h1", "interleaved")))
             for _ in range(16)]
    for _ in range(300):
        groups = [Group(rng.choice(pipes), rng.randint(1, 4)) for _ in range(rng.randint(1, 5))]
        times = [rng.uniform(0.5, 2.0) for _ in groups]
        want = plain_step_time_s(groups, times, links=links, model=model, precision="bf16-mixed")
        assert step_time_s(groups, times, links=links, model=model, precision="bf16-mixed") == want
        with reference_path():
            assert step_time_s(groups, times, links=links, model=model, precision="bf16-mixed") == want


def test_estimates_and_splits_equal_the_reference_path():
    """A searcher's template splits and combined estimates, fast and with every shortcut off."""
    cluster, model, config = instance(27)

    def run():
        s = Searcher(cluster=cluster, model=model, config=config, profiles=None)
        pipes = [pc for k in s.counts for tp in s.tps[k] for p in (1, 2, 4)
                 for pc in s.splits((Slot(k, tp),) * p, 1)]
        ests = [estimate([Group(a, 2), Group(b, 1)], total_mb=32, links=s.links, model=model, precision="bf16-mixed")
                for a, b in itertools.combinations(pipes, 2)]
        return [(p.layers, p.recompute, p.fwd_s, p.bwd_s, p.update_s, p.params, p.p2p_s) for p in pipes], \
            [(e.micro_batches, e.step_time_s) if e else None for e in ests]

    fast = run()
    with reference_path():
        plain = run()
    assert fast == plain
    assert len(fast[0]) > 4 and any(fast[1])


@pytest.mark.parametrize("seed", [27, 1])
def test_sync_walk_kept_per_groups_equals_the_plain_rule(seed):
    """closed_step keeps each set of groups' sync walk (memo `_WALKS`) and replays it per start time: the
    same groups at many times, with other counts, models and books in between, in random order, equal
    the plain rule bit for bit, and so does the reference path (no walk kept). One-kind TP-1 pipes of
    2 and 6 stages: the same all-reduces among replicas that fit a node and replicas that do not."""
    cluster, base, _ = instance(seed)
    models = [replace(base, tied_embeddings=tied, vocab_size=base.vocab_size * 8) for tied in (False, True)]
    books = [LinkBook(cluster, runtime="hethub"), LinkBook(cluster, runtime="deepspeed")]  # buckets, or one each
    kinds = sorted(cluster.kinds)
    rng = random.Random(11)
    splits = [random_split(rng, models[0]) for _ in range(3)]
    pipes = [random_pipe(rng, kinds, rng.choice(splits), rng.choice(("1f1b", "zb-h1", "interleaved")))
             for _ in range(8)]
    n = models[0].num_layers
    small = [replace(rng.choice(pipes), slots=(Slot(k, 1),) * p, layers=tuple(n // p + (i < n % p) for i in range(p)),
                     recompute=("none",) * p, fwd_s=(1e-2,) * p, bwd_s=(2e-2,) * p, update_s=(1e-3,) * p,
                     p2p_s=(1e-4,) * (p - 1), params=(1.0,) * p, schedule="1f1b", chunks=1)
             for k in kinds for p in (2, 6)]
    sets = [[(rng.choice(pipes), rng.randint(1, 3)) for _ in range(rng.randint(1, 4))] for _ in range(20)]
    sets += [[(p, c)] for p in small for c in (1, 2)]
    # The same pipes at swapped counts: as many replicas and devices, other holders per kind.
    sets += [[(p, c) for (p, _), (_, c) in zip(s, s[::-1], strict=True)] for s in sets]
    calls = [(s, rng.randint(0, 1), rng.randint(0, 1), rng.randint(0, 1), rng.uniform(0.5, 2.0))
             for s in sets for _ in range(6)]
    rng.shuffle(calls)

    def run():
        out = []
        for chosen, more, mi, bi, t in calls:
            groups = [Group(p, c + more) for p, c in chosen]
            out.append(step_time_s(groups, [t] * len(groups), links=books[bi], model=models[mi],
                                   precision="bf16-mixed"))
        return out

    want = [plain_step_time_s([Group(p, c + more) for p, c in chosen], [t] * len(chosen), links=books[bi],
                              model=models[mi], precision="bf16-mixed") for chosen, more, mi, bi, t in calls]
    assert run() == want  # one pass, the walks kept between calls
    # Each all-reduce time the walks kept is the rule's for its key's holders per kind and least degree.
    gb = ModelSpec.state_bytes_per_param("bf16-mixed")["grads"]
    for book in books:
        for (_, within), rings in book.ring_cache.items():  # kept by what the device count decides
            devices = next(d for d in range(1, 1 << 16) if book.within_node(d) == within)
            for (matrix, extra, kinds, tp), t in rings.items():
                assert t == book.sync_allreduce_s(dict(kinds), tp=tp, nbytes=(matrix / tp + extra) * gb, elem_bytes=gb,
                                                  devices=devices)
    with reference_path():
        assert run() == want
