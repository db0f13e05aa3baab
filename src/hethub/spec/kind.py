"""Device kinds: one accelerator model's numbers, their physical ranges, and the built-in catalog.

A kind comes from the catalog (``catalog.toml``, every number with its source) or is defined /
overridden in a cluster file under ``[kinds.NAME]`` (``base = "catalog-kind"`` inherits the rest).
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass
from importlib import resources
from typing import Any

from hethub.errors import SpecError, field_error
from hethub.spec._toml import check_keys, get_int, get_number, get_str

GIB = 1024**3
BACKENDS = ("nccl", "gloo", "hccl", "xccl", "mccl", "mpi")
# The torch device type a backend moves tensors of, i.e. where a kind's ranks compute by default.
# One home for this map: the runtime's device map and the communicator read it from here.
DEVICE_TYPE_OF_BACKEND = {"nccl": "cuda", "hccl": "npu", "xccl": "xpu", "mccl": "musa", "gloo": "cpu", "mpi": "cpu"}
DEVICE_TYPES = ("cuda", "npu", "xpu", "musa", "cpu")

# Fitted op-model numbers that may name their own source (a public measurement) instead of the kind's
# `calibration` (the profiles the rest were fitted on): `<field>_source`.
OPMODEL_SOURCES = ("gemm_eff_source", "flash_eff_source", "mem_eff_source")

_KIND_KEYS = {
    "base", "vendor", "mem_bytes", "mem_gib", "peak_flops", "intra_node_bw_bytes_per_s",
    "intra_node_latency_s", "mem_bw_bytes_per_s", "backend", "efficiency", "emulated_slowdown",
    "source", "notes", "device_type", "torch_package", "price_per_hour", "price_source", *(
        # the operator-level compute model (predict/opmodel.py); all optional
        "sm_count", "fp32_flops", "tf32_flops", "attention", "gemm_eff", "gemm_eff_tf32", "gemm_eff_fp32",
        "gemm_k_half", "mem_eff", "kernel_launch_s", "calibration", "flash_eff", *OPMODEL_SOURCES),
    "precisions", "context_bytes", "comm_buffer_bytes", "fragmentation", "intra_node_fabric",
}
ATTENTION_IMPLS = ("flash", "math")
# What joins a kind's devices inside a node (hethub.predict.fabrics prices each by its achievable-
# bandwidth curve); "": intra_node_bw_bytes_per_s is already an achieved rate (a measured or
# assumed collective rate, host loopback).
INTRA_NODE_FABRICS = ("nvlink", "nvswitch-nvls", "infinity-fabric", "hccs", "mtlink", "metaxlink", "pcie", "")

# Physical ranges of the numbers a cluster file gives: far wider than any device sold (so new hardware
# fits), narrow enough to catch a wrong unit (GB/s written as bytes/s, TFLOP/s as FLOP/s) and numbers
# that only break the planner. Upper ends: the fastest device of 2025 is ~2.5e15 dense FLOP/s (B200,
# bf16), 192 GB of HBM at 8e12 B/s, NVLink-5 at 9e11 B/s per direction; each limit is >= 10x that.
_RANGES: dict[str, tuple[float, float, str, str]] = {
    "peak_flops": (1e8, 1e17, "FLOP/s", "dense FLOP/s of one device, e.g. 312e12 for an A100"),
    "mem_bytes": (1e8, 1e13, "bytes", "bytes of one device, e.g. 40_000_000_000 (or mem_gib = 40)"),
    "mem_bw_bytes_per_s": (1e8, 1e14, "bytes/s", "bytes per second, e.g. 1.555e12 for an A100"),
    "intra_node_bw_bytes_per_s": (1e6, 1e13, "bytes/s", "bytes per second, one direction, e.g. 300e9"),
    "inter_node_bw_bytes_per_s": (1e6, 1e13, "bytes/s", "bytes per second, e.g. 12.5e9 for 100 Gbit/s"),
    "cross_kind_bw_bytes_per_s": (1e6, 1e13, "bytes/s", "bytes per second, e.g. 12.5e9 for 100 Gbit/s"),
    "bw_bytes_per_s": (1e6, 1e13, "bytes/s", "bytes per second"),
    "intra_node_latency_s": (0.0, 1.0, "s", "seconds, e.g. 5e-6"),
    "inter_node_latency_s": (0.0, 1.0, "s", "seconds, e.g. 10e-6"),
    "cross_kind_latency_s": (0.0, 1.0, "s", "seconds, e.g. 10e-6"),
    "latency_s": (0.0, 1.0, "s", "seconds"),
}

def check_range(where: str, key: str, value: float) -> float:
    """``value`` if it lies in the physical range of field ``key`` (see _RANGES), else SpecError naming it."""
    lo, hi, unit, example = _RANGES[key]
    if not lo <= value <= hi:
        raise field_error(where, key, f"is {value:g} {unit}, outside the physical range {lo:g}..{hi:g} {unit}",
                          f"check the unit: {example}")
    return value


@dataclass(frozen=True)
class DeviceKind:
    """One accelerator model. ``peak_flops`` is dense bf16/fp16 (fp32 for CPUs)."""

    name: str
    vendor: str
    mem_bytes: int
    peak_flops: float
    intra_node_bw_bytes_per_s: float
    intra_node_latency_s: float
    backend: str = "nccl"
    # Fraction of peak that dense transformer layers reach; the analytic predictor's only fudge.
    efficiency: float = 0.5
    mem_bw_bytes_per_s: float | None = None
    # >1 only for CPU emulation: a rank of this kind sleeps (k-1)x its compute time.
    emulated_slowdown: float = 1.0
    source: str = ""
    notes: str = ""
    # Dollars per device-hour (on-demand rent) for cost-aware planning; None: no public price known.
    price_per_hour: float | None = None
    price_source: str = ""
    # Where the kind's ranks compute (torch device type) and what must be installed beside stock torch
    # for it: an importable extension that registers the device and its backend ("torch_npu",
    # "torch_musa"), or a vendor build of torch itself (text with a space, e.g. "torch (ROCm build)");
    # "" when a stock CPU torch suffices. "" device_type: derived from the backend.
    device_type: str = ""
    torch_package: str = ""
    # Operator-level compute model (predict/opmodel.py). A kind without sm_count keeps the constant
    # `efficiency` roofline (CPUs, hand-made kinds). Peaks are datasheet numbers; gemm_eff* (fraction
    # of the peak a full-wave long-K GEMM reaches), gemm_k_half, mem_eff (share of mem_bw element-wise
    # kernels reach) and kernel_launch_s (host dispatch per kernel) are fitted, and `calibration` says
    # on what; left out, the op model uses its assumed defaults and says "uncalibrated".
    sm_count: int | None = None
    fp32_flops: float | None = None  # non-tensor fp32 (what an fp32 matmul runs on without TF32)
    tf32_flops: float | None = None  # dense TF32 tensor-core peak; None where the kind has none
    attention: str = "flash"  # the attention implementation bf16 training uses on this kind
    gemm_eff: float | None = None  # bf16 / fp16 tensor-core GEMMs
    gemm_eff_tf32: float | None = None  # fp32 GEMMs on TF32 tensor cores (what Sailor's A100/GH200 runs used)
    gemm_eff_fp32: float | None = None  # fp32 GEMMs on the non-tensor units
    gemm_k_half: float | None = None
    mem_eff: float | None = None
    kernel_launch_s: float | None = None
    calibration: str = ""
    # bf16 fused-attention kernel's fraction of peak_flops (forward and backward; predict/gemm.py); None:
    # taken equal to gemm_eff
    flash_eff: float | None = None
    # where gemm_eff (bf16), flash_eff and mem_eff come from when not from `calibration`: a cited public
    # measurement and how the number follows from it
    gemm_eff_source: str = ""
    flash_eff_source: str = ""
    mem_eff_source: str = ""
    # Memory model inputs (see hethub.predict.memory; ``attention`` above is shared with it): the
    # precisions hethub's runtime runs natively here (the first is the fallback), the per-process
    # framework reserve (CUDA/ROCm context + BLAS/DNN workspaces), the collective library's buffers
    # per communicator, and the caching allocator's reserve as a fraction of the allocated peak.
    precisions: tuple[str, ...] = ("bf16-mixed", "fp32")
    context_bytes: float = 0.0
    comm_buffer_bytes: float = 0.0
    fragmentation: float = 0.0
    intra_node_fabric: str = ""  # one of INTRA_NODE_FABRICS

    def __post_init__(self) -> None:
        if not self.device_type:
            object.__setattr__(self, "device_type", DEVICE_TYPE_OF_BACKEND.get(self.backend, "cpu"))

    @property
    def torch_extension(self) -> str:
        """The module to import before using the kind's device ("" if none: a torch build or stock torch)."""
        return self.torch_package if self.torch_package.isidentifier() else ""

    def precision_for(self, wanted: str) -> str:
        """The precision a stage of this kind trains in when ``wanted`` is asked for: it, where the
        runtime runs it here, else the kind's first listed precision."""
        return wanted if wanted in self.precisions else self.precisions[0]

    @property
    def effective_flops(self) -> float:
        return self.peak_flops * self.efficiency / self.emulated_slowdown

    @property
    def emulated(self) -> bool:
        return self.emulated_slowdown != 1.0


