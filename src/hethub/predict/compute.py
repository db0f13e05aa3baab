"""Per-micro-batch compute time of a stage: from a measured profile, else analytic.

Analytic, for a kind with compute-unit data in the catalog (``sm_count``): the operator-level model
of :mod:`hethub.predict.opmodel` (every GEMM by its shape, attention per the kind's implementation,
memory-bound kernels at the kind's bandwidth), with the kind's fitted numbers where the catalog has
them ("analytic, calibrated on ...") or assumed defaults ("analytic, uncalibrated"). Other kinds
(CPUs, hand-made kinds): time = FLOPs / (peak FLOP/s x efficiency), backward twice the forward.
Full recomputation adds one more forward to backward; selective recomputation adds the attention
core's forward (the op model's core operators; on the roofline its score and value FLOPs; from a
profile, which times whole layers, the core's share of the layer's forward FLOPs times the measured
forward: an estimate, and the prediction's sources say so). The optimizer update streams the
stage's training state through device memory once (read and write).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from hethub.memo import Kept
from hethub.plan import Recompute
from hethub.predict import opmodel
from hethub.predict.calibrate import DEFAULT_GEMM_EFF, DEFAULT_K_HALF, DEFAULT_LAUNCH_S, DEFAULT_MEM_EFF
from hethub.predict.gemm import KernelParams, gemm_time_s
from hethub.predict.memory import act_bytes_for, stage_params
from hethub.predict.profiles import KindProfile
from hethub.spec.kind import DeviceKind
from hethub.spec.model import ModelSpec


@dataclass(frozen=True)
class StageTimes:
    fwd_s: float  # one micro-batch, this stage, compute only
    bwd_s: float  # includes recomputation
    update_s: float  # optimizer step, once per training step
    source: str  # "profile", "analytic, calibrated on ...", "analytic, uncalibrated", "analytic, constant efficiency"
    # Whether fwd/bwd already contain the TP all-reduces (profiles measured on a real TP group).
    tp_comm_included: bool = False


def stage_times(
    model: ModelSpec, kind: DeviceKind, *, layers: int, embedding: bool, head: bool, tp: int, mbs: int,
    seq_len: int, recompute: Recompute | str | bool, precision: str, profile: KindProfile | None = None,
    attention: str | None = None,
) -> StageTimes:
    """``recompute``: the stage's :class:`~hethub.plan.Recompute` mode (a bool means full or none);
    ``attention``: the implementation the stage runs (the plan's per-kind setting; None: the kind's
    catalog default). A profile measured it already, so it changes only the analytic times."""
    recompute = Recompute.of(recompute)
    entry = profile.lookup(mbs=mbs, tp=tp) if profile is not None else None
    if entry is not None:
        # Per-layer time at this stage's depth: a deep stack costs more per layer (what it keeps for
        # backward outgrows the caches) where the profile measured stacks of several layers.
        per_layer = entry.layer_at(layers)
        fwd = layers * per_layer.fwd_s
        bwd = layers * per_layer.bwd_s
        upd = layers * per_layer.update_s
        for part, present in ((entry.embedding, embedding), (entry.head, head)):
            if present:
                fwd, bwd, upd = fwd + part.fwd_s, bwd + part.bwd_s, upd + part.update_s
        if recompute is Recompute.FULL:
            bwd += layers * per_layer.fwd_s
        elif recompute is Recompute.SELECTIVE:
            bwd += layers * per_layer.fwd_s * core_flop_share(model, seq_len=seq_len)
        # A profile measures real speed; an emulated kind is slowed on top of it, in its forward and
        # backward chunks only (the runtime's emulation sleeps there, not in the optimizer step), and
        # only their CPU share: the runtime sleeps (k-1) x a chunk's thread CPU time, so time spent
        # waiting in TP collectives is not stretched.
        stretch = (kind.emulated_slowdown - 1.0) * entry.cpu_fraction
        return StageTimes(fwd * (1 + stretch), bwd * (1 + stretch), upd, "profile", entry.tp_comm_included)
    upd = 0.0
    if kind.mem_bw_bytes_per_s:
        state = sum(ModelSpec.state_bytes_per_param(precision).values())
        params = stage_params(model, layers=layers, embedding=embedding, head=head, tp=tp)
        upd = 2 * params * state / kind.mem_bw_bytes_per_s
    # An emulated kind's analytic speed includes its slowdown (hethub.emulation derives the share it
    # sleeps from the kind's slowdown).
    op = kernel_params(kind, precision)
    if op is not None:
        params_k, source = op
        # flash and fused-softmax kernels need 16-bit inputs (Megatron's falls back to torch's softmax)
        attention = (attention or kind.attention) if precision != "fp32" else "math"
        parts = _PER_SHAPE.get((id(model), id(kind), precision, mbs, seq_len, tp, attention),
                               lambda: _op_parts(model, params_k, mbs=mbs, seq_len=seq_len, tp=tp, precision=precision,
                                                 attention=attention), pin=(model, kind))
        (lf, lb), core = parts["layer"], parts["core"]
        rerun = 0.0 if recompute is Recompute.NONE else lf if recompute is Recompute.FULL else core
        fwd, bwd = layers * lf, layers * (lb + rerun)
        for present, part in ((embedding, "embedding"), (head, "head")):
            if present:
                f, b = parts[part]
                fwd, bwd = fwd + f, bwd + b
        upd /= params_k.mem_eff
        fwd, bwd = fwd * kind.emulated_slowdown, bwd * kind.emulated_slowdown
        return StageTimes(fwd, bwd, upd, source)
    tokens = mbs * seq_len
    flops = layers * model.layer_fwd_flops(tokens=tokens, seq_len=seq_len)
    if head:
        flops += model.head_fwd_flops(tokens=tokens)
    fwd = flops / tp / kind.effective_flops
    rerun_flops = {Recompute.NONE: 0.0, Recompute.FULL: model.layer_fwd_flops(tokens=tokens, seq_len=seq_len),
                   Recompute.SELECTIVE: model.attention_core_fwd_flops(tokens=tokens, seq_len=seq_len)}[recompute]
    bwd = 2 * fwd + layers * rerun_flops / tp / kind.effective_flops
    return StageTimes(fwd, bwd, upd, "analytic, constant efficiency")


def column_wgrad_s(model: ModelSpec, kind: DeviceKind, *, tp: int, mbs: int, seq_len: int,
                   precision: str) -> tuple[float, float]:
    """Time of a layer's two column-parallel weight-gradient GEMMs (MLP up, QKV) on one TP rank: the
    operator model's where the kind has one, else the roofline's (their FLOPs at the kind's effective
    rate). What a runtime that overlaps TP all-reduces with them can hide the all-reduces under."""
    shape = opmodel.Shape.of(model, mbs=mbs, seq_len=seq_len, tp=tp, elem_bytes=act_bytes_for(precision),
                             attention="math")
    gemms = opmodel.column_wgrad_gemms(shape)
    op = kernel_params(kind, precision)
    if op is not None:
        up, qkv = (gemm_time_s(op[0], m=g[1], n=g[2], k=g[3], batch=g[4], elem_bytes=shape.elem_bytes) for g in gemms)
    else:
        up, qkv = (2.0 * g[1] * g[2] * g[3] / kind.effective_flops for g in gemms)
    return up, qkv


def p2p_post_s(kind: DeviceKind, precision: str) -> float:
    """Host time to post one point-to-point operation (an isend or irecv: one collective-library
    kernel) on ``kind``: the op model's kernel launch (``launch_s``), an estimate; 0 where the kind is
    priced by the roofline, which has no launch term."""
    op = kernel_params(kind, precision)
    return 0.0 if op is None else op[0].launch_s


def core_flop_share(model: ModelSpec, *, seq_len: int) -> float:
    """The attention core's share of a layer's forward FLOPs: how much of a profiled layer's forward
    selective recomputation is taken to re-run. An estimate: it counts the full s x s products
    (causal kernels do half) and prices the core's memory-bound kernels (softmax, rotary) like GEMMs."""
    return model.attention_core_fwd_flops(tokens=1, seq_len=seq_len) / model.layer_fwd_flops(tokens=1, seq_len=seq_len)


