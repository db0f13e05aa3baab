"""``hethub.train`` end to end on files: a TOML config, a Hugging Face starting folder, JSONL data
tokenised into a cache, held-out evaluation, checkpoints, and a resume under a different plan that
continues at exactly the next sequences (its losses equal the uninterrupted run's), then the export."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _harness import F, S, make_plan, warm_imports

pytest.importorskip("safetensors")

from hethub.runtime.hf_io import spec_from_folder, write_random_model
from hethub.runtime.launch import launch_forked

REPO = Path(__file__).resolve().parents[2]
STEPS = 4
TOL = 1e-5
MODEL = {"model_type": "llama", "hidden_act": "silu", "hidden_size": 32, "intermediate_size": 64,
         "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256,
         "max_position_embeddings": 32, "rms_norm_eps": 1e-6, "tie_word_embeddings": False}


warm_imports()


def _records(path: Path) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, path.read_text().splitlines())}


def _train(plan_path: Path, *, nproc: int, metrics: Path, args: list[str]) -> None:
    codes = launch_forked(plan_path, nproc=nproc, steps=STEPS, metrics=metrics, timeout_s=240,
                          extra_args=["--timeout-s", "60", *args])
    assert codes == [0] * nproc, codes


@pytest.mark.slow
def test_config_run_then_resume_under_another_plan(tmp_path: Path) -> None:
    (tmp_path / "src.json").write_text(json.dumps(MODEL))
    base = write_random_model(tmp_path / "src.json", tmp_path / "base", seed=3)
    spec, _ = spec_from_folder(base)
    data = tmp_path / "docs.jsonl"  # one document per line: the paragraphs of the runtime docs
    paras = [p for p in (REPO / "docs" / "runtime.md").read_text().split("\n\n") if p.strip()]
    data.write_text("".join(json.dumps({"body": p}) + "\n" for p in paras))
    # Plan A: two stages of one pipeline. Plan B: a TP-2 replica beside a two-stage replica, same batch.
    plan_a = make_plan([(2, 2, [(F, 1, 2), (S, 1, 2)])], spec=spec)
    plan_b = make_plan([(1, 2, [(F, 2, 4)]), (1, 2, [(S, 1, 1), (S, 1, 3)])], spec=spec)
    assert plan_a.global_batch == plan_b.global_batch == 4
    plan_a.save(tmp_path / "a.json")
    plan_b.save(tmp_path / "b.json")
    cfg = tmp_path / "run.toml"
    cfg.write_text(f'''
[model]
init_from = "{base}"
[optim]
lr = 1e-3
warmup_steps = 1
[data]
files = ["{data}"]
text_field = "body"
cache_dir = "{tmp_path / 'cache'}"
eval_sequences = 8
shuffle_seed = 1
[eval]
every = 2
batches = 2
[checkpoint]
dir = "{tmp_path / 'ck'}"
every = 2
keep = 0
''')
    _train(tmp_path / "a.json", nproc=2, metrics=tmp_path / "a.jsonl", args=["--config", str(cfg)])
    a = _records(tmp_path / "a.jsonl")
    assert sorted(a) == list(range(STEPS))
    assert all("eval_loss" in a[s] for s in (1, 3)) and "eval_loss" not in a[0]
    assert len(list((tmp_path / "cache").glob("tokens-*.bin"))) == 1
    # Resume plan B from A's step-2 checkpoint: flags override the config (plan, resume, export).
    _train(tmp_path / "b.json", nproc=4, metrics=tmp_path / "b.jsonl",
           args=["--config", str(cfg), "--resume", str(tmp_path / "ck" / "step-000002"),
                 "--checkpoint-dir", str(tmp_path / "ck-b"), "--export-hf", str(tmp_path / "hf")])
    b = _records(tmp_path / "b.jsonl")
    assert sorted(b) == [2, 3]
    for s in (2, 3):
        assert abs(b[s]["loss"] - a[s]["loss"]) <= TOL, (s, a[s]["loss"], b[s]["loss"])
    assert abs(b[3]["eval_loss"] - a[3]["eval_loss"]) <= TOL
    assert len(list((tmp_path / "cache").glob("tokens-*.bin"))) == 1, "the cached tokens were reused"
    manifest = json.loads((tmp_path / "ck-b" / "step-000004" / "manifest.json").read_text())
    assert manifest["meta"]["data"]["fingerprint"] and manifest["meta"]["hf_config"]["model_type"] == "llama"
    exported = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert exported["num_hidden_layers"] == 4 and (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    # The same export from the command line, in small shards.
    from hethub.cli import main

    assert main(["export", "--format", "hf", "--checkpoint", str(tmp_path / "ck-b"), "--out", str(tmp_path / "hf2"),
                 "--max-shard-size", "20KB"]) == 0
    shards = sorted((tmp_path / "hf2").glob("model-*-of-*.safetensors"))
    assert len(shards) > 3 and all(p.stat().st_size < 40_000 for p in shards)