def parse_kind(name: str, table: dict[str, Any], *, where: str, base: DeviceKind | None = None) -> DeviceKind:
    check_keys(table, allowed=_KIND_KEYS, where=where)
    b = asdict(base) if base else {}

    def num(key: str, *, positive: bool = True) -> float:
        return get_number(table, key, where=where, default=b.get(key), positive=positive)

    if "mem_bytes" in table and "mem_gib" in table:
        raise field_error(where, "mem_gib", "conflicts with mem_bytes", "give only one of them")
    if "mem_gib" in table:
        mem_bytes = int(get_number(table, "mem_gib", where=where) * GIB)
    else:
        mem_bytes = int(num("mem_bytes"))
    efficiency = num("efficiency")
    if efficiency > 1:
        raise field_error(where, "efficiency", f"must be <= 1, got {efficiency}", "give a fraction of peak")
    slowdown = get_number(table, "emulated_slowdown", where=where, default=b.get("emulated_slowdown", 1.0))
    if not 1 <= slowdown <= 1000:
        raise field_error(where, "emulated_slowdown", f"must be >= 1, got {slowdown}" if slowdown < 1 else
                          f"is {slowdown:g}, beyond the 1000x that emulation supports",
                          "use 1 for real speed, k > 1 to emulate a k-times slower device")
    price = table.get("price_per_hour", b.get("price_per_hour"))
    if price is not None:
        price = get_number({"price_per_hour": price}, "price_per_hour", where=where)
    precisions = _precisions(table, where=where, default=b.get("precisions", ("bf16-mixed", "fp32")))
    fragmentation = get_number(table, "fragmentation", where=where, default=b.get("fragmentation", 0.0), positive=False)
    if not 0 <= fragmentation < 1:
        raise field_error(where, "fragmentation", f"must be in [0, 1), got {fragmentation}",
                          "give the allocator's reserve as a fraction of the allocated peak, e.g. 0.05")
    mem_bw = table.get("mem_bw_bytes_per_s", b.get("mem_bw_bytes_per_s"))
    if mem_bw is not None:
        mem_bw = check_range(where, "mem_bw_bytes_per_s",
                             get_number({"mem_bw_bytes_per_s": mem_bw}, "mem_bw_bytes_per_s", where=where))
    if "mem_gib" in table:
        _check_gib(where, mem_bytes)
    else:
        check_range(where, "mem_bytes", mem_bytes)
    for key in ("peak_flops", "intra_node_bw_bytes_per_s", "intra_node_latency_s"):
        check_range(where, key, num(key, positive=key != "intra_node_latency_s"))
    kind = DeviceKind(
        name=name,
        vendor=get_str(table, "vendor", where=where, default=b.get("vendor")),
        mem_bytes=mem_bytes,
        peak_flops=num("peak_flops"),
        intra_node_bw_bytes_per_s=num("intra_node_bw_bytes_per_s"),
        intra_node_latency_s=num("intra_node_latency_s", positive=False),
        backend=get_str(table, "backend", where=where, default=b.get("backend", "nccl"), choices=BACKENDS),
        efficiency=efficiency,
        mem_bw_bytes_per_s=mem_bw,
        emulated_slowdown=slowdown,
        source=_text(table, "source", where=where, default=b.get("source", "")),
        notes=_text(table, "notes", where=where, default=b.get("notes", "")),
        device_type=_device_type(table, where=where, base=b),
        torch_package=_text(table, "torch_package", where=where, default=b.get("torch_package", "")),
        **_opmodel_fields(table, where=where, base=b),
        price_per_hour=price,
        price_source=_text(table, "price_source", where=where,
                           default="cluster file" if "price_per_hour" in table else b.get("price_source", "")),
        precisions=precisions,
        context_bytes=get_number(table, "context_bytes", where=where, default=b.get("context_bytes", 0.0),
                                 positive=False),
        comm_buffer_bytes=get_number(table, "comm_buffer_bytes", where=where,
                                     default=b.get("comm_buffer_bytes", 0.0), positive=False),
        fragmentation=fragmentation,
        intra_node_fabric=_fabric(table, where=where, default=b.get("intra_node_fabric", "")),
    )
    moves = DEVICE_TYPE_OF_BACKEND[kind.backend]
    if moves != "cpu" and moves != kind.device_type:
        raise field_error(where, "device_type", f"is {kind.device_type!r} but backend {kind.backend!r} moves "
                          f"{moves!r} tensors", f'write device_type = "{moves}" or correct the backend')
    return kind