_PARTS = {"layer": opmodel.layer_ops, "embedding": opmodel.embedding_ops, "head": opmodel.head_ops}


# stage_times' op-model parts by what they read but the layer count and the stage's place: the model
# and kind (ids, pinned), precision, micro-batch size, sequence length, TP degree and attention. The
# planner asks stage_times for every layer count of thousands of stage shapes.
_PER_SHAPE = Kept(4096, shortcut=True)


def _op_parts(model: ModelSpec, params: KernelParams, *, mbs: int, seq_len: int, tp: int, precision: str,
              attention: str) -> dict[str, tuple[float, float] | float]:
    """One layer's, the embedding's and the head's forward and backward times on one TP rank, and the
    attention core's forward (what selective recomputation re-runs), by the operator model."""
    shape = opmodel.Shape.of(model, mbs=mbs, seq_len=seq_len, tp=tp, elem_bytes=act_bytes_for(precision),
                             attention=attention)
    return {**{part: _phase_times(part, shape, params) for part in _PARTS}, "core": _core_time_s(shape, params)}


@functools.lru_cache(maxsize=4096)
def _core_time_s(shape: opmodel.Shape, params: KernelParams) -> float:
    """Forward time of one layer's attention core (what selective recomputation re-runs)."""
    return opmodel.phase_time_s(opmodel.attention_core_ops(shape), params, elem_bytes=shape.elem_bytes)


