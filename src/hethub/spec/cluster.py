"""Clusters of mixed accelerators: device kinds, node groups and links.

A cluster file (TOML) lists node groups, each of one device kind. Kinds come from the built-in
catalog (``catalog.toml``, every number with its source) or are defined / overridden in the file
under ``[kinds.NAME]``. Devices are numbered in file order: group by group, node by node, device by
device; that number is the device id a plan refers to.
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from hethub.errors import SpecError, field_error
from hethub.spec._toml import check_keys, get_int, get_number, get_str, read_toml

GIB = 1024**3
BACKENDS = ("nccl", "gloo", "hccl", "xccl", "mccl", "mpi")
# The torch device type a backend moves tensors of, i.e. where a kind's ranks compute by default.
# One home for this map: the runtime's device map and the communicator read it from here.
DEVICE_TYPE_OF_BACKEND = {"nccl": "cuda", "hccl": "npu", "xccl": "xpu", "mccl": "musa", "gloo": "cpu", "mpi": "cpu"}
DEVICE_TYPES = ("cuda", "npu", "xpu", "musa", "cpu")

_NETWORK_KEYS = {"inter_node_bw_bytes_per_s", "inter_node_latency_s", "cross_kind_bw_bytes_per_s",
                 "cross_kind_latency_s"}
_KIND_KEYS = {
    "base", "vendor", "mem_bytes", "mem_gib", "peak_flops", "intra_node_bw_bytes_per_s",
    "intra_node_latency_s", "mem_bw_bytes_per_s", "backend", "efficiency", "emulated_slowdown",
    "source", "notes", "device_type", "torch_package", "price_per_hour", "price_source", *(
        # the operator-level compute model (predict/opmodel.py); all optional
        "sm_count", "fp32_flops", "tf32_flops", "attention", "gemm_eff", "gemm_eff_tf32", "gemm_eff_fp32",
        "gemm_k_half", "mem_eff", "kernel_launch_s", "calibration"),
    "precisions", "context_bytes", "comm_buffer_bytes", "fragmentation",
}
ATTENTION_IMPLS = ("flash", "math")

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
# The planner's tested range is up to 4,096 devices (bench/planner_scale.py); 131,072 leaves room for
# today's largest clusters while refusing a typo that would make it run for minutes.
MAX_DEVICES = 131_072
MAX_DEVICES_PER_NODE = 1024


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
    # Memory model inputs (see hethub.predict.memory; ``attention`` above is shared with it): the
    # precisions hethub's runtime runs natively here (the first is the fallback), the per-process
    # framework reserve (CUDA/ROCm context + BLAS/DNN workspaces), the collective library's buffers
    # per communicator, and the caching allocator's reserve as a fraction of the allocated peak.
    precisions: tuple[str, ...] = ("bf16-mixed", "fp32")
    context_bytes: float = 0.0
    comm_buffer_bytes: float = 0.0
    fragmentation: float = 0.0

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


@dataclass(frozen=True)
class Link:
    bw_bytes_per_s: float
    latency_s: float

    def time_s(self, nbytes: float) -> float:
        return self.latency_s + nbytes / self.bw_bytes_per_s


@dataclass(frozen=True)
class NodeGroup:
    kind: str
    num_nodes: int
    devices_per_node: int
    # Per-group NIC override; None uses the cluster's network default.
    inter_node_bw_bytes_per_s: float | None = None

    @property
    def num_devices(self) -> int:
        return self.num_nodes * self.devices_per_node


@dataclass(frozen=True)
class Device:
    id: int
    kind: str
    node: int  # global node index
    local_index: int  # index within its node
    group: int


@dataclass(frozen=True)
class EmulationHost:
    """A cluster that is a local emulation: every device is a process on ONE host (cluster file:
    ``host_cores``, ``[[host_allreduce]]``). Only described here; hethub.emulation models it, as
    the predictor's hook (docs/architecture.md)."""

    # The host's CPU cores, which ranks beyond that count share; "auto": the cores of the process
    # that predicts, read by hethub.emulation when it predicts (not when the file is loaded).
    cores: int | str
    # All-reduce among p ranks of that host as measured ('hethub bench comm'), ((p, fitted link), ...).
    # On one host gloo's all-reduce is bound by CPU copies and reductions, not by the loopback "link",
    # so the ring model over the p2p link misses it by ~3x here.
    allreduce: tuple[tuple[int, Link], ...] = ()
    # ``emulated_links = true``: messages between ranks of different (emulated) nodes are held back to
    # arrive as over Cluster.link(a, b) (hethub.emulation.links), so a CPU run can show slow networks.
    links: bool = False


