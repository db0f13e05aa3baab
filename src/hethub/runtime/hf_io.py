"""Hugging Face checkpoints in and out: a local folder of ``config.json`` + ``*.safetensors``.

In: each rank reads only the tensors of the parameters its stage holds, and of those only its TP
shard, straight from the safetensors files (``safe_open(...).get_slice(name)[a:b]`` reads just those
bytes), so no rank ever builds or reads the whole model. Out: a hethub checkpoint (full tensors by
parameter name, whatever plan wrote it) becomes ``config.json`` + sharded ``model-0000i-of-0000n
.safetensors`` + ``model.safetensors.index.json``, which ``transformers`` loads.

Supported: the Llama family as the runtime implements it — ``model_type`` llama (Llama 2/3),
mistral, qwen2 (q/k/v biases); grouped-query attention; RoPE with any base and the linear or llama3
scaling; tied or untied embeddings. Anything else stops with an error naming the config field.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hethub.errors import MissingExtraError, PlanError, SpecError, load_json
from hethub.spec.model import ModelSpec, _from_hf

INDEX = "model.safetensors.index.json"
MODEL_TYPES = ("llama", "mistral", "qwen2")
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
ROPE_TYPES = ("default", "linear", "llama3")

# hethub parameter name (within a layer) -> Hugging Face name (within model.layers.<i>.)
_LAYER = {
    "attn.wq": "self_attn.q_proj", "attn.wk": "self_attn.k_proj", "attn.wv": "self_attn.v_proj",
    "attn.wo": "self_attn.o_proj", "mlp.w1": "mlp.gate_proj", "mlp.w3": "mlp.up_proj", "mlp.w2": "mlp.down_proj",
    "attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm",
}
_TOP = {"embed.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
        "head.weight": "lm_head.weight"}


def _need_safetensors() -> Any:
    try:
        import safetensors  # optional dependency (the 'hf' extra)
    except ImportError:
        raise MissingExtraError("reading or writing Hugging Face checkpoints needs the 'safetensors' package. Fix: "
                                "pip install 'hethub[hf]'.") from None
    return safetensors


def hf_name(name: str) -> str:
    """The Hugging Face tensor name of hethub parameter ``name`` (``layers.3.attn.wq.bias`` ->
    ``model.layers.3.self_attn.q_proj.bias``)."""
    if name in _TOP:
        return _TOP[name]
    parts = name.split(".")
    if parts[0] != "layers" or len(parts) < 4:
        raise ValueError(f"parameter {name!r} has no Hugging Face counterpart")
    inner = ".".join(parts[2:-1])
    if inner not in _LAYER:
        raise ValueError(f"parameter {name!r} has no Hugging Face counterpart")
    return f"model.layers.{parts[1]}.{_LAYER[inner]}.{parts[-1]}"


# ---- config ---------------------------------------------------------------------------------------------
def read_config(folder: str | Path) -> dict[str, Any]:
    folder = Path(folder)
    path = folder / "config.json"
    cfg = load_json(path, cls=SpecError, invalid_fix="use the model's original config.json",
                    missing=f"'{folder}' has no config.json. Fix: pass a local Hugging Face model folder "
                            "(config.json and *.safetensors), e.g. one written by save_pretrained.")
    if not isinstance(cfg, dict):
        raise SpecError(f"{path}: expected a JSON object. Fix: use the model's original config.json.")
    return cfg


def _unsupported(path: str, field: str, value: Any, fix: str) -> SpecError:
    return SpecError(f"{path}: field '{field}' is {value!r}, which hethub's runtime does not implement. "
                             f"Fix: {fix}.")


def check_supported(cfg: dict[str, Any], *, where: str, seq_len: int | None = None) -> None:
    """Stop, naming the field, on any option whose forward the runtime would not reproduce exactly."""
    mt = cfg.get("model_type")
    if mt not in MODEL_TYPES:
        raise _unsupported(where, "model_type", mt, f"use a model of type {', '.join(MODEL_TYPES)}")
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise _unsupported(where, "hidden_act", act, "use a model with the SwiGLU (silu) MLP")
    for field in ("attention_bias", "mlp_bias"):
        if cfg.get(field):
            raise _unsupported(where, field, cfg[field], "use a model without these biases (Qwen2's q/k/v biases "
                               "are supported through model_type qwen2)")
    heads, h = cfg.get("num_attention_heads"), cfg.get("hidden_size")
    if cfg.get("head_dim") is not None and isinstance(heads, int) and isinstance(h, int) and heads \
            and cfg["head_dim"] != h // heads:
        raise _unsupported(where, "head_dim", cfg["head_dim"], f"use a model whose head_dim is hidden_size / "
                           f"num_attention_heads = {h // heads}")
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    kind = (rope.get("rope_type") or rope.get("type") or "default") if isinstance(rope, dict) else rope
    field = "rope_parameters.rope_type" if cfg.get("rope_parameters") else "rope_scaling.rope_type"
    if kind not in ROPE_TYPES:
        raise _unsupported(where, field, kind, f"use a model whose RoPE type is one of {', '.join(ROPE_TYPES)}")
    if isinstance(rope, dict) and rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise _unsupported(where, "partial_rotary_factor", rope["partial_rotary_factor"],
                           "use a model with rotary embeddings on the whole head")
    if mt == "qwen2" and cfg.get("use_sliding_window"):
        raise _unsupported(where, "use_sliding_window", True, "use a model with full attention")
    window = cfg.get("sliding_window")
    if mt == "mistral" and window is not None and seq_len is not None and seq_len > window:
        raise _unsupported(where, "sliding_window", window, f"train with seq_len <= {window} (within the window "
                           "full causal attention is exact)")


def spec_from_folder(folder: str | Path, *, seq_len: int | None = None) -> tuple[ModelSpec, dict[str, Any]]:
    """The runtime's description of a supported Hugging Face model folder, and its config."""
    cfg = read_config(folder)
    where = str(Path(folder) / "config.json")
    check_supported(cfg, where=where, seq_len=seq_len)
    return _from_hf(cfg, name=Path(folder).resolve().name), cfg