def _device_type(table: dict[str, Any], *, where: str, base: dict[str, Any]) -> str:
    """Explicit device_type; else the base's unless the table changes the backend; else the backend's."""
    if "device_type" in table:
        return get_str(table, "device_type", where=where, choices=DEVICE_TYPES)
    if base and "backend" not in table:
        return base.get("device_type", "")
    return ""  # DeviceKind derives it from the backend


def _opmodel_fields(table: dict[str, Any], *, where: str, base: dict[str, Any]) -> dict[str, Any]:
    """The optional operator-model fields of a kind, validated (a base kind's values inherited)."""
    out: dict[str, Any] = {}
    for key in ("fp32_flops", "tf32_flops", "gemm_k_half", "kernel_launch_s"):
        v = table.get(key, base.get(key))
        out[key] = None if v is None else get_number({key: v}, key, where=where)
    for key in ("gemm_eff", "gemm_eff_tf32", "gemm_eff_fp32", "mem_eff", "flash_eff"):
        v = table.get(key, base.get(key))
        out[key] = None if v is None else get_number({key: v}, key, where=where)
        if v is not None and out[key] > 1:
            raise field_error(where, key, f"must be <= 1, got {v}", "give a fraction of the peak")
    sm = table.get("sm_count", base.get("sm_count"))
    out["sm_count"] = None if sm is None else get_int({"sm_count": sm}, "sm_count", where=where)
    out["attention"] = get_str(table, "attention", where=where, default=base.get("attention", "flash"),
                               choices=ATTENTION_IMPLS)
    for key in ("calibration", *OPMODEL_SOURCES):
        out[key] = _text(table, key, where=where, default=base.get(key, ""))
    for key in OPMODEL_SOURCES:  # a number overridden without its source is the cluster file's, not the base's
        if base and key.removesuffix("_source") in table and key not in table:
            out[key] = "cluster file"
    return out
