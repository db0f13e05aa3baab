"""Fit the kernel-time model's few per-kind numbers to measured per-layer times (pure Python).

Fitted per kind: the GEMM efficiency of each math mode present in the data (fp32 SIMT, or the
tensor-core mode: TF32 / bf16), the K half-saturation, the memory-bound kernels' share of bandwidth
and the host's per-kernel dispatch time. Everything else (SM count, peaks, bandwidth) is datasheet.
The objective is the squared log error of forward + backward per layer, so every entry weighs the
same whatever its size; Nelder-Mead in log-parameter space, no dependencies.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from hethub.predict.gemm import (
    KernelParams,
    flash_time_s,
    gemm_time_from_terms,
    gemm_time_s,
    memory_time_s,
    split_k_options,
    stream_time_s,
)
from hethub.predict.opmodel import Shape, layer_ops

# Starting point and the values an uncalibrated kind uses (assumed: mid-range of what the fits on
# Sailor's A100/V100/GH200 profiles give; docs/predictor.md lists them).
DEFAULT_GEMM_EFF = 0.8
DEFAULT_K_HALF = 64.0
DEFAULT_MEM_EFF = 0.66  # prior of the one memory efficiency fitted for all GPUs (fit_shared_mem_eff; 0.625)
DEFAULT_LAUNCH_S = 10e-6
# Assumed start/prior of a TP collective's wait for the group's slowest rank, per call: a few tens of
# microseconds, the order of NCCL's small-message all-reduce times on one node (nccl-tests); the
# fits replace it (what they give is in docs/predictor.md).
DEFAULT_COLLECTIVE_WAIT_S = 30e-6


@dataclass(frozen=True)
class Sample:
    """One measured entry: a decoder layer's shape, the math mode it ran in, its fwd + bwd time."""

    shape: Shape
    mode: str  # key into the modes' peak FLOP/s
    measured_s: float
    allreduce_s: Callable[[float], float] | None = None
    label: str = ""


def predicted_layer_s(sample: Sample, params: KernelParams, *, comm_scale: float = 1.0) -> float:
    """Forward + backward of the sample's layer; its all-reduces (if any) scaled by `comm_scale`.
    Same arithmetic as opmodel.phase_time_s, on the sample's operators compiled once (the fit calls
    this thousands of times)."""
    return sum(_phase_s(ph, params, comm_scale) for ph in _compiled(sample.shape, sample.allreduce_s,
                                                                     params.sm_count))


@functools.lru_cache(maxsize=4096)
def _compiled(shape: Shape, allreduce_s: Callable[[float], float] | None, sm_count: int) -> tuple[tuple, ...]:
    """Per phase, the shape-only terms of each operator: ("gemm", flops, split-K options, operand
    bytes), ("mem", bytes), ("flash", flops), ("allreduce", seconds)."""
    out = []
    e = shape.elem_bytes
    for ops in layer_ops(shape):
        items: list[tuple] = []
        for op in ops:
            if op[0] == "gemm":
                _, m, n, k, b = op
                items.append(("gemm", 2.0 * m * n * k * b,
                              split_k_options(m=m, n=n, k=k, batch=b, sm_count=sm_count),
                              e * (m * k + k * n + m * n) * b))
            elif op[0] == "mem":
                if op[1] > 0:
                    items.append(op)
            elif op[0] == "flash":
                items.append(op)
            elif allreduce_s is not None:
                items.append(("allreduce", allreduce_s(op[1])))
        out.append(tuple(items))
    return tuple(out)


def _phase_s(items: tuple, p: KernelParams, comm_scale: float) -> float:
    """opmodel.phase_time_s on compiled terms, with the all-reduces scaled by `comm_scale`."""
    durations = []
    for it in items:
        if it[0] == "gemm":
            durations.append(gemm_time_from_terms(p, flops=it[1], options=it[2], operand_bytes=it[3]))
        elif it[0] == "mem":
            durations.append(memory_time_s(p, it[1]))
        elif it[0] == "flash":
            durations.append(flash_time_s(p, it[1]))
        else:  # a TP collective: on the GPU, the wait for the group's slowest rank, then the ring
            durations.append(comm_scale * it[1] + p.collective_wait_s)
    return stream_time_s(durations, launch_s=p.launch_s)