def check_spec_matches(spec: ModelSpec, folder: str | Path, *, seq_len: int | None = None) -> dict[str, Any]:
    """The folder's config, after checking that the plan's model is the folder's model (field by field)."""
    got, cfg = spec_from_folder(folder, seq_len=seq_len)
    a, b = got.to_dict(), spec.to_dict()
    for key in sorted((set(a) | set(b)) - {"name"}):
        if a.get(key) != b.get(key):
            raise PlanError(f"--init-from {folder}: the plan's model differs from the checkpoint's in field "
                                    f"'{key}' ({b.get(key)!r} in the plan, {a.get(key)!r} in config.json). Fix: make "
                                    f"the plan with --model {Path(folder) / 'config.json'}.")
    return cfg


# ---- reading ----------------------------------------------------------------------------------------------
def tensor_files(folder: str | Path) -> dict[str, Path]:
    """Hugging Face tensor name -> the safetensors file holding it. From the index when there is one,
    else from the headers of every ``*.safetensors`` file (a header read, not the tensors)."""
    safetensors = _need_safetensors()
    folder = Path(folder)
    index = folder / INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise SpecError(f"{index}: not a safetensors index ({err!r}). Fix: restore the file from the "
                                    "model's original folder.") from None
        return {k: folder / v for k, v in weight_map.items()}
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise SpecError(f"'{folder}' holds no *.safetensors file. Fix: save the model with safetensors "
                                "(save_pretrained's default) or convert its .bin files.")
    out: dict[str, Path] = {}
    for f in files:
        with safetensors.safe_open(str(f), framework="pt") as h:
            out |= dict.fromkeys(h.keys(), f)
    return out


def check_folder(spec: ModelSpec, folder: str | Path, *, seq_len: int | None = None) -> None:
    """``--init-from`` before any rank starts: the folder's config.json is the plan's model (PlanError
    otherwise), and every tensor the model needs is in a safetensors file that is present and complete,
    with the full model's shape (SpecError naming the file or tensor). Reads headers only."""
    safetensors = _need_safetensors()
    folder = Path(folder)
    check_spec_matches(spec, folder, seq_len=seq_len)
    files = tensor_files(folder)
    from hethub.runtime.model import StageModel

    with torch.device("meta"):
        model = StageModel(spec, layers=(0, spec.num_layers), embedding=True, head=True)
    want = {hf_name(n): list(p.shape) for n, p in model.named_parameters()}
    if spec.tied_embeddings and "model.embed_tokens.weight" not in files and "lm_head.weight" in files:
        want["lm_head.weight"] = want.pop("model.embed_tokens.weight")
    missing = sorted(n for n in want if n not in files)
    if missing:
        raise SpecError(f"--init-from {folder}: tensor '{missing[0]}' ({len(missing)} missing in all) is in no "
                        "safetensors file. Fix: use a complete model folder whose config.json matches its weights.")
    by_file: dict[Path, list[str]] = {}
    for name in want:
        by_file.setdefault(files[name], []).append(name)
    for path, names in sorted(by_file.items()):
        if not path.is_file():
            raise SpecError(f"--init-from {folder}: shard '{path.name}' (named in {INDEX}) is missing. Fix: copy "
                            "every shard of the model into the folder.")
        try:
            with safetensors.safe_open(str(path), framework="pt") as h:
                for name in names:
                    got = list(h.get_slice(name).get_shape())
                    if got != want[name]:
                        raise SpecError(f"{path}: tensor '{name}' has shape {got}, config.json makes it "
                                        f"{want[name]}. Fix: use the config.json that belongs to these weights.")
        except safetensors.SafetensorError as err:
            raise SpecError(f"{path}: not a complete safetensors file ({err}); it may be truncated. Fix: copy the "
                            "shard again from the model's original folder.") from None


