"""Corpus -> tokens -> each replica's share of each global batch.

The default corpus is real text present wherever Python is: the ``.py`` files of the standard
library, read from disk at run time in sorted path order (deterministic on a given Python), tokenised
byte-level (vocabulary 256). A Hugging Face tokenizer may be named instead; it must be available
locally (no downloads from inside a training job).

Global batch t holds sequences t*G .. t*G+G-1 of the token stream, each seq_len+1 tokens long
(inputs and shifted targets); replica r takes sequences [offset_r, offset_r + mbs_r * m_r) of it,
micro-batch i being the i-th run of mbs_r sequences. Shares never overlap and cover the batch.
"""

from __future__ import annotations

import os
import sysconfig
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from hethub.errors import RuntimeSetupError


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths().get("stdlib") or os.path.dirname(os.__file__))


def stdlib_files(root: Path | None = None) -> list[Path]:
    root = root or stdlib_dir()
    skip = {"site-packages", "dist-packages", "__pycache__"}
    return sorted(p for p in root.rglob("*.py") if not skip & set(p.relative_to(root).parts))


def byte_tokenize(text: bytes) -> list[int]:
    return list(text)


def hf_tokenizer(name: str, *, vocab_size: int) -> Callable[[bytes], list[int]]:
    try:
        from transformers import AutoTokenizer  # optional dependency
    except ImportError:
        raise RuntimeSetupError(f"tokenizer {name!r} needs the 'transformers' package, which is not installed. "
                                "Fix: pip install transformers, or drop --tokenizer to use bytes.") from None
    try:
        tok = AutoTokenizer.from_pretrained(name, local_files_only=True)
    except (OSError, ValueError) as err:
        raise RuntimeSetupError(f"tokenizer {name!r} is not available locally ({err}). Fix: download it first "
                                "or pass a local directory.") from None
    if len(tok) > vocab_size:
        raise RuntimeSetupError(f"tokenizer {name!r} has {len(tok)} tokens but the model's vocab_size is "
                                f"{vocab_size}. Fix: use a model whose vocabulary holds the tokenizer's.")
    return lambda text: tok.encode(text.decode("utf-8", errors="replace"), add_special_tokens=False)


def load_tokens(*, num_tokens: int, tokenize: Callable[[bytes], list[int]] = byte_tokenize,
                files: list[Path] | None = None) -> torch.Tensor:
    """At least ``num_tokens`` tokens (files read in order until enough; wraps when exhausted)."""
    out: list[int] = []
    for f in files if files is not None else stdlib_files():
        out += tokenize(f.read_bytes())
        if len(out) >= num_tokens:
            break
    if not out:
        raise RuntimeSetupError("the corpus is empty. Fix: check that the Python standard library is readable.")
    reps = -(-num_tokens // len(out))
    return torch.tensor((out * reps)[:num_tokens] if reps > 1 else out, dtype=torch.long)


@dataclass(frozen=True)
class Share:
    """One replica's part of every global batch."""

    offset: int  # first sequence within the global batch
    micro_batch_size: int
    num_micro_batches: int

    @property
    def num_samples(self) -> int:
        return self.micro_batch_size * self.num_micro_batches


class BatchSource:
    """Global batches from a token stream; every rank builds the same one and slices its share."""

    def __init__(self, tokens: torch.Tensor, *, global_batch: int, seq_len: int) -> None:
        self.tokens, self.global_batch, self.seq_len = tokens, global_batch, seq_len
        self.num_sequences = len(tokens) // (seq_len + 1)
        if self.num_sequences < 1:
            raise RuntimeSetupError(f"the corpus has fewer than seq_len+1={seq_len + 1} tokens. Fix: use more text.")

    def global_batch_at(self, step: int) -> torch.Tensor:
        """[global_batch, seq_len + 1] token ids of step ``step`` (sequences wrap around the corpus)."""
        idx = (torch.arange(self.global_batch) + step * self.global_batch) % self.num_sequences
        starts = idx * (self.seq_len + 1)
        return torch.stack([self.tokens[s:s + self.seq_len + 1] for s in starts.tolist()])


def micro_batches(batch: torch.Tensor, share: Share) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(inputs, targets) per micro-batch of this replica from a [G, S+1] global batch."""
    mine = batch[share.offset:share.offset + share.num_samples]
    out = []
    for i in range(share.num_micro_batches):
        seq = mine[i * share.micro_batch_size:(i + 1) * share.micro_batch_size]
        out.append((seq[:, :-1].contiguous(), seq[:, 1:].contiguous()))
    return out