def nelder_mead(f: Callable[[list[float]], float], x0: Sequence[float], *, step: float = 0.3,
                iters: int = 400, tol: float = 1e-7) -> list[float]:
    """Minimise f from x0 (the textbook simplex method; enough for a handful of parameters)."""
    n = len(x0)
    simplex = [list(x0)] + [[x + (step if i == j else 0.0) for j, x in enumerate(x0)] for i in range(n)]
    values = [f(x) for x in simplex]
    for _ in range(iters):
        order = sorted(range(n + 1), key=values.__getitem__)
        simplex, values = [simplex[i] for i in order], [values[i] for i in order]
        if values[-1] - values[0] < tol:
            break
        centroid = [sum(x[j] for x in simplex[:-1]) / n for j in range(n)]
        worst = simplex[-1]
        xr = _towards(centroid, worst, -1.0)
        fr = f(xr)
        if fr < values[0]:
            xe = _towards(centroid, worst, -2.0)
            fe = f(xe)
            simplex[-1], values[-1] = (xe, fe) if fe < fr else (xr, fr)
        elif fr < values[-2]:
            simplex[-1], values[-1] = xr, fr
        else:
            xc = _towards(centroid, worst, 0.5)
            fc = f(xc)
            if fc < values[-1]:
                simplex[-1], values[-1] = xc, fc
            else:  # shrink towards the best point
                best = simplex[0]
                simplex = [best] + [[b + 0.5 * (x - b) for b, x in zip(best, s, strict=True)] for s in simplex[1:]]
                values = [values[0]] + [f(s) for s in simplex[1:]]
    return simplex[min(range(n + 1), key=values.__getitem__)]


def _towards(centroid: list[float], worst: list[float], a: float) -> list[float]:
    return [c + a * (w - c) for c, w in zip(centroid, worst, strict=True)]


@dataclass(frozen=True)
class Fit:
    gemm_eff: dict[str, float]  # per math mode
    k_half: float  # K of half saturation on the fp32 units (see params)
    mem_eff: float
    launch_s: float
    comm_scale: float = 1.0  # measured TP all-reduce time / the ring model's (only where TP > 1 was measured)
    collective_wait_s: float = 0.0  # GPU wait per TP collective for the slowest rank (only where TP > 1 measured)

    def params(self, base: KernelParams, mode: str, peak_flops: float) -> KernelParams:
        """The kernel numbers of `mode`; `base.matmul_flops` is the fp32 units' peak. ``k_half`` is in K
        steps of the fp32 units: a tile's prologue and epilogue take a fixed time, worth as many more
        K steps as the mode's math runs faster than fp32 (tensor cores: peak_flops / fp32 peak)."""
        eff = self.gemm_eff.get(mode, DEFAULT_GEMM_EFF)
        return replace(base, matmul_flops=peak_flops, gemm_eff=eff, mem_eff=self.mem_eff, launch_s=self.launch_s,
                       k_half=self.k_half * peak_flops / base.matmul_flops, collective_wait_s=self.collective_wait_s)


# Physical bounds of the fitted numbers, and the weight of a weak pull towards the defaults (so a
# kind measured on one model only does not drift where its data cannot pin a number down).
BOUNDS = {"gemm_eff": (0.05, 1.0), "k_half": (1.0, 4096.0), "mem_eff": (0.2, 1.0), "launch_s": (1e-6, 150e-6),
          "comm_scale": (0.3, 5.0), "collective_wait_s": (1e-6, 3e-3)}
PRIOR_WEIGHT = 0.02
_DEFAULTS = {"gemm_eff": DEFAULT_GEMM_EFF, "k_half": DEFAULT_K_HALF, "mem_eff": DEFAULT_MEM_EFF,
             "launch_s": DEFAULT_LAUNCH_S, "comm_scale": 1.0, "collective_wait_s": DEFAULT_COLLECTIVE_WAIT_S}


def fit_kind(samples: Sequence[Sample], *, base: KernelParams, peaks: dict[str, float], mem_eff: float | None = None,
             start: Fit | None = None, iters: int = 600) -> Fit:
    """Least squared log error fit of one kind's numbers on `samples` (all of that kind).

    ``mem_eff`` given: held at that value (see :func:`fit_shared_mem_eff` for why). ``start``: a
    previous fit to start from (the search is local; a near start needs fewer iterations)."""
    modes = sorted({s.mode for s in samples})
    comm = any(s.shape.tp > 1 and s.allreduce_s is not None for s in samples)
    names = [*(("gemm_eff", m) for m in modes), ("k_half", ""), ("launch_s", "")]
    if mem_eff is None:
        names.append(("mem_eff", ""))
    if comm:
        names += [("comm_scale", ""), ("collective_wait_s", "")]
    prior = [math.log(_DEFAULTS[n]) for n, _ in names]
    x0 = prior if start is None else [math.log(min(BOUNDS[n][1], max(BOUNDS[n][0], _value(start, n, m))))
                                      for n, m in names]

    def values(x: list[float]) -> list[float]:
        return [min(BOUNDS[n][1], max(BOUNDS[n][0], math.exp(v))) for (n, _), v in zip(names, x, strict=True)]

    def unpack(x: list[float]) -> Fit:
        v = values(x)
        effs = dict(zip(modes, v, strict=False))
        rest = dict(zip((n for n, _ in names[len(modes):]), v[len(modes):], strict=True))
        return Fit(effs, rest["k_half"], mem_eff if mem_eff is not None else rest["mem_eff"], rest["launch_s"],
                   rest.get("comm_scale", 1.0), rest.get("collective_wait_s", 0.0))

    def loss(x: list[float]) -> float:
        return sample_loss(samples, unpack(x), base=base, peaks=peaks) + PRIOR_WEIGHT * sum(
            (math.log(v) - p) ** 2 for v, p in zip(values(x), prior, strict=True))

    return unpack(nelder_mead(loss, x0, iters=iters))


