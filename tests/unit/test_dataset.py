"""Tokenizers, the token cache and its fingerprint, packing, held-out split, order; the TOML config."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from hethub.errors import SpecError
from hethub.runtime import train_config
from hethub.runtime.dataset import DataConfig, PackedDataset, build_token_file, documents
from hethub.runtime.tokenizer import byte_tokenizer, load_tokenizer

REPO = Path(__file__).resolve().parents[2]
DOCS = ["alpha beta gamma delta. " * 20, "the quick brown fox jumps over the lazy dog\n" * 15, "short one"]


def _trained_tokenizer(path: Path) -> Path:
    """A byte-level BPE trained here, on this repository's own docs (local text, no download)."""
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>"], show_progress=False,
                                             initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    tok.train([str(REPO / "docs" / "runtime.md"), str(REPO / "README.md")], trainer)
    tok.save(str(path))
    return path


@pytest.fixture(scope="module")
def tok_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _trained_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer.json")


def _write_all_formats(d: Path) -> dict[str, list[Path]]:
    texts = []
    for i, doc in enumerate(DOCS):
        p = d / f"doc{i}.txt"
        p.write_text(doc, encoding="utf-8")
        texts.append(p)
    jsonl = d / "docs.jsonl"
    jsonl.write_text("".join(json.dumps({"body": doc, "id": i}) + "\n" for i, doc in enumerate(DOCS)))
    out = {"text": texts, "jsonl": [jsonl]}
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"body": DOCS}), d / "docs.parquet", row_group_size=2)
        out["parquet"] = [d / "docs.parquet"]
    except ImportError:
        pass
    return out


def test_tokenizer_from_tokenizer_json(tok_path: Path) -> None:
    tok = load_tokenizer(tok_path)
    assert tok.vocab_size == 400 and tok.eos_id == 0  # the special token was added first
    ids = tok.encode("the runtime trains a plan")
    assert len(ids) < len("the runtime trains a plan")  # merges learned from the docs apply
    assert tok._impl.decode(ids) == "the runtime trains a plan"
    assert load_tokenizer(tok_path.parent).fingerprint == tok.fingerprint  # a folder holding tokenizer.json
    assert byte_tokenizer().encode("ab") == [97, 98]


def test_formats_give_the_same_tokens(tmp_path: Path, tok_path: Path) -> None:
    files = _write_all_formats(tmp_path)
    tok = load_tokenizer(tok_path)
    streams = {}
    for fmt, paths in files.items():
        cfg = DataConfig(files=tuple(map(str, paths)), text_field="body", cache_dir=str(tmp_path / f"c-{fmt}"))
        streams[fmt] = build_token_file(cfg, tok).tokens().tolist()
    expect = [t for doc in DOCS for t in [*tok.encode(doc), tok.eos_id]]
    for fmt, got in streams.items():
        assert got == expect, fmt


def test_cache_is_reused_until_inputs_tokenizer_or_settings_change(tmp_path: Path, tok_path: Path) -> None:
    files = _write_all_formats(tmp_path)
    cfg = DataConfig(files=(str(tmp_path / "doc*.txt"),), cache_dir=str(tmp_path / "cache"))
    tok = load_tokenizer(tok_path)
    first = build_token_file(cfg, tok)
    again = build_token_file(cfg, tok)
    assert not first.reused and again.reused and again.fingerprint == first.fingerprint
    assert build_token_file(cfg, byte_tokenizer()).fingerprint != first.fingerprint
    files["text"][2].write_text("short one, edited", encoding="utf-8")
    edited = build_token_file(cfg, tok)
    assert not edited.reused and edited.fingerprint != first.fingerprint
    assert build_token_file(replace(cfg, settings={"x": "1"}), tok).fingerprint != edited.fingerprint


def test_jsonl_without_the_field_is_named(tmp_path: Path) -> None:
    p = tmp_path / "d.jsonl"
    p.write_text('{"content": "x"}\n')
    with pytest.raises(SpecError, match=r"'text'.*text_field"):
        list(documents(p, fmt="auto", text_field="text"))