def _fabric(table: dict[str, Any], *, where: str, default: str) -> str:
    value = table.get("intra_node_fabric", default)
    if value not in INTRA_NODE_FABRICS:
        raise field_error(where, "intra_node_fabric", f"is {value!r}",
                          f"use one of {', '.join(repr(f) for f in INTRA_NODE_FABRICS)} (\"\": the bandwidth given "
                          "is already an achieved collective rate)")
    return value


def _precisions(table: dict[str, Any], *, where: str, default: tuple[str, ...]) -> tuple[str, ...]:
    from hethub.spec.model import PRECISIONS

    value = table.get("precisions", default)
    if (not isinstance(value, (list, tuple)) or not value
            or any(not isinstance(v, str) or v not in PRECISIONS for v in value)):
        raise field_error(where, "precisions", f"must be a non-empty list of {PRECISIONS}, got {value!r}",
                          'write e.g. precisions = ["bf16-mixed", "fp32"] (the first is the fallback)')
    return tuple(value)


def _check_gib(where: str, mem_bytes: int) -> None:
    lo, hi = _RANGES["mem_bytes"][:2]
    if not lo <= mem_bytes <= hi:
        raise field_error(where, "mem_gib", f"is {mem_bytes / GIB:g} GiB, outside the physical range "
                          f"{lo / GIB:.2g}..{hi / GIB:.0f} GiB", "give one device's memory in GiB, e.g. 40")


def _text(table: dict[str, Any], key: str, *, where: str, default: str) -> str:
    value = table.get(key, default)
    if not isinstance(value, str):
        raise field_error(where, key, f"must be a string, got {value!r}", f'write {key} = "<text>"')
    return value


@functools.cache
def catalog() -> dict[str, DeviceKind]:
    """The built-in device kinds, keyed by name."""
    text = resources.files("hethub.spec").joinpath("catalog.toml").read_text(encoding="utf-8")
    import tomllib

    data = tomllib.loads(text)
    return {n: parse_kind(n, t, where=f"catalog.toml: kinds.{n}") for n, t in data["kinds"].items()}


def resolve_kind(name: str, *, where: str, local: dict[str, Any] | None = None) -> DeviceKind:
    local = local or {}
    if name in local:
        table = local[name]
        # A table named like a catalog kind overrides that kind's fields (e.g. only its price).
        base_name = table.get("base", name if name in catalog() else None) if isinstance(table, dict) else None
        base = None
        if base_name is not None:
            if not isinstance(base_name, str) or base_name not in catalog():
                raise field_error(f"{where}: kinds.{name}", "base", f"names unknown catalog kind {base_name!r}",
                                  f"use one of: {', '.join(sorted(catalog()))}")
            base = catalog()[base_name]
        return parse_kind(name, table, where=f"{where}: kinds.{name}", base=base)
    if name in catalog():
        return catalog()[name]
    raise SpecError(
        f"{where}: unknown device kind {name!r}. Fix: use a catalog kind ({', '.join(sorted(catalog()))}) "
        f"or define it under [kinds.{name}] in the cluster file."
    )