def _value(fit: Fit, name: str, mode: str) -> float:
    if name == "gemm_eff":
        return fit.gemm_eff.get(mode, DEFAULT_GEMM_EFF)
    return getattr(fit, name)


def sample_loss(samples: Sequence[Sample], fit: Fit, *, base: KernelParams, peaks: dict[str, float]) -> float:
    """Sum of squared log errors of `fit` on `samples`."""
    return sum(math.log(predicted_layer_s(s, fit.params(base, s.mode, peaks[s.mode]), comm_scale=fit.comm_scale)
                        / s.measured_s) ** 2 for s in samples)


def fit_shared_mem_eff(groups: dict[str, tuple[Sequence[Sample], KernelParams, dict[str, float]]], *,
                       evals: int = 8) -> tuple[float, dict[str, Fit]]:
    """Fit every kind of `groups` (name -> samples, base numbers, peaks) with ONE memory efficiency.

    Why one: a GEMM and a memory-bound kernel of a layer both scale with the tokens, so on one
    model's entries their shares cannot be told apart, and a kind fitted on one or two models trades
    the one for the other (held-out models then miss by 20-60%). What a memory-bound kernel reaches
    is the element-wise kernels' share of the datasheet DRAM bandwidth (the same PyTorch kernels on
    every NVIDIA part), so one number shared by all kinds is fitted where the models differ: the
    kinds with two or more models. A golden-section search over log(mem_eff) in its bounds, each
    step refitting every kind from the previous step's fit."""
    fits: dict[str, Fit] = {}
    # Only kinds with two or more models tell GEMM from memory time; the rest follow the result.
    informative = {k: g for k, g in groups.items() if len({(s.shape.hidden, s.shape.seq_len) for s in g[0]}) > 1}

    def total(log_m: float) -> float:
        out = 0.0
        for k, (smp, base, peaks) in (informative or groups).items():
            fits[k] = fit_kind(smp, base=base, peaks=peaks, mem_eff=math.exp(log_m), start=fits.get(k),
                               iters=200 if k in fits else 500)
            out += sample_loss(smp, fits[k], base=base, peaks=peaks)
        return out

    lo, hi = (math.log(b) for b in BOUNDS["mem_eff"])
    g = (math.sqrt(5) - 1) / 2
    a, b = hi - g * (hi - lo), lo + g * (hi - lo)
    fa, fb = total(a), total(b)
    for _ in range(max(0, evals - 2)):
        if fa < fb:
            hi, b, fb = b, a, fa
            a = hi - g * (hi - lo)
            fa = total(a)
        else:
            lo, a, fa = a, b, fb
            b = lo + g * (hi - lo)
            fb = total(b)
    best = math.exp(a if fa < fb else b)
    out = {k: fit_kind(smp, base=base, peaks=peaks, mem_eff=best, start=fits.get(k))
           for k, (smp, base, peaks) in groups.items()}
    return best, out


def gemm_tflops(p: KernelParams, *, m: int, n: int, k: int, elem_bytes: int = 2) -> float:
    """TFLOP/s the kernel model gives one GEMM of C[m, n] = A[m, k] @ B[k, n] with numbers `p`."""
    return 2.0 * m * n * k / gemm_time_s(p, m=m, n=n, k=k, elem_bytes=elem_bytes) / 1e12


def fit_gemm_eff(shapes_tflops: Sequence[tuple[int, int, int, float]], p: KernelParams) -> float:
    """The GEMM efficiency with which the kernel model reproduces measured (m, n, k, TFLOP/s) points
    best (least squared log error) on a kind whose other numbers are `p`. Large GEMMs are compute-bound,
    where time is inversely proportional to the efficiency: the fit is the geometric mean of each
    point's measured / modelled-at-efficiency-1 ratio."""
    one = replace(p, gemm_eff=1.0)
    logs = [math.log(t / gemm_tflops(one, m=m, n=n, k=k)) for m, n, k, t in shapes_tflops]
    return math.exp(sum(logs) / len(logs))
