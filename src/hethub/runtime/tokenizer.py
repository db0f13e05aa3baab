"""Tokenizers for training data: byte-level (the default, vocabulary 256) or a local ``tokenizer.json``
read with the ``tokenizers`` library (what every Hugging Face fast tokenizer is saved as).

Each tokenizer has a fingerprint (a hash of what fixes its output) that goes into the token cache's
fingerprint, so changing the tokenizer re-tokenises the data.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hethub.errors import MissingExtraError, SpecError

# Tokens taken as the end-of-document separator when the config names none, in this order.
EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|im_end|>")


@dataclass(frozen=True)
class Tokenizer:
    """``encode(text) -> ids``; ``eos_id`` separates packed documents (None: nothing between them)."""

    name: str
    vocab_size: int
    eos_id: int | None
    fingerprint: str
    _impl: Any = None

    def encode(self, text: str) -> list[int]:
        if self._impl is None:
            return list(text.encode("utf-8"))
        return self._impl.encode(text, add_special_tokens=False).ids


def byte_tokenizer() -> Tokenizer:
    return Tokenizer(name="bytes", vocab_size=256, eos_id=None, fingerprint="bytes-v1")


def load_tokenizer(path: str | Path | None, *, eos_token: str | None = None) -> Tokenizer:
    """The tokenizer in ``path`` (a ``tokenizer.json``, or a folder holding one); bytes for None/'bytes'."""
    if path is None or str(path) == "bytes":
        if eos_token:
            raise SpecError("data field 'eos_token' needs a tokenizer file; the byte-level tokenizer has "
                                    "no special tokens. Fix: drop eos_token or set tokenizer.")
        return byte_tokenizer()
    p = Path(path)
    file = p / "tokenizer.json" if p.is_dir() else p
    if not file.is_file():
        raise SpecError(f"tokenizer '{path}' does not exist (looked for {file}). Fix: pass a tokenizer.json "
                                "file, a folder holding one, or 'bytes'.")
    try:
        from tokenizers import Tokenizer as HFTokenizer  # optional dependency (the 'hf' extra)
    except ImportError:
        raise MissingExtraError("a tokenizer.json needs the 'tokenizers' package. Fix: pip install 'hethub[hf]', "
                                "or use the byte-level tokenizer.") from None
    raw = file.read_bytes()
    try:
        impl = HFTokenizer.from_str(raw.decode("utf-8"))
    except Exception as err:  # the library raises its own exception type for malformed files
        raise SpecError(f"{file}: not a readable tokenizer.json ({err}). Fix: save it with the tokenizers "
                                "library (Tokenizer.save) or a Hugging Face tokenizer's save_pretrained.") from None
    vocab = impl.get_vocab(with_added_tokens=True)
    if eos_token:
        if eos_token not in vocab:
            raise SpecError(f"data field 'eos_token' is {eos_token!r}, which {file} does not have. Fix: name "
                                    "one of its special tokens.")
        eos = vocab[eos_token]
    else:
        eos = next((vocab[t] for t in EOS_CANDIDATES if t in vocab), None)
    fp = hashlib.sha256(raw + f"|eos={eos}".encode()).hexdigest()
    return Tokenizer(name=str(file), vocab_size=impl.get_vocab_size(with_added_tokens=True), eos_id=eos,
                     fingerprint=fp, _impl=impl)


def check_fits(tok: Tokenizer, *, vocab_size: int) -> None:
    if tok.vocab_size > vocab_size:
        raise SpecError(f"tokenizer {tok.name!r} has {tok.vocab_size} tokens but the model's vocab_size is "
                                f"{vocab_size}. Fix: use a model whose vocabulary holds the tokenizer's.")
