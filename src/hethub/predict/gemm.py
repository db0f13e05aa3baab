"""Time of one GPU kernel from its shape: matrix multiplies (tile and wave quantisation, a saturation
curve in K, a memory floor) and memory-bound element-wise kernels, plus the host's dispatch cost.

Why these mechanisms: a GEMM of M x N x K is cut into output tiles (the library picks the tile shape
per GEMM from a few, see TILES), one thread block per tile; the GPU runs `sm_count` blocks per wave,
so a GEMM of 1.1 waves costs 2 (wave quantisation). Each block streams K through its tile; short K
spends a larger share on the prologue/epilogue (the K saturation curve K / (K + k_half)). A GEMM
whose operands outweigh its FLOPs (low arithmetic intensity) is bound by memory bandwidth. An
element-wise kernel moves its bytes at a fraction of the memory bandwidth. Eager PyTorch issues
every kernel from the host; when kernels are shorter than the host's dispatch time, the GPU idles
(`stream_time_s`).

The fitted numbers (`gemm_eff`, `k_half`, `mem_eff`, `launch_s`) come from the catalog; see
:mod:`hethub.predict.calibrate` for how they are fitted on measured profiles.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# The output tiles the library may choose from, one thread block per tile. cuBLAS and CUTLASS carry
# kernels for several tile shapes and pick one per GEMM shape by heuristics (NVIDIA, "Matrix
# Multiplication Background User's Guide", 2.3 "Typical tile dimensions in cuBLAS and performance"
# and 3.1-3.2 on tile and wave quantisation: 256x128, 128x256, 128x128, 128x64, 64x128 and 64x64 among
# them; cublasLtMatmulTile_t lists the same shapes): larger tiles reuse each loaded operand for more
# output and run more efficiently, smaller tiles make more blocks, so a GEMM with a small output fills
# the compute units. Modelled: each tile has the same fixed cost per tile (pipeline fill, epilogue
# latency), worth `k_half` K steps of a 128 x 128 tile; a tile of a x b output does a*b/128^2 as
# much work per K step, so its fixed cost is worth k_half * 128^2 / (a*b) of its own K steps. No
# number per tile is fitted; the library takes the tile (and split of K) this model finds fastest.
TILES = ((256, 128), (128, 256), (128, 128), (128, 64), (64, 128), (64, 64))
REF_TILE_AREA = 128 * 128  # the tile `k_half` is stated for


@dataclass(frozen=True)
class KernelParams:
    """What the kernel-time model needs to know about one device kind in one math mode."""

    sm_count: int
    matmul_flops: float  # datasheet peak of the math mode in use (fp32 SIMT, TF32, bf16 tensor cores)
    mem_bw_bytes_per_s: float
    gemm_eff: float  # fitted: fraction of matmul_flops a full-wave, long-K GEMM reaches
    k_half: float  # fitted: K at which the K-saturation curve of a 128 x 128 tile is at one half
    mem_eff: float  # fitted: fraction of mem_bw element-wise kernels reach
    launch_s: float  # fitted: host time to dispatch one kernel (eager PyTorch)
    # fitted where TP groups were measured: GPU time one TP collective waits for the group's slowest
    # rank before its ring runs (the profiler's ranks drift apart between layers); 0 where the
    # predictor prices TP collectives itself
    collective_wait_s: float = 0.0
    # fraction of matmul_flops a fused (flash) attention kernel reaches on its causal FLOPs, forward and
    # backward alike; 0: taken equal to gemm_eff (no published figure for the kind)
    flash_eff: float = 0.0


def wave_utilisation(*, m: int, n: int, batch: int, sm_count: int, tile: tuple[int, int] = (128, 128)) -> float:
    """Share of the compute units busy over the waves a GEMM of m x n output (x batch) needs."""
    tiles = math.ceil(m / tile[0]) * math.ceil(n / tile[1]) * batch
    waves = math.ceil(tiles / sm_count)
    return tiles / (waves * sm_count)


# Split-K: a GEMM whose output has fewer tiles than the GPU has compute units (a weight gradient
# of a narrow, TP-sharded layer: m x n = h x h/tp, K = the tokens) leaves most units idle for a
# whole wave; cuBLAS and CUTLASS then cut K into slices run by separate blocks and add the partial
# tiles afterwards (CUTLASS docs, "Split-K"; Osama et al., Stream-K, PPoPP 2023). Assumed: a slice
# keeps at least MIN_SPLIT_K of K (a handful of the tile's 32-deep K steps), splits are powers of
# two, and the library takes the split this model finds fastest.
MIN_SPLIT_K = 256
PARTIAL_BYTES = 4  # partial tiles accumulate in fp32


def split_k_options(*, m: int, n: int, k: int, batch: int,
                    sm_count: int) -> tuple[tuple[float, int, float, float], ...]:
    """(wave utilisation, K per slice, bytes of the partial-tile reduction, the tile's fixed cost in
    units of `k_half`) for each kernel the library may take: every tile of TILES, each without a
    split and, where one wave is not filled, with K cut in 2, 4, ... slices. Options no better in
    any term than another are dropped (the fit evaluates these thousands of times)."""
    out = []
    for tm, tn in TILES:
        tiles = math.ceil(m / tm) * math.ceil(n / tn) * batch
        cost = REF_TILE_AREA / (tm * tn)
        out.append((wave_utilisation(m=m, n=n, batch=batch, sm_count=sm_count, tile=(tm, tn)), k, 0.0, cost))
        s = 2
        while tiles * s <= 2 * sm_count and k // s >= MIN_SPLIT_K:
            used = tiles * s
            util = used / (math.ceil(used / sm_count) * sm_count)
            # each slice writes its partial tile, a reduction reads them all and writes the result
            out.append((util, k // s, PARTIAL_BYTES * (s + 1) * m * n * batch, cost))
            s *= 2
    out = sorted(set(out), key=lambda o: (-o[0], -o[1], o[2], o[3]))
    kept: list[tuple[float, int, float, float]] = []
    for o in out:
        if not any(q[0] >= o[0] and q[1] >= o[1] and q[2] <= o[2] and q[3] <= o[3] for q in kept):
            kept.append(o)
    return tuple(kept)


def gemm_efficiency(p: KernelParams, *, m: int, n: int, k: int, batch: int = 1) -> float:
    """Fraction of `matmul_flops` one GEMM reaches on 128 x 128 tiles without split-K (before the
    memory floor)."""
    return p.gemm_eff * wave_utilisation(m=m, n=n, batch=batch, sm_count=p.sm_count) * k / (k + p.k_half)


def gemm_time_s(p: KernelParams, *, m: int, n: int, k: int, batch: int = 1, elem_bytes: int) -> float:
    """GPU time of C[m, n] = A[m, k] @ B[k, n] (`batch` of them): compute or memory, whichever binds,
    at the fastest tile and split of K (:func:`split_k_options`)."""
    return gemm_time_from_terms(p, flops=2.0 * m * n * k * batch,
                                options=split_k_options(m=m, n=n, k=k, batch=batch, sm_count=p.sm_count),
                                operand_bytes=elem_bytes * (m * k + k * n + m * n) * batch)


def gemm_time_from_terms(p: KernelParams, *, flops: float, options: tuple[tuple[float, int, float, float], ...],
                         operand_bytes: float) -> float:
    """:func:`gemm_time_s` from a GEMM's shape-only terms (its FLOPs, tile/split options and operand
    bytes), which do not depend on the fitted numbers: the calibration computes them once per shape and
    calls this thousands of times."""
    bw = p.mem_bw_bytes_per_s * p.mem_eff
    peak = p.matmul_flops * p.gemm_eff
    memory = operand_bytes / bw
    return min(max(flops * (ks + p.k_half * c) / (peak * util * ks), memory) + red / bw
               for util, ks, red, c in options)


def flash_time_s(p: KernelParams, flops: float) -> float:
    """GPU time of a fused (flash) attention core doing `flops`: at the kind's attention-kernel efficiency
    (`flash_eff`), its softmax hidden inside the kernel. A fused kernel is a class of its own: it keeps
    the scores on chip and serialises the softmax between its two matrix products, so it reaches well
    below a large GEMM's fraction of peak (FlashAttention-2 on H100: 34%, against 80% for a GEMM);
    without a published figure it is taken at the GEMM efficiency."""
    return flops / (p.matmul_flops * (p.flash_eff or p.gemm_eff))


def memory_time_s(p: KernelParams, nbytes: float) -> float:
    """GPU time of an element-wise kernel that reads and writes `nbytes` in all."""
    return nbytes / (p.mem_bw_bytes_per_s * p.mem_eff)


def stream_time_s(gpu_s: list[float] | tuple[float, ...], *, launch_s: float) -> float:
    """Wall time of kernels issued one after another by a host that needs `launch_s` per kernel.

    The host runs ahead of the GPU while kernels are long; when they are short the GPU waits for the
    next launch. (Kernel i starts at max(its launch, end of kernel i-1).) A layer whose kernels are
    shorter than their launches is host-bound: its time is the host's issue time, which TP does not
    shorten (each rank issues every kernel of the layer, and more collectives).
    """
    host = gpu = 0.0
    for d in gpu_s:
        host += launch_s
        gpu = max(gpu, host) + d
    return gpu
