"""The two-level all-reduce's segments (hethub.islands.shard_segments): they tile the buffer, each
lies inside one shard of every island, and a member's bridge share is 1/k of the buffer."""

from __future__ import annotations

from fractions import Fraction
from itertools import pairwise

import pytest

from hethub.islands import padded_numel, segment_bytes, shard_segments


@pytest.mark.parametrize("sizes", [[2, 2], [1, 3], [2, 3], [3, 5, 2], [4, 4, 4], [1, 1]])
def test_segments_tile_the_buffer_inside_one_shard_per_island(sizes: list[int]) -> None:
    segs = shard_segments(sizes)
    assert segs[0].start == 0 and segs[-1].end == 1
    assert all(a.end == b.start for a, b in pairwise(segs))
    for seg in segs:
        for k, j in zip(sizes, seg.owners, strict=True):
            assert Fraction(j, k) <= seg.start < seg.end <= Fraction(j + 1, k)


def test_equal_islands_exchange_shard_j_among_the_jth_members() -> None:
    segs = shard_segments([4, 4])
    assert [s.owners for s in segs] == [(j, j) for j in range(4)]


@pytest.mark.parametrize(("numel", "sizes"), [(1000, [2, 3]), (7, [3, 5]), (1 << 20, [4, 4])])
def test_a_member_carries_its_shard_over_the_bridge(numel: int, sizes: list[int]) -> None:
    padded = padded_numel(numel, sizes)
    assert padded >= numel and all(padded % k == 0 for k in sizes)
    for k, members in zip(sizes, segment_bytes(numel, sizes, elem_bytes=4), strict=True):
        assert [sum(m) for m in members] == [padded // k * 4] * k


def test_predictor_prices_the_runtime_algorithm() -> None:
    """predict/sync_rules.py's two-level price: two island ring passes of the padded shard plus each
    member's segments all-reduced over the bridge, from the same segments the runtime sends."""
    from hethub.predict.comm import allreduce_time_s, ring_pass_time_s
    from hethub.predict.sync_rules import two_level_allreduce_time_s
    from hethub.spec.cluster import Link

    fast, slow = Link(100e9, 5e-6), Link(1e9, 100e-6)
    elems, sizes = 1 << 20, [4, 4]
    got = two_level_allreduce_time_s(elems=elems, elem_bytes=4, island_links=[fast, fast], island_sizes=sizes,
                                     bridge=slow)
    shard = elems // 4 * 4
    want = 2 * ring_pass_time_s(chunk_bytes=shard, participants=4, link=fast) + allreduce_time_s(
        nbytes=shard, participants=2, link=slow)
    assert got == pytest.approx(want)
    # A flat ring of all 8 over the slow link moves 4x the bytes per member across the bridge.
    assert got < allreduce_time_s(nbytes=elems * 4, participants=8, link=slow) / 2
    # Islands of 1 and 3: the lone member all-reduces three segments, one after another.
    lone = two_level_allreduce_time_s(elems=3000, elem_bytes=4, island_links=[fast, fast], island_sizes=[1, 3],
                                      bridge=slow)
    assert lone == pytest.approx(2 * ring_pass_time_s(chunk_bytes=4000, participants=3, link=fast)
                                 + 3 * allreduce_time_s(nbytes=4000, participants=2, link=slow))


def test_kept_segments_and_integer_bounds_equal_the_plain_fractions() -> None:
    """shard_segments is kept per island sizes (lists and tuples alike) and Segment.bounds works in
    integers: both equal the plain construction, its Fraction products truncated, for random sizes
    and buffer lengths, padded or not, asked in random order and again."""
    import random

    from hethub.islands import Segment

    rng = random.Random(5)
    sizes = [[rng.randint(1, 40) for _ in range(rng.randint(1, 4))] for _ in range(40)]
    for ks in [*sizes, *rng.sample(sizes, 20)]:
        cuts = sorted({Fraction(j, k) for k in ks for j in range(k + 1)})
        plain = tuple(Segment(a, b, tuple(int(a * k) for k in ks)) for a, b in pairwise(cuts))
        assert shard_segments(ks) == plain
        assert shard_segments(tuple(ks)) == plain
        for numel in (rng.randint(0, 10**9), padded_numel(rng.randint(1, 10**9), ks)):
            assert [s.bounds(numel) for s in plain] == [(int(s.start * numel), int(s.end * numel)) for s in plain]
