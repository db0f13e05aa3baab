"""Calibration of the bf16 kernel numbers beyond A100: fitted on cited public measurements, checked on others.

1. Large GEMMs: each kind's `gemm_eff` is fitted (calibrate.fit_gemm_eff) on the MAMF rows predict/cited.py
   marks `fit`, and the kernel model with the catalog's number is compared with the rows it holds out
   (other shapes, library versions and the table's earlier method).
2. Fused attention: `flash_eff` is FlashAttention-2's stated peak over the bf16 peak (nothing to fit).
3. Held out entirely: per-GPU training throughput of MosaicML's MPT models with llm-foundry on 8 x H100
   80GB and 8 x A100 80GB (LLM_FOUNDRY below): the 37 configurations run on both GPUs with the same
   micro-batch and activation checkpointing. Predicted: one GPU's forward + backward (+ full
   recomputation where checkpointed) of the whole model by the operator model (compute.stage_times,
   flash attention, bf16) plus its 1/8 share of the optimizer step per micro-batch of the gradient
   accumulation. FSDP's all-gathers and reduce-scatters are not modelled (hethub has no FSDP), so the
   absolute errors include their exposed part; the H100 / A100 ratio of one configuration cancels
   what both runs share (model code, FSDP, data loading) and isolates what calibration is about: how
   the two kinds differ.

Run: PYTHONPATH=src python bench/calibration.py (a few seconds).
"""

from __future__ import annotations

import statistics
import sys
from collections import defaultdict
from dataclasses import replace

from hethub.predict.calibrate import fit_gemm_eff, gemm_tflops
from hethub.predict.cited import ATTENTION_POINTS, GEMM_POINTS
from hethub.predict.compute import kernel_params, stage_times
from hethub.spec.kind import DeviceKind, catalog
from hethub.spec.model import ModelSpec

LLM_FOUNDRY = ("mosaicml/llm-foundry scripts/train/benchmarking/README.md at 5e85bd62d (2024-01-06), tables "
               "'H100 80GB BF16' and 'A100 80GB with 1600 Gbps node-node interconnect (RoCE)'")
# MPT sizes (llm-foundry scripts/train/yamls/pretrain/mpt-*.yaml): d_model, n_layers, n_heads; expansion
# ratio 4 (GeLU), vocabulary 50368, learned positions (the table's NumParams grows with the sequence),
# tied embeddings.
MPT = {"760m": (1536, 24, 12), "1b": (2048, 24, 16), "3b": (2560, 32, 20), "7b": (4096, 32, 32),
       "13b": (5120, 40, 40), "30b": (7168, 48, 64)}
# (model, seq_len, micro-batch, activation checkpointing, H100 grad accum, H100 tokens/s/GPU, A100 grad
# accum, A100 tokens/s/GPU): every 8-GPU amp_bf16 row of the H100 table with an A100-80GB row of the
# same model, sequence, micro-batch and checkpointing.
ROWS = (
    ("760m", 512, 96, False, 2, 83749, 2, 29446),
    ("760m", 1024, 48, False, 2, 78581, 2, 29765),
    ("760m", 2048, 24, False, 2, 63147, 2, 32434),
    ("760m", 4096, 12, False, 2, 55459, 2, 27351),
    ("760m", 8192, 6, False, 2, 41825, 2, 20933),
    ("760m", 16384, 3, False, 2, 27815, 2, 14274),
    ("760m", 32768, 1, False, 2, 16291, 2, 8802),
    ("1b", 512, 56, False, 4, 52275, 4, 23148),
    ("1b", 1024, 18, False, 4, 48910, 4, 22112),
    ("1b", 2048, 14, False, 1, 45455, 4, 20513),
    ("1b", 4096, 7, False, 4, 38535, 4, 17807),
    ("1b", 8192, 3, False, 4, 29157, 4, 13814),
    ("1b", 16384, 2, False, 4, 19649, 4, 9956),
    ("1b", 32768, 1, False, 4, 12025, 4, 6275),
    ("1b", 65536, 1, True, 2, 5506, 2, 3044),
    ("3b", 512, 40, False, 6, 27965, 6, 12127),
    ("3b", 1024, 20, False, 6, 27046, 6, 11580),
    ("3b", 4096, 5, False, 6, 20964, 6, 9457),
    ("3b", 8192, 3, False, 6, 16578, 6, 7695),
    ("3b", 16384, 1, False, 6, 11152, 6, 5529),
    ("3b", 32768, 3, True, 6, 5873, 6, 3029),
    ("3b", 65536, 1, True, 2, 3262, 2, 1767),
    ("7b", 1024, 64, True, 2, 10203, 2, 4357),
    ("7b", 2048, 6, False, 1, 10643, 2, 4641),
    ("7b", 4096, 16, True, 2, 8611, 2, 3684),
    ("7b", 8192, 8, True, 2, 6935, 2, 3206),
    ("7b", 32768, 2, True, 2, 3318, 2, 1672),
    ("7b", 65536, 1, True, 2, 1956, 2, 1013),
    ("13b", 1024, 40, True, 3, 5502, 3, 2330),
    ("13b", 2048, 2, False, 1, 4792, 3, 2262),
    ("13b", 4096, 10, True, 3, 4717, 3, 2060),
    ("13b", 16384, 3, True, 3, 2985, 3, 1431),
    ("13b", 32768, 1, True, 3, 1976, 3, 1016),
    ("30b", 1024, 6, True, 21, 2084, 21, 946),
    ("30b", 2048, 3, True, 21, 2002, 21, 916),
    ("30b", 4096, 1, True, 21, 1802, 21, 814),
    ("30b", 8192, 1, True, 21, 1384, 21, 574),
)


