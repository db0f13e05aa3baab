"""Data: the default corpus, and each replica's non-overlapping share of every global batch."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from hethub.layout import block_starts
from hethub.runtime.data import BatchSource, Share, load_tokens, micro_batches, stdlib_files


@given(st.lists(st.tuples(st.integers(1, 4), st.integers(1, 5)), min_size=1, max_size=4))
def test_replica_shares_cover_the_global_batch_without_overlap(reps: list[tuple[int, int]]) -> None:
    g = sum(b * m for b, m in reps)
    offsets = block_starts([b * m for b, m in reps])
    batch = torch.arange(g).unsqueeze(1).repeat(1, 5)  # row i holds sequence id i
    seen: list[int] = []
    for off, (b, m) in zip(offsets, reps, strict=True):
        mbs = micro_batches(batch, Share(offset=off, micro_batch_size=b, num_micro_batches=m))
        assert len(mbs) == m and all(x.shape == (b, 4) and y.shape == (b, 4) for x, y in mbs)
        seen += [int(i) for x, _ in mbs for i in x[:, 0]]
        assert [int(i) for x, _ in mbs for i in x[:, 0]] == list(range(off, off + b * m))
    assert sorted(seen) == list(range(g))


def test_targets_are_inputs_shifted_by_one() -> None:
    src = BatchSource(torch.arange(100), global_batch=2, seq_len=4)
    (x, y), = micro_batches(src.global_batch_at(1), Share(offset=0, micro_batch_size=2, num_micro_batches=1))
    assert x.tolist() == [[10, 11, 12, 13], [15, 16, 17, 18]]
    assert y.tolist() == [[11, 12, 13, 14], [16, 17, 18, 19]]


def test_batches_are_consecutive_and_wrap_around() -> None:
    src = BatchSource(torch.arange(50), global_batch=3, seq_len=4)  # 10 sequences
    assert src.global_batch_at(0)[:, 0].tolist() == [0, 5, 10]
    assert src.global_batch_at(3)[:, 0].tolist() == [45, 0, 5]


def test_default_corpus_is_stdlib_text_in_deterministic_order() -> None:
    files = stdlib_files()
    assert files == sorted(files) and any(f.name == "os.py" for f in files)
    a, b = load_tokens(num_tokens=5000), load_tokens(num_tokens=5000)
    assert torch.equal(a, b) and len(a) >= 5000 and int(a.max()) < 256


def test_short_corpus_wraps(tmp_path) -> None:
    f = tmp_path / "x.py"
    f.write_bytes(b"abc")
    assert load_tokens(num_tokens=7, files=[f]).tolist() == [97, 98, 99, 97, 98, 99, 97]
