"""Bytes one Llama-style decoder layer saves for backward, per token and hidden unit, in bf16-mixed:
today's recipe beside the lean one, measured in one run.

    python bench/activation_bytes.py [--models small,llama-3-8b/4] [--seq-len 256] [--mbs 1]
        [--device cpu] [--json OUT]

Each row builds the runtime's own layer (``StageModel`` holding one decoder layer, flash attention,
TP rank 0 of 1 or 2, no / selective / full recomputation), runs its forward under autocast to bf16
and counts the storages autograd saves (``torch.autograd.graph.saved_tensors_hooks``, through
``hethub.profiler.tensor_memory.saved_for_backward``): each storage once, however many views of it
are saved. Parameters and buffers (RoPE tables) are not counted; nor are the parameters' bf16 copies
that the GEMMs save (autocast's weight cache, ZB-H1's split GEMMs): those are per parameter, not per
token, and are printed on their own below the table, in bytes per parameter.

The two recipes are the two ways the runtime builds a stage (``runtime/model.StageModel``):

* today: ``compute_dtype=None`` run under autocast with an fp32 input, which is what the runtime
  built for every mixed-precision plan before issue 32 (fp32 residual stream and stage messages,
  RMSNorm written out in fp32 ops, K and V repeated to every query head, fp32 RoPE tables), and what
  it still builds for fp32 plans;
* lean: ``compute_dtype=bfloat16``, what it builds for a bf16-mixed plan now (the residual stream and
  messages in bf16, a fused-kernel RMSNorm, SDPA's native GQA, bf16 RoPE tables).

``predicted`` is the memory model's count for the lean layer (``predict/memory/activations.py``);
``=`` marks a prediction equal to the measured bytes. A model ``NAME/k`` is preset NAME with hidden
size, heads, KV heads and FFN width divided by k (head size and every ratio kept; per-token
statistics, 4 bytes per token, weigh k times more per hidden unit). ZB-H1's weight copies: three
micro-batches' forwards held at once, as a ZB-H1 stage holds them until their W; today's recipe
cast each weight afresh per micro-batch (reproduced by dropping the cast cache before each).
"""

from __future__ import annotations

import argparse
import contextlib
import json
from dataclasses import replace
from pathlib import Path

import torch

from hethub.plan import Recompute
from hethub.predict.memory.activations import layer_bytes_per_token
from hethub.profiler.layers import tp_alone
from hethub.profiler.tensor_memory import saved_for_backward
from hethub.runtime import weight_grad
from hethub.runtime.model import StageModel
from hethub.runtime.precision import autocast
from hethub.spec.model import ModelSpec, get_model

PRECISION, DTYPE = "bf16-mixed", torch.bfloat16
RECIPES = {"today": None, "lean": DTYPE}  # StageModel's compute_dtype
TARGET = 36.0  # issue 32: bytes per token per hidden unit without recomputation, TP 1
TARGET_MODEL = "small"


