"""Loading a sharded Hugging Face folder: a rank holding one stage reads that stage's bytes and its
peak memory grows by about that stage's share, not by the whole model.

Measured in a fresh (spawned) process per case: peak resident memory (Linux VmHWM, reset through
/proc/self/clear_refs just before) while building the stage and loading it, against the same for the
whole model. Resident memory counts the file pages read through safetensors' memory map as well as
the parameters, so it is the honest peak of the load, not only the tensors kept."""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path

import pytest
import torch

pytest.importorskip("safetensors")

from hethub.runtime.hf_io import load_stage, write_folder
from hethub.runtime.model import StageModel
from hethub.runtime.tensor_parallel import TPContext
from hethub.spec.model import ModelSpec

SPEC = ModelSpec(name="mem", num_layers=8, hidden_size=256, num_heads=4, num_kv_heads=2, ffn_hidden_size=768,
                 vocab_size=512, max_seq_len=64)
TINY = ModelSpec(name="tiny", num_layers=2, hidden_size=32, num_heads=4, num_kv_heads=2, ffn_hidden_size=64,
                 vocab_size=64, max_seq_len=64)
CONFIG = {"model_type": "llama", "hidden_act": "silu", "hidden_size": 256, "intermediate_size": 768,
          "num_hidden_layers": 8, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512,
          "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "tie_word_embeddings": False}


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def _reset_peak() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def _measure(folder: str, warm: str, layers: tuple[int, int], embedding: bool, head: bool, q: mp.Queue) -> None:
    torch.set_num_threads(1)
    # The same load on a tiny folder first: a forked child faults in the code pages (torch, safetensors)
    # it runs, which would otherwise count as the load's memory.
    load_stage(StageModel(TINY, layers=(0, 2), embedding=True, head=True), warm)
    ok = _reset_peak()
    base = _status_kib("VmRSS")
    model = StageModel(SPEC, layers=layers, embedding=embedding, head=head)
    stats = load_stage(model, folder)
    peak = _status_kib("VmHWM")
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    q.put({"ok": ok, "peak_delta_bytes": (peak - base) * 1024, "bytes_read": stats.bytes_read, "held": held})


def _start(folder: Path, layers: tuple[int, int], *, embedding: bool = False, head: bool = False) -> tuple:
    # A fresh interpreter: a forked child would reuse memory the parent already had resident (its freed heap,
    # shared copy-on-write pages), hiding what the load itself takes.
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_measure, args=(str(folder / "big"), str(folder / "tiny"), layers, embedding, head, q))
    p.start()
    return p, q


def _result(started: tuple) -> dict:
    p, q = started
    out = q.get(timeout=300)
    p.join(timeout=30)
    if not out["ok"]:
        pytest.skip("peak RSS cannot be reset here (/proc/self/clear_refs not writable)")
    return out


def test_one_stage_of_a_sharded_folder_peaks_at_its_share(tmp_path: Path) -> None:
    full = StageModel(SPEC, layers=(0, SPEC.num_layers), embedding=True, head=True)
    whole_bytes = sum(p.numel() * p.element_size() for p in full.parameters())
    write_folder(tmp_path / "big", config=CONFIG, tensors=list(full.named_parameters()), max_shard_bytes=2 * 2**20)
    del full
    assert len(list((tmp_path / "big").glob("model-*.safetensors"))) > 8, "several shards"
    tiny = StageModel(TINY, layers=(0, 2), embedding=True, head=True)
    write_folder(tmp_path / "tiny", config=CONFIG, tensors=list(tiny.named_parameters()))

    # Both measured at once, each in its own fresh process: a middle stage (2 of 8 layers, no embedding or
    # head) and the whole model.
    runs = _start(tmp_path, (3, 5)), _start(tmp_path, (0, SPEC.num_layers), embedding=True, head=True)
    half = StageModel(SPEC, layers=(3, 5), embedding=False, head=False, tp=TPContext(size=2, rank=1))
    half_read = load_stage(half, tmp_path / "big").bytes_read
    stage, whole = _result(runs[0]), _result(runs[1])

    assert stage["bytes_read"] == stage["held"] and whole["bytes_read"] == whole_bytes
    # A TP rank of that stage reads only its slices (the norms are replicated).
    assert half_read == sum(p.numel() * p.element_size() for p in half.parameters()) < 0.6 * stage["held"]
    share = stage["held"] / whole_bytes  # ~0.24
    # Peak growth: the stage's parameters plus its file pages (~2x its share), far below the whole model's
    # own growth; the whole model's shows the measurement sees a full load.
    assert whole["peak_delta_bytes"] >= 0.9 * whole_bytes
    assert stage["peak_delta_bytes"] <= 2.5 * share * whole_bytes + 4 * 2**20
    assert stage["peak_delta_bytes"] < 0.6 * whole["peak_delta_bytes"]
    print(f"stage share {share:.2f}: peak +{stage['peak_delta_bytes'] / 2**20:.1f} MiB; whole model "
          f"{whole_bytes / 2**20:.1f} MiB: peak +{whole['peak_delta_bytes'] / 2**20:.1f} MiB")