def mpt(name: str, seq_len: int) -> ModelSpec:
    h, layers, heads = MPT[name]
    return ModelSpec(name=f"mpt-{name}", num_layers=layers, hidden_size=h, num_heads=heads, num_kv_heads=heads,
                     ffn_hidden_size=4 * h, vocab_size=50368, max_seq_len=seq_len, arch="gpt", activation="gelu",
                     tied_embeddings=True)


def predicted_tokens_per_gpu_s(kind: DeviceKind, *, model: ModelSpec, seq_len: int, mbs: int, ckpt: bool,
                               accum: int) -> float:
    t = stage_times(model, kind, layers=model.num_layers, embedding=True, head=True, tp=1, mbs=mbs,
                    seq_len=seq_len, recompute="full" if ckpt else "none", precision="bf16-mixed")
    return mbs * seq_len / (t.fwd_s + t.bwd_s + t.update_s / 8 / accum)


def uncited(kind: DeviceKind) -> DeviceKind:
    """The kind without the numbers fitted on cited public measurements (what it had before them)."""
    return replace(kind, **{f: None for f in ("gemm_eff", "flash_eff", "mem_eff") if getattr(kind, f"{f}_source")})


def gemm_section() -> list[float]:
    """Print each kind's fit and every point's error; return the held-out points' errors."""
    print("1. bf16 GEMM efficiency, fitted on the MAMF rows marked fit, checked on the held-out rows")
    held = []
    for name in dict.fromkeys(p.kind for p in GEMM_POINTS):
        kind = catalog()[name]
        params = kernel_params(kind, "bf16-mixed")[0]
        pts = [p for p in GEMM_POINTS if p.kind == name]
        fitted = fit_gemm_eff([(p.m, p.n, p.k, p.tflops) for p in pts if p.fit], params)
        print(f"  {name:10s} fitted gemm_eff {fitted:.4f} (catalog {kind.gemm_eff})")
        for p in pts:
            model = gemm_tflops(replace(params, gemm_eff=kind.gemm_eff), m=p.m, n=p.n, k=p.k)
            err = model / p.tflops - 1
            if not p.fit:
                held.append(err)
            print(f"    {'fit ' if p.fit else 'held'} {p.m:>5}x{p.n:>5}x{p.k:>5} measured {p.tflops:6.1f} model "
                  f"{model:6.1f} TFLOP/s {err * 100:+5.1f}%  ({p.note})")
    return held


def throughput_section() -> None:
    print(f"3. held out: per-GPU training throughput, MPT on 8 GPUs with llm-foundry ({LLM_FOUNDRY})")
    print(f"  {'model':5s} {'seq':>6s} {'mbs':>4s} ckpt   H100 pub/pred  err    A100 pub/pred  err  "
          "H100/A100 pub/pred  err")
    kinds = {"with": (catalog()["h100-sxm"], catalog()["a100-80gb"])}
    kinds["without"] = tuple(uncited(k) for k in kinds["with"])
    errs: dict[tuple[str, str], list[float]] = defaultdict(list)
    for name, seq, mbs, ckpt, h_acc, h_pub, a_acc, a_pub in ROWS:
        model = mpt(name, seq)
        for variant, (hk, ak) in kinds.items():
            h = predicted_tokens_per_gpu_s(hk, model=model, seq_len=seq, mbs=mbs, ckpt=ckpt, accum=h_acc)
            a = predicted_tokens_per_gpu_s(ak, model=model, seq_len=seq, mbs=mbs, ckpt=ckpt, accum=a_acc)
            eh, ea, er = h / h_pub - 1, a / a_pub - 1, (h / a) / (h_pub / a_pub) - 1
            for key, e in (("h100", eh), ("a100", ea), ("ratio", er)):
                errs[(variant, key)].append(e)
            if variant == "with":
                print(f"  {name:5s} {seq:6d} {mbs:4d} {'yes' if ckpt else 'no ':4s} {h_pub:6d}/{h:6.0f} "
                      f"{eh * 100:+5.0f}%  {a_pub:6d}/{a:6.0f} {ea * 100:+5.0f}%  {h_pub / a_pub:5.2f}/{h / a:5.2f} "
                      f"{er * 100:+6.1f}%")
    for variant, what in (("with", "with the cited numbers (catalog)"),
                          ("without", "without them (assumed defaults, as before the calibration)")):
        print(f"  {what}:")
        for key, label in (("h100", "H100 tokens/s/GPU"), ("a100", "A100 tokens/s/GPU"), ("ratio", "H100 / A100")):
            e = errs[(variant, key)]
            print(f"    {label:17s}: {len(e)} configurations, median error {statistics.median(e) * 100:+5.1f}%, "
                  f"median |err| {statistics.median(abs(x) for x in e) * 100:4.1f}%, "
                  f"max |err| {max(abs(x) for x in e) * 100:5.1f}%")


def main() -> int:
    held = gemm_section()
    print(f"  held-out GEMM rows: {len(held)}, median |err| {statistics.median(abs(e) for e in held) * 100:.1f}%, "
          f"max |err| {max(abs(e) for e in held) * 100:.1f}%")
    print("2. fused attention: FlashAttention-2's stated peak over the bf16 peak")
    for a in ATTENTION_POINTS:
        kind = catalog()[a.kind]
        print(f"  {a.kind:10s} {a.tflops:5.0f} TFLOP/s -> {a.tflops * 1e12 / kind.peak_flops:.3f} "
              f"(catalog flash_eff {kind.flash_eff}; {a.note})")
    throughput_section()
    return 0


if __name__ == "__main__":
    sys.exit(main())
