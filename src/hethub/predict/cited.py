"""Public measurements the catalog's bf16 kernel numbers are fitted on, each with its source.

Two shape classes, each a number per kind (spec/catalog.toml carries the fitted values and names these
sources; tests/unit/test_calibration.py checks the catalog reproduces them):

- **Large GEMMs** (`gemm_eff`): the Maximum Achievable Matmul FLOPS (MAMF) table of Stas Bekman's
  ml-engineering book, a brute-force search over bf16 `torch.mm` shapes per accelerator that reports
  the best shape and its TFLOP/s. Rows measured with the table's current method (mean of 100 timed
  iterations after 50 warm-ups, caches flushed between iterations) are fitted on; rows the table
  showed earlier (an older method: no cache flush, other shapes and library versions) are held out
  and only reported, so a fit is checked on a shape and software it did not see.
- **Fused attention** (`flash_eff`): the FlashAttention-2 paper's stated peak throughput of its
  kernel, with its FLOP convention (causal half the scores, backward 2.5x the forward), which is
  the operator model's (opmodel.attention_core_ops).

A kind absent here keeps the assumed defaults (calibrate.DEFAULT_*) and its predictions say so.
"""

from __future__ import annotations

from dataclasses import dataclass

_MAMF = ("stas00/ml-engineering, compute/accelerator/README.md, 'Maximum Achievable Matmul FLOPS comparison "
         "table' (BF16)")
MAMF_CURRENT = f"{_MAMF} at commit e695968 (2025-09-01; method: mean of 100 iterations, caches flushed)"
MAMF_V1 = f"{_MAMF} at commit 37d41a7 (2024-10-17; first method: no cache flush)"
MAMF_JAN25 = f"{_MAMF} at commit 15791b3 (2025-01-04)"
FA2 = ("Dao, FlashAttention-2 (arXiv:2307.08691), Sec. 4 and 4.1: FLOPs = 4 seq^2 head_dim heads, halved "
       "with a causal mask, backward 2.5x the forward")


@dataclass(frozen=True)
class GemmPoint:
    """One published bf16 GEMM measurement: C[m, n] = A[m, k] @ B[k, n] at `tflops` (10^12 FLOP/s)."""

    kind: str  # catalog kind it calibrates
    m: int
    n: int
    k: int
    tflops: float
    fit: bool  # True: fitted on; False: held out, reported only
    source: str
    note: str = ""


@dataclass(frozen=True)
class AttentionPoint:
    """A published fused-attention kernel throughput on `kind` (bf16/fp16, the paper's FLOP convention)."""

    kind: str
    tflops: float
    source: str
    note: str = ""


# MAMF's "Best Shape MxNxK" is the torch.mm(A[m, k], B[k, n]) its finder timed (mamf-finder.py,
# benchmark_mm). A row names its accelerator, not a memory size: an A100 row calibrates both A100
# kinds (same 108 SMs and 312 TFLOP/s; a GEMM at these shapes is compute-bound on either), the H100
# row H200 too (the table notes "H200 is the same": the same GH100 compute), the GH200 row (measured
# on the 900 W, 141 GB part) the 96 GB GH200 kind (the same 132-SM GH100).
GEMM_POINTS: tuple[GemmPoint, ...] = (
    GemmPoint("a100-40gb", 1024, 10240, 5120, 271.2, True, MAMF_CURRENT, "A100 SXM, torch 2.6.0+cu126"),
    GemmPoint("a100-40gb", 6912, 16384, 2048, 267.9, False, MAMF_V1, "A100 SXM, CUDA 12.1"),
    GemmPoint("a100-80gb", 1024, 10240, 5120, 271.2, True, MAMF_CURRENT, "A100 SXM, torch 2.6.0+cu126"),
    GemmPoint("a100-80gb", 6912, 16384, 2048, 267.9, False, MAMF_V1, "A100 SXM, CUDA 12.1"),
    GemmPoint("h100-sxm", 2048, 2048, 13312, 794.5, True, MAMF_CURRENT, "H100 SXM, torch 2.7.0+cu126"),
    GemmPoint("h100-sxm", 1024, 15360, 8192, 755.5, False, MAMF_JAN25, "H100 SXM, torch 2.5.1+cu124"),
    GemmPoint("h100-sxm", 6144, 17920, 2816, 792.1, False, MAMF_V1, "H100 SXM, CUDA 12.1"),
    GemmPoint("h200", 2048, 2048, 13312, 794.5, True, MAMF_CURRENT, "the H100 SXM row, noted 'H200 is the same'"),
    GemmPoint("gh200", 1024, 15360, 4096, 828.6, True, MAMF_CURRENT, "GH200 900 W 141 GB, torch 2.6.0+cu126"),
    GemmPoint("gh200", 11264, 19712, 1536, 821.0, False, MAMF_V1, "GH200, CUDA 12.5"),
    GemmPoint("mi300x", 10240, 15360, 8192, 668.4, True, MAMF_CURRENT,
              "MI300X, torch 2.5.1 with ROCm 6.3, PYTORCH_TUNABLEOP_ENABLED=1"),
    GemmPoint("mi300x", 4096, 10240, 4864, 781.9, False, MAMF_V1, "MI300X, ROCm 6.2"),
    GemmPoint("mi250x", 1024, 14080, 19968, 147.0, True, MAMF_V1, "MI250X, ROCm 6.2, one GCD (one catalog device)"),
)

# FlashAttention-2's stated peaks. On A100 the paper states "up to 230 TFLOPs/s, 73% of the theoretical
# maximum" without naming the pass (its per-pass figures are images); on H100 "up to 335 TFLOPs/s"
# for forward + backward (Fig. 7), the A100 kernels run unchanged. PyTorch's SDPA flash backend (what
# hethub's runtime calls) is FlashAttention-2; FlashAttention-3's Hopper kernels are not counted.
# GH200 and H200 take the H100 figure (same GH100 SM; the kernel is compute-bound).
ATTENTION_POINTS: tuple[AttentionPoint, ...] = (
    AttentionPoint("a100-40gb", 230.0, FA2, "A100 80GB SXM4, the highest figure stated (pass not named)"),
    AttentionPoint("a100-80gb", 230.0, FA2, "A100 80GB SXM4, the highest figure stated (pass not named)"),
    AttentionPoint("h100-sxm", 335.0, FA2, "H100 80GB SXM5, forward + backward, the A100 kernels unchanged"),
    AttentionPoint("h200", 335.0, FA2, "the H100 SXM5 figure: same GH100 SM"),
    AttentionPoint("gh200", 335.0, FA2, "the H100 SXM5 figure: same GH100 SM"),
)
