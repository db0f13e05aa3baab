"""Hugging Face weights in and out, against ``transformers`` itself (no downloads: the models are small
random ones built and saved here). A heterogeneous plan (two stages, one of them TP 2, beside a
replica of a different split and size) loads the folder, and its logits and loss equal the
Transformers forward within 1e-5 in fp32; after a few steps the exported folder loads back into
Transformers and equals a single-device run."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from _harness import OPTIM, TIMEOUT, F, S, make_plan, run_ranks

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from hethub.comm.factory import make_communicator  # noqa: E402
from hethub.errors import SpecError  # noqa: E402
from hethub.plan import Plan  # noqa: E402
from hethub.runtime.checkpoint import save_checkpoint  # noqa: E402
from hethub.runtime.hf_io import export_checkpoint, load_stage, spec_from_folder  # noqa: E402
from hethub.runtime.model import StageModel  # noqa: E402
from hethub.runtime.optim import OptimConfig, build_optimizer  # noqa: E402
from hethub.runtime.trainer import Trainer, TrainerConfig  # noqa: E402

TOL = 1e-5
SEQ = 16
STEPS = 3
OPT = replace(OPTIM, total_steps=STEPS)
BASE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, vocab_size=300,
            max_position_embeddings=64)
VARIANTS: dict[str, tuple[Any, dict[str, Any]]] = {
    # GQA (2 KV heads for 4 query heads), saved in several shards with an index
    "llama-gqa": ("LlamaForCausalLM", {"num_key_value_heads": 2, "rope_theta": 500000.0}),
    "llama-tied": ("LlamaForCausalLM", {"num_key_value_heads": 4, "tie_word_embeddings": True}),
    "qwen2-bias": ("Qwen2ForCausalLM", {"num_key_value_heads": 2, "rope_theta": 1e6}),
    "llama3-rope": ("LlamaForCausalLM", {"num_key_value_heads": 2, "rope_theta": 500000.0, "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16}}),
}


def _warm_imports() -> None:
    """The first optimizer step imports a lot (~5 s): pay it once here, not in every forked rank."""
    model = torch.nn.Linear(2, 2)
    opt, _ = build_optimizer(model, OPT)
    model(torch.ones(1, 2)).sum().backward()
    opt.step()


_warm_imports()


def build_hf(folder: Path, variant: str, *, max_shard_size: str | None = None) -> Path:
    """A random model of ``variant`` saved with save_pretrained (safetensors)."""
    arch, extra = VARIANTS[variant]
    cls = getattr(transformers, arch)
    cfg = cls.config_class(**BASE, **extra)
    torch.manual_seed(7)
    model = cls(cfg)
    with torch.no_grad():  # Transformers zero-initialises biases; make them matter
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.2)
    model.save_pretrained(folder, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    out = {v: build_hf(root / v, v) for v in VARIANTS}
    out["llama-gqa"] = build_hf(root / "llama-gqa-sharded", "llama-gqa", max_shard_size="100KB")
    return out


def hetero_plan(folder: Path) -> Plan:
    """Pipeline 0: a TP-2 stage (2 layers) then a TP-1 stage (1 layer), 2x2 samples; pipeline 1: one
    stage of all 3 layers on the emulated slow kind, 1x2 samples."""
    spec, _ = spec_from_folder(folder)
    return make_plan([(2, 2, [(F, 2, 2), (S, 1, 1)]), (1, 2, [(S, 1, 3)])], spec=spec, seq_len=SEQ)


def data(plan: Plan, steps: int = STEPS) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, plan.model.vocab_size, (plan.global_batch, SEQ + 1), generator=g) for _ in range(steps)]


def hf_forward(folder: Path, batch: torch.Tensor) -> tuple[np.ndarray, float]:
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model(input_ids=batch[:, :-1], labels=batch[:, :-1].clone())
        # labels shift inside Transformers: target of position i is token i+1 of the input. Our loss uses
        # the full seq_len targets, so compute the same from the logits.
        loss = torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), batch[:, 1:].flatten())
    return out.logits.numpy(), float(loss)


def _worker(rank: int, plan: Plan, folder: str, batches: list[torch.Tensor], ckpt: str | None) -> dict[str, Any]:
    comm = make_communicator(plan=plan, rank=rank, timeout=TIMEOUT)
    trainer = Trainer(plan, rank=rank, comm=comm, cfg=TrainerConfig(optim=OPT))
    stats = load_stage(trainer.model, folder)
    captured: list[torch.Tensor] = []
    model = trainer.model
    if model.has_head:
        w = model.embed.weight if model.spec.tied_embeddings else model.head.weight
        model.norm.register_forward_hook(lambda _m, _i, out: captured.append(torch.nn.functional.linear(out, w)))
    loss, _ = trainer.forward_backward(batches[0])
    trainer.sync_grads()
    trainer.clip_and_update()
    for step in range(1, len(batches)):
        trainer.train_step(batches[step], step=step)
    if ckpt is not None:
        save_checkpoint(trainer, root=ckpt, step=len(batches))
    place = trainer.place
    return {"loss": loss, "bytes_read": stats.bytes_read, "head": model.has_head, "tp_rank": place.tp_rank,
            "tp": place.stage.tp, "offset": place.sample_offset, "mbs": place.micro_batch_size,
            "vocab_parallel": model.vocab_parallel,
            "logits": [c.detach().numpy().copy() for c in captured[:place.num_micro_batches]]}


def assemble_logits(res: list[dict[str, Any]], plan: Plan) -> np.ndarray:
    """The global batch's logits [G, S, V] from every head rank's micro-batches (vocabulary shards joined)."""
    out = np.full((plan.global_batch, SEQ, plan.model.vocab_size), np.nan, dtype=np.float32)
    for r in res:
        if not r["head"]:
            continue
        for i, lg in enumerate(r["logits"]):
            rows = slice(r["offset"] + i * r["mbs"], r["offset"] + (i + 1) * r["mbs"])
            if r["vocab_parallel"]:
                v = lg.shape[-1]
                out[rows, :, r["tp_rank"] * v:(r["tp_rank"] + 1) * v] = lg
            else:
                out[rows] = lg
    assert not np.isnan(out).any(), "every sample's logits come from some head rank"
    return out


def reference_train(folder: Path, batches: list[torch.Tensor], optim: OptimConfig) -> StageModel:
    """One device, the whole model loaded from the folder, the whole global batch per step."""
    spec, _ = spec_from_folder(folder)
    model = StageModel(spec, layers=(0, spec.num_layers), embedding=True, head=True)
    load_stage(model, folder)
    opt, sched = build_optimizer(model, optim)
    for batch in batches:
        (model(batch[:, :-1], batch[:, 1:]) / batch.shape[0]).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), optim.grad_clip)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
    return model


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_and_loss_match_transformers(folders: dict[str, Path], variant: str) -> None:
    folder = folders[variant]
    plan = hetero_plan(folder)
    batches = data(plan, steps=1)
    ref_logits, ref_loss = hf_forward(folder, batches[0])
    res = run_ranks(plan.world_size, _worker, plan, str(folder), batches, None)
    got = assemble_logits(res, plan)
    assert np.abs(got - ref_logits).max() <= TOL
    for r in res:
        assert abs(r["loss"] - ref_loss) <= TOL, (r["loss"], ref_loss)


@pytest.mark.parametrize("variant", ["llama-gqa", "llama-tied", "qwen2-bias"])
def test_train_export_reload(folders: dict[str, Path], tmp_path: Path, variant: str) -> None:
    """3 steps under the heterogeneous plan (GQA: from a sharded folder), checkpoint, export, reload."""
    folder = folders[variant]
    if variant == "llama-gqa":
        assert len(list(folder.glob("*.safetensors"))) > 1, "the fixture saves this variant in shards"
    plan = hetero_plan(folder)
    batches = data(plan)
    run_ranks(plan.world_size, _worker, plan, str(folder), batches, str(tmp_path / "ckpt"))
    out = export_checkpoint(tmp_path / "ckpt", tmp_path / "export", max_shard_bytes=150_000)
    assert len(list(out.glob("model-*.safetensors"))) > 1 and (out / "model.safetensors.index.json").is_file()
    ref = reference_train(folder, batches, OPT)
    probe = data(plan, steps=4)[3]
    logits, loss = hf_forward(out, probe)
    with torch.no_grad():
        cap: list[torch.Tensor] = []
        w = ref.embed.weight if ref.spec.tied_embeddings else ref.head.weight
        ref.norm.register_forward_hook(lambda _m, _i, o: cap.append(torch.nn.functional.linear(o, w)))
        ref_loss = float(ref(probe[:, :-1], probe[:, 1:])) / probe.shape[0]
    assert np.abs(logits - cap[0].numpy()).max() <= TOL
    assert abs(loss - ref_loss) <= TOL
    # The exported weights differ from the folder's: training happened.
    start, _ = hf_forward(folder, probe)
    assert np.abs(start - logits).max() > 1e-3


def test_tied_export_has_no_head_tensor(folders: dict[str, Path], tmp_path: Path) -> None:
    folder = folders["llama-tied"]
    plan = make_plan([(2, 2, [(F, 1, 2), (F, 2, 1)])], spec=spec_from_folder(folder)[0], seq_len=SEQ)
    run_ranks(plan.world_size, _worker, plan, str(folder), data(plan, steps=1), str(tmp_path / "ckpt"))
    out = export_checkpoint(tmp_path / "ckpt", tmp_path / "export")
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), framework="pt") as h:
        names = set(h.keys())
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert model.config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


@pytest.mark.parametrize(("field", "value", "named"), [
    ("model_type", "gemma", "'model_type'"),
    ("rope_scaling", {"rope_type": "yarn", "factor": 4.0}, "'rope_scaling.rope_type'"),
    ("attention_bias", True, "'attention_bias'"),
    ("hidden_act", "gelu", "'hidden_act'"),
    ("head_dim", 32, "'head_dim'"),
])
def test_unsupported_options_are_named(tmp_path: Path, field: str, value: Any, named: str) -> None:
    import json

    cfg = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 300, field: value}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(SpecError, match=named):
        spec_from_folder(tmp_path)


def test_sharded_folder_without_index_loads_the_same(folders: dict[str, Path], tmp_path: Path) -> None:
    """Without model.safetensors.index.json the shards' headers say where each tensor is."""
    import shutil

    sharded = folders["llama-gqa"]
    bare = tmp_path / "bare"
    shutil.copytree(sharded, bare)
    (bare / "model.safetensors.index.json").unlink()
    spec, _ = spec_from_folder(sharded)
    a = StageModel(spec, layers=(0, spec.num_layers), embedding=True, head=True, seed=1)
    b = StageModel(spec, layers=(0, spec.num_layers), embedding=True, head=True, seed=2)
    load_stage(a, sharded)
    load_stage(b, bare)
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert torch.equal(pa, pb), name