def test_packing_heldout_and_order() -> None:
    tokens = np.arange(11 * 20, dtype=np.uint16)  # 20 sequences of seq_len + 1 = 11
    ds = PackedDataset(tokens, seq_len=10, global_batch=4, eval_sequences=4, shuffle_seed=5)
    assert ds.num_train == 16
    seqs = [int(r[0]) // 11 for step in range(8) for r in ds.global_batch_at(step)]  # two epochs
    assert sorted(seqs[:16]) == list(range(16)) and sorted(seqs[16:]) == list(range(16))
    assert seqs[:16] != seqs[16:] and seqs[:16] != list(range(16))  # reshuffled per epoch
    again = PackedDataset(tokens, seq_len=10, global_batch=4, eval_sequences=4, shuffle_seed=5)
    assert [int(r[0]) for r in again.global_batch_at(5)] == [int(r[0]) for r in ds.global_batch_at(5)]
    held = ds.eval_batches(max_batches=3)
    assert len(held) == 1 and [int(r[0]) // 11 for r in held[0]] == [16, 17, 18, 19]
    row = ds.global_batch_at(0)[0]
    assert row.tolist() == list(range(int(row[0]), int(row[0]) + 11))  # consecutive tokens: packed
    plain = PackedDataset(tokens, seq_len=10, global_batch=4, shuffle_seed=None)
    assert [int(r[0]) // 11 for r in plain.global_batch_at(1)] == [4, 5, 6, 7]


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser()
    ap.add_argument("--plan")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--tokenizer")
    ap.add_argument("--checkpoint-dir")
    ap.add_argument("--trace", action="store_true")
    train_config.add_arguments(ap)
    return ap


def test_config_file_with_flags_overriding(tmp_path: Path) -> None:
    cfg = tmp_path / "run.toml"
    cfg.write_text('[plan]\nfile = "p.json"\n[train]\nsteps = 7\ntrace = true\n[optim]\nlr = 1\n'
                   '[data]\nfiles = ["a.txt", "b.jsonl"]\neval_sequences = 8\n[eval]\nevery = 2\n')
    args = train_config.parse_with_config(_parser(), ["--config", str(cfg), "--steps", "9"])
    assert (args.plan, args.steps, args.lr, args.trace, args.data) == ("p.json", 9, 1.0, True, ["a.txt", "b.jsonl"])
    assert (args.eval_every, args.eval_sequences) == (2, 8)


@pytest.mark.parametrize(("text", "named"), [
    ('[train]\nstep = 3\n', "'train.step'"),
    ('[trainer]\nsteps = 3\n', r"\[trainer\]"),
    ('[train]\nsteps = "3"\n', "'train.steps' must be an integer"),
    ('[data]\nformat = "csv"\n', "'data.format' must be one of"),
])
def test_config_errors_name_the_field(tmp_path: Path, text: str, named: str) -> None:
    cfg = tmp_path / "run.toml"
    cfg.write_text(text)
    with pytest.raises(SpecError, match=named):  # one paragraph naming the field, no usage text (exit 2)
        train_config.parse_with_config(_parser(), ["--config", str(cfg)])


def test_example_config_prepares_a_launch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """examples/train/finetune-small.toml: the launcher writes the starting model folder and the plan."""
    pytest.importorskip("safetensors")
    from hethub import train
    from hethub.commands.launch_config import prepare_launch
    from hethub.plan import Plan
    from hethub.runtime.hf_io import spec_from_folder

    text = (REPO / "examples" / "train" / "finetune-small.toml").read_text()
    cfg = tmp_path / "run.toml"
    cfg.write_text(text.replace('"runs/finetune-small', f'"{tmp_path}/runs'))
    monkeypatch.chdir(REPO)  # the example's other paths are relative to the repository root
    got = prepare_launch(cfg)
    base = tmp_path / "runs" / "base"
    assert (base / "config.json").is_file() and (base / "model.safetensors").is_file()
    plan = Plan.load(got["plan"])
    assert plan.model.to_dict() | {"name": ""} == spec_from_folder(base)[0].to_dict() | {"name": ""}
    assert got["steps"] == 30 and got["metrics"].endswith("metrics.jsonl")
    args = train.parse_args(["--config", str(cfg), "--plan", got["plan"]])
    assert args.init_from == str(base) and args.eval_every == 10 and args.export_hf.endswith("/hf")