@dataclass(frozen=True)
class Cluster:
    name: str
    kinds: dict[str, DeviceKind]
    groups: tuple[NodeGroup, ...]
    inter_node: Link
    cross_kind: Link
    description: str = ""
    # Local emulation only (see EmulationHost). None: each device computes on its own hardware, as on
    # any real cluster.
    host: EmulationHost | None = None
    devices: tuple[Device, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        devices, node = [], 0
        for gi, g in enumerate(self.groups):
            for _ in range(g.num_nodes):
                for local in range(g.devices_per_node):
                    devices.append(Device(id=len(devices), kind=g.kind, node=node, local_index=local, group=gi))
                node += 1
        object.__setattr__(self, "devices", tuple(devices))

    @property
    def num_devices(self) -> int:
        return len(self.devices)

    @property
    def kind_names(self) -> tuple[str, ...]:
        """Kinds in order of first appearance in the file."""
        return tuple(dict.fromkeys(g.kind for g in self.groups))

    def kind_of(self, device_id: int) -> DeviceKind:
        return self.kinds[self.devices[device_id].kind]

    def devices_of_kind(self, kind: str) -> tuple[Device, ...]:
        return tuple(d for d in self.devices if d.kind == kind)

    def count_by_kind(self) -> dict[str, int]:
        return {k: len(self.devices_of_kind(k)) for k in self.kind_names}

    def link(self, a: int, b: int) -> Link:
        """The link data takes from device a to device b."""
        da, db = self.devices[a], self.devices[b]
        if da.node == db.node:
            k = self.kinds[da.kind]
            return Link(k.intra_node_bw_bytes_per_s, k.intra_node_latency_s)
        bw = min(self._nic_bw(da.group), self._nic_bw(db.group))
        lat = self.inter_node.latency_s
        if da.kind != db.kind:
            bw = min(bw, self.cross_kind.bw_bytes_per_s)
            lat = max(lat, self.cross_kind.latency_s)
        return Link(bw, lat)

    def _nic_bw(self, group: int) -> float:
        return self.groups[group].inter_node_bw_bytes_per_s or self.inter_node.bw_bytes_per_s

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "description": self.description,
            **({"host_cores": self.host.cores} if self.host is not None else {}),
            **({"host_allreduce": _host_allreduce_rows(self.host.allreduce)}
               if self.host is not None and self.host.allreduce else {}),
            **({"emulated_links": True} if self.host is not None and self.host.links else {}),
            "kinds": {n: asdict(k) for n, k in self.kinds.items()},
            "groups": [asdict(g) for g in self.groups],
            "network": {
                "inter_node_bw_bytes_per_s": self.inter_node.bw_bytes_per_s,
                "inter_node_latency_s": self.inter_node.latency_s,
                "cross_kind_bw_bytes_per_s": self.cross_kind.bw_bytes_per_s,
                "cross_kind_latency_s": self.cross_kind.latency_s,
            },
        }

    @staticmethod
    def from_dict(data: dict[str, Any], *, where: str = "cluster") -> Cluster:
        """Inverse of :meth:`to_dict` (as embedded in a plan), validated like a cluster file."""
        if not isinstance(data, dict):
            raise SpecError(f"{where}: expected an object. Fix: re-create the plan with 'hethub plan'.")
        kinds, groups = data.get("kinds"), data.get("groups")
        if not isinstance(kinds, dict) or not all(isinstance(k, dict) for k in kinds.values()):
            raise field_error(where, "kinds", "must map kind names to objects", "re-create the plan with 'hethub plan'")
        if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
            raise field_error(where, "groups", "must be a list of objects", "re-create the plan with 'hethub plan'")
        net = data.get("network")
        if not isinstance(net, dict) or set(net) != _NETWORK_KEYS:
            raise field_error(where, "network", f"must give exactly {', '.join(sorted(_NETWORK_KEYS))} (is malformed)",
                              "re-create the plan with 'hethub plan'")
        toml_like = {
            "name": data.get("name", "cluster"),
            "description": data.get("description", ""),
            "kinds": {n: _with_catalog_base(n, {k: v for k, v in t.items() if k != "name" and v is not None})
                      for n, t in kinds.items()},
            "group": [
                {("nodes" if k == "num_nodes" else k): v for k, v in g.items() if v is not None} for g in groups
            ],
            "network": net,
            **({k: data[k] for k in ("host_cores", "host_allreduce", "emulated_links") if k in data}),
        }
        return parse_cluster(toml_like, where=where)