def layer_model(entry: str, *, seq_len: int) -> ModelSpec:
    """Preset ``NAME`` or ``NAME/k`` (widths divided by k) as a one-layer model."""
    name, _, div = entry.partition("/")
    m, k = get_model(name), int(div or 1)
    if k > 1:
        if m.num_heads % k or m.num_kv_heads % k or m.hidden_size % k or m.ffn_hidden_size % k:
            raise SystemExit(f"--models {entry}: {k} does not divide the heads, KV heads, hidden and FFN widths of "
                             f"{name}. Fix: use a divisor of all four.")
        m = replace(m, name=entry, hidden_size=m.hidden_size // k, num_heads=m.num_heads // k,
                    num_kv_heads=m.num_kv_heads // k, ffn_hidden_size=m.ffn_hidden_size // k)
    return replace(m, num_layers=1, max_seq_len=max(m.max_seq_len, seq_len))


def _layer(model: ModelSpec, *, recipe: str, tp: int, recompute: str, seq_len: int,
           device: torch.device) -> StageModel:
    return StageModel(model, layers=(0, 1), embedding=False, head=False, tp=tp_alone(tp), recompute=recompute,
                      rope_len=seq_len, attention="flash", compute_dtype=RECIPES[recipe]).to(device)


def _input(model: ModelSpec, *, recipe: str, mbs: int, seq_len: int, device: torch.device) -> torch.Tensor:
    """The layer's input as the recipe's residual stream carries it: fp32 today, bf16 lean."""
    dtype = RECIPES[recipe] or torch.float32
    return torch.randn(mbs, seq_len, model.hidden_size, device=device).to(dtype).requires_grad_(True)


def saved_per_token_unit(model: ModelSpec, *, recipe: str, tp: int, recompute: str, mbs: int, seq_len: int,
                         device: torch.device) -> tuple[float, int]:
    """(activation bytes per token per hidden unit, activation bytes) one forward saves."""
    layer = _layer(model, recipe=recipe, tp=tp, recompute=recompute, seq_len=seq_len, device=device)
    x = _input(model, recipe=recipe, mbs=mbs, seq_len=seq_len, device=device)
    with autocast(device, PRECISION), \
            saved_for_backward(exclude=[*layer.parameters(), *layer.buffers()], weights=layer.parameters()) as rec:
        out = layer(x)
    del out
    return rec.nbytes / (mbs * seq_len * model.hidden_size), rec.nbytes


def weight_copies_per_param(model: ModelSpec, *, recipe: str, split: bool, in_flight: int, mbs: int, seq_len: int,
                            device: torch.device) -> tuple[float, int]:
    """(bytes of bf16 weight copies held per parameter, parameters) with ``in_flight`` micro-batches'
    forwards held; ``split``: through ZB-H1's split GEMMs (``weight_grad.recording``), else autocast's."""
    layer = _layer(model, recipe=recipe, tp=1, recompute="none", seq_len=seq_len, device=device)
    params = list(layer.parameters())
    outs = []  # held, so no copy's storage is freed and its address reused within the count
    weight_grad.drop_casts()
    with autocast(device, PRECISION), saved_for_backward(exclude=[*params, *layer.buffers()], weights=params) as rec:
        for _ in range(in_flight):
            if recipe == "today":
                weight_grad.drop_casts()
            with weight_grad.recording() if split else contextlib.nullcontext():
                outs.append(layer(_input(model, recipe=recipe, mbs=mbs, seq_len=seq_len, device=device)))
    n = sum(p.numel() for p in params)
    return rec.copy_bytes / n, n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=f"{TARGET_MODEL},llama-3-8b/4",
                    help="presets, NAME/k for one with widths divided by k")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--mbs", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()
    torch.manual_seed(0)
    device = torch.device(args.device)
    rows, copies, verdicts = [], [], []
    for entry in args.models.split(","):
        m = layer_model(entry, seq_len=args.seq_len)
        print(f"\n{entry}: hidden {m.hidden_size}, {m.num_heads} heads ({m.num_kv_heads} KV) of {m.head_dim}, "
              f"FFN {m.ffn_hidden_size}; micro-batch {args.mbs} x {args.seq_len} tokens, {PRECISION}, flash, "
              f"{device.type}")
        print(f"{'recompute':<10} {'TP':>2} {'today':>7} {'lean':>7} {'lean/today':>10} {'predicted':>10}")
        for tp in (1, 2):
            for rc in (r.value for r in Recompute):
                got = {rec: saved_per_token_unit(m, recipe=rec, tp=tp, recompute=rc, mbs=args.mbs,
                                                 seq_len=args.seq_len, device=device) for rec in RECIPES}
                pred_bytes = layer_bytes_per_token(m, tp=tp, seq_len=args.seq_len, attention="flash",
                                                   precision=PRECISION, recompute=rc) * args.mbs * args.seq_len
                exact = "=" if pred_bytes == got["lean"][1] else "!"
                today, lean = got["today"][0], got["lean"][0]
                pred = pred_bytes / (args.mbs * args.seq_len * m.hidden_size)
                print(f"{rc:<10} {tp:>2} {today:>7.2f} {lean:>7.2f} {lean / today:>10.3f} {pred:>9.2f}{exact}")
                rows.append({"model": entry, "tp": tp, "recompute": rc, "today": today, "lean": lean,
                             "predicted": pred, "predicted_exact": exact == "="})
                if entry == TARGET_MODEL and tp == 1 and rc == "none":
                    verdicts.append((today, lean))
        print("bf16 weight copies the GEMMs save, bytes per parameter (3 micro-batches in flight, TP 1):")
        for split, what in ((False, "1F1B/GPipe (autocast's weight cache)"), (True, "ZB-H1 (split GEMMs)")):
            per = {rec: weight_copies_per_param(m, recipe=rec, split=split, in_flight=3, mbs=args.mbs,
                                                seq_len=args.seq_len, device=device) for rec in RECIPES}
            n = per["lean"][1]
            print(f"  {what:<38} today {per['today'][0]:.2f}  lean {per['lean'][0]:.2f}")
            copies.append({"model": entry, "split": split, "today": per["today"][0], "lean": per["lean"][0]})
        print(f"  parameters: {n:,} fp32 (4 bytes each), counted in neither figure")
    for today, lean in verdicts:
        verdict = "met" if lean <= TARGET else "NOT MET"
        print(f"\ntarget (issue 32): <= {TARGET:g} bytes per token per hidden unit without recomputation, "
              f"{TARGET_MODEL}'s layer, TP 1: {lean:.2f} ({verdict}); today's recipe {today:.2f}, "
              f"x{lean / today:.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "weight_copies": copies}, indent=1))


if __name__ == "__main__":
    main()