@functools.lru_cache(maxsize=4096)
def _phase_times(part: str, shape: opmodel.Shape, params: KernelParams) -> tuple[float, float]:
    """Forward and backward time of one part on one TP rank (cached: the planner asks often)."""
    fwd, bwd = _PARTS[part](shape)
    return (opmodel.phase_time_s(fwd, params, elem_bytes=shape.elem_bytes),
            opmodel.phase_time_s(bwd, params, elem_bytes=shape.elem_bytes))


# kernel_params by kind (id, pinned: kinds are frozen) and precision: asked per stage of every plan.
_KERNEL_PARAMS = Kept(1024, shortcut=True)


def kernel_params(kind: DeviceKind, precision: str) -> tuple[KernelParams, str] | None:
    """The op model's numbers for `kind` at `precision`, and what they rest on; None where the kind
    has no compute-unit data (the constant-efficiency roofline applies). Kept per kind and precision
    (`_kernel_params`)."""
    return _KERNEL_PARAMS.get((id(kind), precision), lambda: (_kernel_params(kind, precision),),
                              pin=(kind,))[0]


def _kernel_params(kind: DeviceKind, precision: str) -> tuple[KernelParams, str] | None:
    """`kernel_params`, computed.

    bf16-mixed runs its GEMMs on the tensor cores at the dense bf16 peak; fp32 on the non-tensor fp32
    units (PyTorch's default: TF32 off for matmuls). Each number comes from the catalog where fitted,
    else is assumed; the source says which (:func:`efficiency_sources`): "calibrated on ...",
    "partly calibrated on ... (X assumed ...)" or "uncalibrated".
    """
    if kind.sm_count is None or not kind.mem_bw_bytes_per_s:
        return None
    numbers = efficiency_sources(kind, precision)
    value = {name: entry["value"] for name, entry in numbers.items()}
    # gemm_k_half is in K steps of the fp32 units (calibrate.Fit.params: Sailor's TF32 runs fit with it
    # scaled by peak / fp32 peak). bf16 keeps the fp32 number unscaled: the published bf16 GEMMs are all
    # long-K, where it barely matters, and 16x (A100) would extrapolate twice beyond what TF32 showed.
    params = KernelParams(
        sm_count=kind.sm_count, matmul_flops=_matmul_peak(kind, precision), mem_bw_bytes_per_s=kind.mem_bw_bytes_per_s,
        gemm_eff=value["gemm_eff"], k_half=value["gemm_k_half"], mem_eff=value["mem_eff"],
        launch_s=value["kernel_launch_s"], flash_eff=value.get("flash_eff", 0.0))
    fitted = {n: e["source"] for n, e in numbers.items() if not e["source"].startswith("assumed")}
    if not fitted:
        return params, "analytic, uncalibrated"
    # short names here (each source's text up to its first parenthesis or colon); in full in efficiency_sources
    sources = ", ".join(dict.fromkeys(v.split(" (")[0].split(":")[0] for v in fitted.values()))
    assumed = [f"{n} {e['value']:g}" for n, e in numbers.items() if n not in fitted]
    if assumed:
        return params, f"analytic, partly calibrated on {sources} ({', '.join(assumed)} assumed)"
    return params, f"analytic, calibrated on {sources}"