def _with_catalog_base(name: str, table: dict[str, Any]) -> dict[str, Any]:
    """A kind embedded in a plan written before the memory fields existed takes them from the catalog
    kind of the same name (every field it does give still wins)."""
    if "base" not in table and name in catalog() and not {"attention", "precisions"} <= set(table):
        return {"base": name, **table}
    return table


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
    for key in ("gemm_eff", "gemm_eff_tf32", "gemm_eff_fp32", "mem_eff"):
        v = table.get(key, base.get(key))
        out[key] = None if v is None else get_number({key: v}, key, where=where)
        if v is not None and out[key] > 1:
            raise field_error(where, key, f"must be <= 1, got {v}", "give a fraction of the peak")
    sm = table.get("sm_count", base.get("sm_count"))
    out["sm_count"] = None if sm is None else get_int({"sm_count": sm}, "sm_count", where=where)
    out["attention"] = get_str(table, "attention", where=where, default=base.get("attention", "flash"),
                               choices=ATTENTION_IMPLS)
    out["calibration"] = _text(table, "calibration", where=where, default=base.get("calibration", ""))
    return out
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


def parse_cluster(data: dict[str, Any], *, where: str) -> Cluster:
    check_keys(data, allowed={"name", "description", "kinds", "group", "network", "host_cores", "host_allreduce",
                              "emulated_links"}, where=where)
    local = data.get("kinds", {})
    check_keys(local, allowed=set(local) if isinstance(local, dict) else set(), where=f"{where}: kinds")
    raw_groups = data.get("group")
    if not isinstance(raw_groups, list) or not raw_groups:
        raise field_error(where, "group", "is missing or empty",
                          "add at least one [[group]] table with kind, nodes and devices_per_node")
    kinds: dict[str, DeviceKind] = {}
    groups = []
    for i, g in enumerate(raw_groups):
        gw = f"{where}: group[{i}]"
        check_keys(g, allowed={"kind", "nodes", "devices_per_node", "inter_node_bw_bytes_per_s"}, where=gw)
        kind = get_str(g, "kind", where=gw)
        kinds[kind] = resolve_kind(kind, where=where, local=local)
        nic = g.get("inter_node_bw_bytes_per_s")
        per_node = get_int(g, "devices_per_node", where=gw)
        if per_node > MAX_DEVICES_PER_NODE:
            raise field_error(gw, "devices_per_node", f"is {per_node}; a node holds at most {MAX_DEVICES_PER_NODE}",
                              "give the devices of one node and the node count in 'nodes'")
        groups.append(NodeGroup(
            kind=kind, num_nodes=get_int(g, "nodes", where=gw), devices_per_node=per_node,
            inter_node_bw_bytes_per_s=None if nic is None else check_range(
                gw, "inter_node_bw_bytes_per_s", get_number(g, "inter_node_bw_bytes_per_s", where=gw)),
        ))
    total = sum(g.num_nodes * g.devices_per_node for g in groups)
    if total > MAX_DEVICES:
        sizes = " + ".join(f"{g.num_nodes} x {g.devices_per_node}" for g in groups)
        raise field_error(where, "nodes", f"gives {total:,} devices ({sizes}), more than the {MAX_DEVICES:,} "
                          "hethub plans for", "check the node counts of the [[group]] tables")
    net = data.get("network", {})
    nw = f"{where}: network"
    check_keys(net, allowed=_NETWORK_KEYS, where=nw)
    inter = Link(get_number(net, "inter_node_bw_bytes_per_s", where=nw, default=12.5e9),
                 get_number(net, "inter_node_latency_s", where=nw, default=10e-6, positive=False))
    cross = Link(get_number(net, "cross_kind_bw_bytes_per_s", where=nw, default=inter.bw_bytes_per_s),
                 get_number(net, "cross_kind_latency_s", where=nw, default=inter.latency_s, positive=False))
    for key, v in (("inter_node_bw_bytes_per_s", inter.bw_bytes_per_s), ("inter_node_latency_s", inter.latency_s),
                   ("cross_kind_bw_bytes_per_s", cross.bw_bytes_per_s), ("cross_kind_latency_s", cross.latency_s)):
        check_range(nw, key, v)
    name = data.get("name", "cluster")
    if not isinstance(name, str):
        raise field_error(where, "name", "must be a string", 'write name = "my-cluster"')
    desc = data.get("description", "")
    return Cluster(name=name, description=desc if isinstance(desc, str) else "", kinds=kinds,
                   groups=tuple(groups), inter_node=inter, cross_kind=cross, host=_host(data, where))


