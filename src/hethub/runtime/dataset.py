"""Training data from local files: tokenised once into a memory-mapped token file, packed into
sequences, split into training and held-out sequences, and handed out by global batch.

Inputs are text files (one document each), JSONL (one document per line, its ``text_field``) or
Parquet (one document per row of the ``text_field`` column). Documents are joined with the
tokenizer's end-of-document token and the stream is cut into sequences of ``seq_len + 1`` tokens
(packing: no padding, documents cross sequence boundaries). The token file is cached under a
fingerprint of the inputs' bytes, the tokenizer and the settings; any change re-tokenises.

Order: the last ``eval_sequences`` sequences are held out; training sequences are visited in a
permutation drawn per epoch from ``shuffle_seed`` (identity when None). Global batch ``t`` is
positions ``t·G … t·G+G-1`` of that visiting order, so the data position is a pure function of the
step: a resume under any plan with the same global batch continues at exactly the next sequence,
and each replica's share (``runtime.data.Share``: offset and count within the batch, unequal across
replicas) is the same slice it would have taken in an uninterrupted run.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from hethub.errors import MissingExtraError, RuntimeSetupError, SpecError
from hethub.runtime.tokenizer import Tokenizer

FORMATS = ("auto", "text", "jsonl", "parquet")


@dataclass(frozen=True)
class DataConfig:
    files: tuple[str, ...]  # paths or glob patterns, expanded and sorted
    format: str = "auto"  # by extension: .jsonl/.json -> jsonl, .parquet -> parquet, else text
    text_field: str = "text"
    cache_dir: str = "runs/token-cache"
    eval_sequences: int = 0  # held-out sequences at the end of the stream
    shuffle_seed: int | None = 0
    settings: dict[str, str] = field(default_factory=dict)  # extra settings that change the tokens


def expand_files(cfg: DataConfig) -> list[Path]:
    out: list[Path] = []
    for pat in cfg.files:
        hits = sorted(glob.glob(pat, recursive=True)) if any(c in pat for c in "*?[") else [pat]
        if not hits or not all(Path(h).is_file() for h in hits):
            raise SpecError(f"data field 'files': {pat!r} matches no file. Fix: give existing files or a "
                                    "glob pattern that matches some.")
        out += [Path(h) for h in hits]
    if not out:
        raise SpecError("data field 'files' is empty. Fix: list text, JSONL or Parquet files.")
    return out


def _format_of(path: Path, fmt: str) -> str:
    if fmt != "auto":
        return fmt
    return {".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet"}.get(path.suffix.lower(), "text")


def documents(path: Path, *, fmt: str, text_field: str) -> Iterator[str]:
    kind = _format_of(path, fmt)
    if kind == "text":
        yield path.read_text(encoding="utf-8", errors="replace")
    elif kind == "jsonl":
        with path.open(encoding="utf-8") as f:
            for i, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as err:
                    raise SpecError(f"{path}:{i}: not valid JSON ({err}). Fix: one JSON object per line."
                                            ) from None
                if not isinstance(rec, dict) or not isinstance(rec.get(text_field), str):
                    raise SpecError(f"{path}:{i}: no string field {text_field!r}. Fix: set data field "
                                            "'text_field' to the field holding the text.")
                yield rec[text_field]
    elif kind == "parquet":
        try:
            import pyarrow.parquet as pq  # optional dependency (the 'hf' extra)
        except ImportError:
            raise MissingExtraError(f"{path}: Parquet input needs the 'pyarrow' package. Fix: pip install "
                                    "'hethub[hf]', or convert the data to JSONL.") from None
        pf = pq.ParquetFile(path)
        if text_field not in pf.schema_arrow.names:
            raise SpecError(f"{path}: no column {text_field!r} (columns: {', '.join(pf.schema_arrow.names)}). "
                                    "Fix: set data field 'text_field' to the column holding the text.")
        for batch in pf.iter_batches(columns=[text_field]):
            yield from (t for t in batch.column(0).to_pylist() if t is not None)
    else:
        raise SpecError(f"data field 'format' is {fmt!r}. Fix: use one of {', '.join(FORMATS)}.")


PROBE_BYTES = 1 << 20  # how much of a text file is read to tell text from binary
_PROBE_LINES = 5  # JSONL lines parsed before launch (all of them are when tokenising)


def check_inputs(cfg: DataConfig) -> list[Path]:
    """Before any rank starts: every input exists, is not empty and reads as its format says (text:
    UTF-8 without NUL bytes in its first MiB, so a binary file is refused; JSONL: the first lines are
    objects with a string ``text_field``; Parquet: the ``text_field`` column exists). SpecError (exit 2)
    naming the file and the fix. Returns the expanded file list."""
    files = expand_files(cfg)
    for path in files:
        if path.stat().st_size == 0:
            raise SpecError(f"data file '{path}' is empty. Fix: remove it from --data (data.files) or fill it.")
        kind = _format_of(path, cfg.format)
        if kind == "text":
            with path.open("rb") as f:
                head = f.read(PROBE_BYTES)
            try:
                (head if len(head) < PROBE_BYTES else head[:-4]).decode("utf-8")  # a character may be cut
                binary = b"\0" in head
            except UnicodeDecodeError:
                binary = True
            if binary:
                raise SpecError(f"data file '{path}' is not UTF-8 text (it holds binary data) but is read as "
                                f"format 'text'{' (by its extension)' if cfg.format == 'auto' else ''}. Fix: pass "
                                "text, JSONL or Parquet files, or set --data-format (data.format) to the file's "
                                "format.")
        elif kind == "jsonl":
            docs = documents(path, fmt="jsonl", text_field=cfg.text_field)
            try:
                for _ in zip(range(_PROBE_LINES), docs, strict=False):
                    pass
            except UnicodeDecodeError:
                raise SpecError(f"data file '{path}' is not UTF-8 text (it holds binary data) but is read as "
                                "JSONL. Fix: pass JSON lines, or set --data-format (data.format) to the file's "
                                "format.") from None
        elif kind == "parquet":
            next(iter(documents(path, fmt="parquet", text_field=cfg.text_field)), None)
    return files


def fingerprint(cfg: DataConfig, files: list[Path], tok: Tokenizer) -> str:
    """sha256 over every input's bytes, the tokenizer's fingerprint and the settings that change tokens."""
    h = hashlib.sha256()
    h.update(json.dumps({"format": cfg.format, "text_field": cfg.text_field, "tokenizer": tok.fingerprint,
                         "settings": cfg.settings, "version": 1}, sort_keys=True).encode())
    for f in files:
        h.update(f"\0{f.name}\0".encode())
        with f.open("rb") as fh:
            for chunk in iter(lambda fh=fh: fh.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


@dataclass(frozen=True)
class TokenFile:
    path: Path
    fingerprint: str
    num_tokens: int
    dtype: str
    num_documents: int
    reused: bool

    def tokens(self) -> np.ndarray:
        return np.memmap(self.path, dtype=self.dtype, mode="r", shape=(self.num_tokens,))


def build_token_file(cfg: DataConfig, tok: Tokenizer) -> TokenFile:
    """The cached token file of ``cfg`` (tokenising now if no cache with this fingerprint exists).
    Written to a temporary name and renamed: a concurrent or killed writer never leaves half a file."""
    files = expand_files(cfg)
    fp = fingerprint(cfg, files, tok)
    cache = Path(cfg.cache_dir)
    path, meta_path = cache / f"tokens-{fp[:20]}.bin", cache / f"tokens-{fp[:20]}.json"
    if meta_path.is_file() and path.is_file():
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
        size = meta.get("num_tokens", -1) * np.dtype(meta.get("dtype", "uint8")).itemsize
        if meta.get("fingerprint") == fp and path.stat().st_size == size:
            return TokenFile(path=path, fingerprint=fp, num_tokens=meta["num_tokens"], dtype=meta["dtype"],
                             num_documents=meta["num_documents"], reused=True)
    cache.mkdir(parents=True, exist_ok=True)
    dtype = "uint16" if tok.vocab_size <= 2**16 else "uint32"
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    count = docs = 0
    with tmp.open("wb") as out:
        for f in files:
            for text in documents(f, fmt=cfg.format, text_field=cfg.text_field):
                ids = tok.encode(text) + ([tok.eos_id] if tok.eos_id is not None else [])
                np.asarray(ids, dtype=dtype).tofile(out)
                count += len(ids)
                docs += 1
    os.replace(tmp, path)
    meta = {"fingerprint": fp, "num_tokens": count, "dtype": dtype, "num_documents": docs, "tokenizer": tok.name,
            "inputs": [str(f) for f in files], "config": asdict(cfg)}
    meta_tmp = meta_path.with_suffix(f".tmp{os.getpid()}")
    meta_tmp.write_text(json.dumps(meta, indent=1) + "\n", encoding="utf-8")
    os.replace(meta_tmp, meta_path)
    return TokenFile(path=path, fingerprint=fp, num_tokens=count, dtype=dtype, num_documents=docs, reused=False)


class PackedDataset:
    """Global batches of packed sequences from a token file; the same object on every rank."""

    def __init__(self, tokens: np.ndarray, *, seq_len: int, global_batch: int, eval_sequences: int = 0,
                 shuffle_seed: int | None = 0) -> None:
        self.tokens, self.seq_len, self.global_batch = tokens, seq_len, global_batch
        self.shuffle_seed = shuffle_seed
        total = len(tokens) // (seq_len + 1)
        self.num_eval = eval_sequences
        self.num_train = total - eval_sequences
        if self.num_train < 1:
            raise RuntimeSetupError(f"the data has {total} sequences of seq_len+1={seq_len + 1} tokens, and "
                                    f"{eval_sequences} are held out for evaluation: none is left to train on. Fix: "
                                    "add data or hold out fewer sequences.")
        self._perm: dict[int, np.ndarray] = {}

    def _sequence(self, index: int) -> np.ndarray:
        s = index * (self.seq_len + 1)
        return np.asarray(self.tokens[s:s + self.seq_len + 1], dtype=np.int64)

    def train_index(self, position: int) -> int:
        """Which training sequence the ``position``-th visited one is (epochs wrap, each reshuffled)."""
        epoch, i = divmod(position, self.num_train)
        if self.shuffle_seed is None:
            return i
        if epoch not in self._perm:
            self._perm = {epoch: np.random.default_rng([self.shuffle_seed, epoch]).permutation(self.num_train)}
        return int(self._perm[epoch][i])

    def global_batch_at(self, step: int) -> torch.Tensor:
        """[global_batch, seq_len + 1] token ids of optimizer step ``step``."""
        start = step * self.global_batch
        rows = [self._sequence(self.train_index(start + j)) for j in range(self.global_batch)]
        return torch.from_numpy(np.stack(rows))

    def eval_batches(self, *, max_batches: int) -> list[torch.Tensor]:
        """Held-out global batches (whole batches only, at most ``max_batches``)."""
        n = min(max_batches, self.num_eval // self.global_batch)
        first = self.num_train
        return [torch.from_numpy(np.stack([self._sequence(first + b * self.global_batch + j)
                                           for j in range(self.global_batch)])) for b in range(n)]
