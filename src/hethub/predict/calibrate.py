"""Fit the kernel-time model's few per-kind numbers to measured per-layer times (pure Python).

Fitted per kind: the GEMM efficiency of each math mode present in the data (fp32 SIMT, or the
tensor-core mode: TF32 / bf16), the K half-saturation, the memory-bound kernels' share of bandwidth
and the host's per-kernel dispatch time. Everything else (SM count, peaks, bandwidth) is datasheet.
The objective is the squared log error of forward + backward per layer, so every entry weighs the
same whatever its size; Nelder-Mead in log-parameter space, no dependencies.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from hethub.predict.gemm import KernelParams
from hethub.predict.opmodel import Shape, layer_ops, phase_time_s

# Starting point and the values an uncalibrated kind uses (assumed: mid-range of what the fits on
# Sailor's A100/V100/GH200 profiles give; docs/predictor.md lists them).
DEFAULT_GEMM_EFF = 0.8
DEFAULT_K_HALF = 64.0
DEFAULT_MEM_EFF = 0.7
DEFAULT_LAUNCH_S = 10e-6


@dataclass(frozen=True)
class Sample:
    """One measured entry: a decoder layer's shape, the math mode it ran in, its fwd + bwd time."""

    shape: Shape
    mode: str  # key into the modes' peak FLOP/s
    measured_s: float
    allreduce_s: Callable[[float], float] | None = None
    label: str = ""


def predicted_layer_s(sample: Sample, params: KernelParams, *, comm_scale: float = 1.0) -> float:
    """Forward + backward of the sample's layer; its all-reduces (if any) scaled by `comm_scale`."""
    fwd, bwd = layer_ops(sample.shape)
    e = sample.shape.elem_bytes
    ar = sample.allreduce_s
    if ar is not None and comm_scale != 1.0:
        def ar(nbytes: float, _f: Callable[[float], float] = sample.allreduce_s) -> float:  # type: ignore[misc]
            return comm_scale * _f(nbytes)
    return (phase_time_s(fwd, params, elem_bytes=e, allreduce_s=ar)
            + phase_time_s(bwd, params, elem_bytes=e, allreduce_s=ar))


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
    k_half: float
    mem_eff: float
    launch_s: float
    comm_scale: float = 1.0  # measured TP all-reduce time / the ring model's (only where TP > 1 was measured)

    def params(self, base: KernelParams, mode: str, peak_flops: float) -> KernelParams:
        eff = self.gemm_eff.get(mode, DEFAULT_GEMM_EFF)
        return replace(base, matmul_flops=peak_flops, gemm_eff=eff, k_half=self.k_half, mem_eff=self.mem_eff,
                       launch_s=self.launch_s)


# Physical bounds of the fitted numbers, and the weight of a weak pull towards the defaults (so a
# kind measured on one model only does not drift where its data cannot pin a number down).
BOUNDS = {"gemm_eff": (0.05, 1.0), "k_half": (1.0, 4096.0), "mem_eff": (0.2, 1.0), "launch_s": (1e-6, 60e-6),
          "comm_scale": (0.3, 5.0)}
PRIOR_WEIGHT = 0.02


def fit_kind(samples: Sequence[Sample], *, base: KernelParams, peaks: dict[str, float]) -> Fit:
    """Least squared log error fit of one kind's numbers on `samples` (all of that kind)."""
    modes = sorted({s.mode for s in samples})
    comm = any(s.shape.tp > 1 and s.allreduce_s is not None for s in samples)
    names = [*(("gemm_eff", m) for m in modes), ("k_half", ""), ("mem_eff", ""), ("launch_s", "")]
    if comm:
        names.append(("comm_scale", ""))
    defaults = {"gemm_eff": DEFAULT_GEMM_EFF, "k_half": DEFAULT_K_HALF, "mem_eff": DEFAULT_MEM_EFF,
                "launch_s": DEFAULT_LAUNCH_S, "comm_scale": 1.0}
    x0 = [math.log(defaults[n]) for n, _ in names]

    def values(x: list[float]) -> list[float]:
        return [min(BOUNDS[n][1], max(BOUNDS[n][0], math.exp(v))) for (n, _), v in zip(names, x, strict=True)]

    def unpack(x: list[float]) -> Fit:
        v = values(x)
        effs = dict(zip(modes, v, strict=False))
        rest = dict(zip((n for n, _ in names[len(modes):]), v[len(modes):], strict=True))
        return Fit(effs, rest["k_half"], rest["mem_eff"], rest["launch_s"], rest.get("comm_scale", 1.0))

    def loss(x: list[float]) -> float:
        fit = unpack(x)
        total = PRIOR_WEIGHT * sum((math.log(v) - x0i) ** 2 for v, x0i in zip(values(x), x0, strict=True))
        for s in samples:
            pred = predicted_layer_s(s, fit.params(base, s.mode, peaks[s.mode]), comm_scale=fit.comm_scale)
            total += math.log(pred / s.measured_s) ** 2
        return total

    return unpack(nelder_mead(loss, x0, iters=600))
