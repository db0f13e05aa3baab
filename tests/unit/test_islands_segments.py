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