def _host_allreduce_rows(fits: tuple[tuple[int, Link], ...]) -> list[dict[str, float]]:
    return [{"participants": p, "latency_s": lk.latency_s, "bw_bytes_per_s": lk.bw_bytes_per_s} for p, lk in fits]


def _parse_host_allreduce(data: dict[str, Any], where: str) -> tuple[tuple[int, Link], ...]:
    """``[[host_allreduce]]`` tables of participants, latency_s, bw_bytes_per_s (what 'hethub bench comm' measures)."""
    rows = data.get("host_allreduce", [])
    fix = "measure them with 'hethub bench comm --cluster FILE' and apply the links profile"
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise field_error(where, "host_allreduce", "must be a list of tables", fix)
    out: dict[int, Link] = {}
    for i, r in enumerate(rows):
        rw = f"{where}: host_allreduce[{i}]"
        check_keys(r, allowed={"participants", "latency_s", "bw_bytes_per_s"}, where=rw)
        p = get_int(r, "participants", where=rw)
        if p < 2 or p in out:
            raise field_error(rw, "participants", f"is {p}: need >= 2 and one row per count", fix)
        out[p] = Link(get_number(r, "bw_bytes_per_s", where=rw), get_number(r, "latency_s", where=rw, positive=False))
    return tuple(sorted(out.items()))


def _host(data: dict[str, Any], where: str) -> EmulationHost | None:
    """``host_cores = N`` or ``"auto"`` (kept as "auto": hethub.emulation reads the cores when it
    predicts), with the optional measured ``[[host_allreduce]]``; None without host_cores."""
    v = data.get("host_cores")
    allreduce = _parse_host_allreduce(data, where)
    links = data.get("emulated_links", False)
    if not isinstance(links, bool):
        raise field_error(where, "emulated_links", "must be true or false", "write emulated_links = true")
    if v is None:
        if links:
            raise field_error(where, "emulated_links", "is for local emulation only (it needs host_cores)",
                              'add host_cores = "auto", or leave emulated_links out on a real cluster')
        if allreduce:
            raise field_error(where, "host_allreduce", "is given but host_cores is not (a measured host all-reduce "
                              "belongs to a local emulation host)", 'add host_cores = "auto" or leave it out')
        return None
    if v != "auto" and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
        raise field_error(where, "host_cores", f"must be a positive integer or \"auto\", got {v!r}",
                          'write host_cores = "auto" for local emulation, or leave it out')
    return EmulationHost(cores=v, allreduce=allreduce, links=links)


def load_cluster(path: str | Path) -> Cluster:
    """Read and validate a cluster TOML file."""
    return parse_cluster(read_toml(path, what="cluster"), where=str(path))