def _matmul_peak(kind: DeviceKind, precision: str) -> float:
    if precision == "fp32":
        return kind.fp32_flops or kind.peak_flops / 8
    return kind.peak_flops


def efficiency_sources(kind: DeviceKind, precision: str) -> dict[str, dict[str, float | str]]:
    """Every efficiency the op model uses for `kind` at `precision`: its value and where it comes from
    (a cited public measurement, the profiles named in the kind's `calibration`, or "assumed default").
    `hethub predict --json` reports it per kind (sources["calibration"]). ``flash_eff`` appears where
    the stage runs fused attention (a flash kind, 16-bit: fp32 runs math attention)."""
    eff_field = "gemm_eff_fp32" if precision == "fp32" else "gemm_eff"
    fields = {"gemm_eff": (eff_field, DEFAULT_GEMM_EFF), "gemm_k_half": ("gemm_k_half", DEFAULT_K_HALF),
              "mem_eff": ("mem_eff", DEFAULT_MEM_EFF), "kernel_launch_s": ("kernel_launch_s", DEFAULT_LAUNCH_S)}
    out: dict[str, dict[str, float | str]] = {}
    for name, (field, default) in fields.items():
        out[name] = _entry(kind, field, default)
    if precision != "fp32" and kind.attention == "flash":
        flash = _entry(kind, "flash_eff", out["gemm_eff"]["value"])
        if flash["source"].startswith("assumed"):
            flash["source"] = "assumed: equal to gemm_eff (no published attention-kernel figure for this kind)"
        out["flash_eff"] = flash
    return out


def _entry(kind: DeviceKind, field: str, default: float) -> dict[str, float | str]:
    value = getattr(kind, field)
    if value is None:
        return {"value": default, "source": "assumed default"}
    own = getattr(kind, f"{field}_source", "")
    return {"value": value, "source": own or kind.calibration or "cluster file (no source given)"}


def calibration_of(kind: DeviceKind, *, precision: str, compute_source: str) -> dict[str, object]:
    """What a stage's compute time rests on, for ``hethub predict --json`` (sources["calibration"]): a
    measured profile; the op model's efficiencies each with its value and source; or the constant
    efficiency of the roofline (always assumed or nominal in the catalog)."""
    if compute_source == "profile":
        return {"status": "measured profile"}
    op = kernel_params(kind, precision)
    if op is None:
        return {"status": "uncalibrated (constant efficiency)", "precision": precision,
                "numbers": {"efficiency": {"value": kind.efficiency, "source": "catalog (assumed or nominal)"}}}
    status = op[1].removeprefix("analytic, ").split(" on ")[0]
    return {"status": status, "precision": precision, "numbers": efficiency_sources(kind, precision)}
