"""`hethub export` never mixes with a folder's files (refused unless --overwrite, which replaces only an
earlier export's files) and writes every file with one mode; `hethub report` refuses metrics whose
ranks ran another stage layout, though token counts and kinds agree (issue 34)."""

from __future__ import annotations

import dataclasses
import json
import os
import stat
from pathlib import Path

import pytest

from conftest import small_cluster
from hethub import cli
from hethub.plan import Pipeline, Plan, Stage
from hethub.spec.model import ModelSpec

pytest.importorskip("safetensors")

SPEC = ModelSpec(name="t", num_layers=4, hidden_size=32, num_heads=4, num_kv_heads=2, ffn_hidden_size=64,
                 vocab_size=256, max_seq_len=64)


def _checkpoint(root: Path) -> Path:
    """A one-rank hethub checkpoint of SPEC (what save_checkpoint writes, without ranks)."""
    from hethub.runtime import checkpoint_io as io
    from hethub.runtime.model import StageModel

    model = StageModel(SPEC, layers=(0, SPEC.num_layers), embedding=True, head=True, seed=0)
    tmp = io.prepare_tmp(root, 1)
    tensors = {f"param:{n}": p.detach().clone() for n, p in model.named_parameters()}
    entry = io.save_tensors(tmp / "model-r00000.pt", tensors)
    io.commit(root, 1, {"format": io.FORMAT, "version": io.VERSION, "step": 1, "model": SPEC.to_dict(),
                        "files": {"model-r00000.pt": dataclasses.asdict(entry)},
                        "tensors": {n: {"file": "model-r00000.pt", "shape": list(p.shape)}
                                    for n, p in model.named_parameters()}})
    return root


def test_export_refuses_a_non_empty_folder_and_overwrite_replaces_only_its_own_files(tmp_path, capsys):
    ck = _checkpoint(tmp_path / "ck")
    out = tmp_path / "hf"
    out.mkdir()
    (out / "README.md").write_text("the user's notes")
    assert cli.main(["export", "--checkpoint", str(ck), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "is not empty (README.md)" in err and "--overwrite" in err and "Traceback" not in err
    # Sharded first, then one file: the earlier shards go, the user's file stays, and only what was
    # written is listed.
    assert cli.main(["export", "--checkpoint", str(ck), "--out", str(out), "--overwrite",
                     "--max-shard-size", "40000"]) == 0
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(shards) > 1 and "README.md" not in capsys.readouterr().out
    assert cli.main(["export", "--checkpoint", str(ck), "--out", str(out), "--overwrite"]) == 0
    printed = capsys.readouterr().out
    assert "model.safetensors" in printed and "README.md" not in printed
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "config.json", "hethub-export.json",
                                                     "model.safetensors", "model.safetensors.index.json"]
    assert (out / "README.md").read_text() == "the user's notes"
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in out.iterdir() if p.name != "README.md"}
    mask = os.umask(0)
    os.umask(mask)
    assert set(modes.values()) == {0o666 & ~mask}, modes  # no 0600 shard beside a 0644 config.json


def test_report_refuses_metrics_of_another_stage_layout(tmp_path, capsys):
    cluster = small_cluster()
    two = Plan(model=SPEC, cluster=cluster, global_batch=4, seq_len=32, pipelines=(Pipeline(2, 2, (
        Stage("fast", (0,), (0, 2), embedding=True), Stage("fast", (1,), (2, 4), head=True))),)).validate()
    tp = Plan(model=SPEC, cluster=cluster, global_batch=4, seq_len=32, pipelines=(Pipeline(2, 2, (
        Stage("fast", (0, 1), (0, 4), embedding=True, head=True),)),)).validate()
    two.save(tmp_path / "two.json")
    tp.save(tmp_path / "tp.json")
    ranks = [{"rank": r, "kind": "fast", "pipeline": 0, "stage": r, "tp_rank": 0, "events": []} for r in (0, 1)]
    (tmp_path / "m.jsonl").write_text(json.dumps({"step": 0, "step_time_s": 1.0, "tokens": two.tokens_per_step,
                                                  "ranks": ranks}) + "\n")
    assert cli.main(["report", "--plan", str(tmp_path / "two.json"), "--metrics", str(tmp_path / "m.jsonl"),
                     "--out", str(tmp_path / "r2")]) == 0
    capsys.readouterr()
    code = cli.main(["report", "--plan", str(tmp_path / "tp.json"), "--metrics", str(tmp_path / "m.jsonl"),
                     "--out", str(tmp_path / "r1")])
    err = capsys.readouterr().err
    assert code == 3 and "rank 1 ran stage 1" in err and "another plan" in err and "Traceback" not in err
