"""Rebuild examples/train/tokenizer.json: a 512-token byte-level BPE trained on this repository's docs.

Run from the repository root: ``python examples/train/make_tokenizer.py``. Byte-level, so any text
encodes; ``<|endoftext|>`` separates packed documents.
"""

from __future__ import annotations

import glob
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers


def train(files: list[str], *, vocab_size: int = 512) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train(files, trainer)
    return tok


if __name__ == "__main__":
    out = Path(__file__).with_name("tokenizer.json")
    train(sorted(glob.glob("docs/*.md")) + ["README.md"]).save(str(out))
    print(f"wrote {out}")