def _chunk_bounds(size: int, parts: int, index: int) -> tuple[int, int]:
    """Rows ``torch.chunk(size, parts)[index]`` covers (the runtime's ``shard``)."""
    step = -(-size // parts)
    return min(size, index * step), min(size, (index + 1) * step)


@dataclass(frozen=True)
class LoadStats:
    tensors: int
    bytes_read: int  # bytes of tensor data materialised from the files (this rank's slices only)
    files: int


@torch.no_grad()
def load_stage(model: torch.nn.Module, folder: str | Path) -> LoadStats:
    """Copy this rank's slices of its stage's parameters from the Hugging Face folder into ``model``
    (a ``StageModel``). Every parameter the stage holds must be found, with the full model's shape."""
    safetensors = _need_safetensors()
    files = tensor_files(folder)
    tp, tied = model.tp, model.spec.tied_embeddings
    wanted: dict[Path, list[tuple[str, str, torch.nn.Parameter]]] = {}
    for name, p in model.named_parameters():
        src = hf_name(name)
        if tied and name == "embed.weight" and src not in files and "lm_head.weight" in files:
            src = "lm_head.weight"  # a tied model saved with only the head's copy
        if src not in files:
            raise SpecError(f"{folder}: tensor '{src}' (parameter '{name}') is in no safetensors file. Fix: "
                                    "use a complete model folder whose config.json matches its weights.")
        wanted.setdefault(files[src], []).append((name, src, p))
    count = read = 0
    for path, items in sorted(wanted.items()):
        with safetensors.safe_open(str(path), framework="pt") as h:
            for name, src, p in items:
                sl = h.get_slice(src)
                full = list(sl.get_shape())
                dim = model.shard_dim(name)
                want = list(p.shape)
                if dim is not None:
                    want[dim] *= tp.size
                if full != want:
                    raise SpecError(f"{path}: tensor '{src}' has shape {full}, the model needs {want}. Fix: "
                                            "use the config.json that belongs to these weights.")
                if dim is None or tp.size == 1:
                    t = sl[:]
                else:
                    a, b = _chunk_bounds(full[dim], tp.size, tp.rank)
                    t = sl[a:b] if dim == 0 else sl[:, a:b]
                p.copy_(t.to(p.dtype))
                count += 1
                read += t.numel() * t.element_size()
    return LoadStats(tensors=count, bytes_read=read, files=len(wanted))


# ---- writing ----------------------------------------------------------------------------------------------
def config_for(spec: ModelSpec, base: dict[str, Any] | None = None) -> dict[str, Any]:
    """config.json for ``spec``: ``base`` (the config a run started from) with its shape fields set, or
    a fresh Llama/Qwen2 config. RoPE is written in the rope_theta + rope_scaling layout, which every
    Transformers version reads."""
    if spec.arch != "llama" or spec.activation != "swiglu":
        raise SpecError(f"model {spec.name!r} is of arch {spec.arch!r}; only Llama-family models export to "
                                "the Hugging Face format. Fix: train a llama-arch model.")
    cfg = dict(base or {})
    mt = cfg.get("model_type") or ("qwen2" if spec.qkv_bias else "llama")
    if spec.qkv_bias != (mt == "qwen2"):
        mt = "qwen2" if spec.qkv_bias else "llama"
    cfg.pop("rope_parameters", None)
    cfg.update({
        "architectures": [ARCHITECTURES[mt]], "model_type": mt, "hidden_act": "silu",
        "hidden_size": spec.hidden_size, "intermediate_size": spec.ffn_hidden_size,
        "num_hidden_layers": spec.num_layers, "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads, "head_dim": spec.head_dim, "vocab_size": spec.vocab_size,
        "max_position_embeddings": spec.max_seq_len, "rms_norm_eps": spec.norm_eps, "rope_theta": spec.rope_theta,
        "rope_scaling": dict(spec.rope_scaling) or None, "tie_word_embeddings": spec.tied_embeddings,
        "torch_dtype": "float32",
    })
    if mt == "llama":
        cfg.update({"attention_bias": False, "mlp_bias": False})
    return cfg


def write_folder(out: str | Path, *, config: dict[str, Any], tensors: Iterable[tuple[str, torch.Tensor]],
                 max_shard_bytes: int = 2 * 2**30) -> list[Path]:
    """Write ``config.json``, the tensors (hethub names, full tensors) as safetensors shards of at most
    ``max_shard_bytes`` each (a larger tensor gets a shard of its own) and the index; returns every
    file written. Memory-mapped inputs are read as their shard is written."""
    from safetensors.torch import save_file

    _need_safetensors()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tied = bool(config.get("tie_word_embeddings"))
    items = [(hf_name(n), t) for n, t in tensors if not (tied and n == "head.weight")]
    groups: list[list[tuple[str, torch.Tensor]]] = [[]]
    size = 0
    for name, t in items:
        nbytes = t.numel() * t.element_size()
        if groups[-1] and size + nbytes > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append((name, t))
        size += nbytes
    n = len(groups)
    weight_map, paths = {}, []
    for i, group in enumerate(groups):
        fname = "model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        save_file({k: v.detach().contiguous() for k, v in group}, str(out / fname), metadata={"format": "pt"})
        weight_map |= dict.fromkeys((k for k, _ in group), fname)
        paths.append(out / fname)
    total = sum(t.numel() * t.element_size() for _, t in items)
    (out / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": dict(sorted(
        weight_map.items()))}, indent=2) + "\n", encoding="utf-8")
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return [*paths, out / INDEX, out / "config.json"]


def checkpoint_tensors(step_dir: Path, manifest: dict[str, Any]) -> Iterator[tuple[str, torch.Tensor]]:
    """(parameter name, full tensor) of every parameter of a hethub checkpoint, file by file (each file
    verified against the manifest's checksum first, then memory-mapped, so tensors are paged in as the
    shards are written rather than all held at once)."""
    from hethub.runtime.checkpoint_io import check_file, corrupt_error

    by_file: dict[str, list[str]] = {}
    for name, entry in manifest["tensors"].items():
        by_file.setdefault(entry["file"], []).append(name)
    for fname in sorted(by_file):
        problem = check_file(step_dir, fname, manifest["files"].get(fname, {}))
        if problem:
            raise corrupt_error(step_dir, fname, problem)
        data = torch.load(step_dir / fname, map_location="cpu", weights_only=True, mmap=True)
        for name in sorted(by_file[fname]):
            yield name, data[f"param:{name}"]


def export_checkpoint(checkpoint: str | Path, out: str | Path, *, max_shard_bytes: int = 2 * 2**30,
                      overwrite: bool = False, flag: str = "--out") -> Path:
    """Write the checkpoint (a step directory, or a root: its newest step) as a Hugging Face folder.
    A non-empty ``out`` needs ``overwrite`` (runtime/hf_export.py); the files written are listed in
    its ``hethub-export.json``."""
    from hethub.runtime.checkpoint_io import read_manifest, resolve
    from hethub.runtime.hf_export import check_export_target, finish_export

    stale = check_export_target(out, overwrite=overwrite, flag=flag)  # before any reading: a bad path costs nothing
    step_dir = resolve(checkpoint)
    manifest = read_manifest(step_dir)
    spec = ModelSpec.from_dict(manifest["model"], where=f"{step_dir}/manifest.json field 'model'")
    config = config_for(spec, manifest.get("meta", {}).get("hf_config"))
    # Names in the order Transformers lists them: embedding, layers in order, final norm, head.
    def order(item: tuple[str, torch.Tensor]) -> tuple[int, int, str]:
        n = item[0]
        if n.startswith("layers."):
            return (1, int(n.split(".")[1]), n)
        return (0 if n.startswith("embed") else 2, 0, n)

    tensors = sorted(checkpoint_tensors(step_dir, manifest), key=order)  # every file verified before any removal
    for p in stale:
        p.unlink(missing_ok=True)
    written = write_folder(out, config=config, tensors=tensors, max_shard_bytes=max_shard_bytes)
    finish_export(Path(out), written)
    return Path(out)


def write_random_model(config_path: str | Path, out: str | Path, *, seed: int = 0) -> Path:
    """A Hugging Face folder for ``config_path`` (a config.json) with hethub's seeded random weights:
    a stand-in for a downloaded model, for examples and tests (no network)."""
    from hethub.runtime.model import StageModel

    cfg = read_config(Path(config_path).parent) if Path(config_path).name == "config.json" else None
    if cfg is None:
        try:
            cfg = json.loads(Path(config_path).read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as err:
            raise SpecError(f"model config '{config_path}' is not readable JSON ({err}). Fix: pass a "
                                    "Hugging Face config.json.") from None
    check_supported(cfg, where=str(config_path))
    spec = _from_hf(cfg, name=Path(out).name)
    model = StageModel(spec, layers=(0, spec.num_layers), embedding=True, head=True, seed=seed)
    write_folder(out, config=config_for(spec, cfg), tensors=list(model.named_parameters()))
    return Path(out)
