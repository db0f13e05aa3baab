"""Clusters of mixed accelerators: node groups of device kinds, and the links between devices.

A cluster file (TOML) lists node groups, each of one device kind (``hethub.spec.kind``: the catalog
or ``[kinds.NAME]`` tables in the file). Devices are numbered in file order: group by group, node by
node, device by device; that number is the device id a plan refers to.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from hethub.errors import SpecError, field_error
from hethub.spec._toml import check_keys, get_int, get_number, get_str, read_toml
from hethub.spec.kind import DeviceKind, catalog, check_range, resolve_kind

_NETWORK_NUMBERS = {"inter_node_bw_bytes_per_s", "inter_node_latency_s", "cross_kind_bw_bytes_per_s",
                    "cross_kind_latency_s"}
_NETWORK_KEYS = _NETWORK_NUMBERS | {"inter_node_fabric", "cross_kind_fabric"}
# What carries inter-node traffic (hethub.predict.fabrics prices each by its achievable-bandwidth
# curve); "measured": a links profile's numbers, already what the cluster achieves.
NETWORK_FABRICS = ("infiniband", "roce", "efa", "ethernet", "measured")
DEFAULT_NETWORK_FABRIC = "infiniband"
# Where the cross-kind figures come from (a citation, or the links profile that measured them):
# ``hethub predict --json`` reports it in its sources.
_CROSS_SOURCE = "cross_kind_source"
# The planner's tested range is up to 4,096 devices (bench/planner_scale.py); 131,072 leaves room for
# today's largest clusters while refusing a typo that would make it run for minutes.
MAX_DEVICES = 131_072
MAX_DEVICES_PER_NODE = 1024


@dataclass(frozen=True)
class Link:
    bw_bytes_per_s: float
    latency_s: float
    # The interconnect (hethub.predict.fabrics): its achievable share of bw_bytes_per_s by message
    # size; "" prices the link at bw_bytes_per_s (measured links, local emulation).
    fabric: str = ""

    def time_s(self, nbytes: float) -> float:
        return self.latency_s + nbytes / self.bw_bytes_per_s


def node_link(kind: DeviceKind) -> Link:
    """The link between two devices of one node of ``kind`` (what a TP group's collectives use)."""
    return Link(kind.intra_node_bw_bytes_per_s, kind.intra_node_latency_s, kind.intra_node_fabric)


@dataclass(frozen=True)
class NodeGroup:
    kind: str
    num_nodes: int
    devices_per_node: int
    # Per-group NIC override; None uses the cluster's network default.
    inter_node_bw_bytes_per_s: float | None = None
    # How many of a node's devices share one NIC (the inter-node bandwidth is one NIC's): None is the
    # whole node (one NIC per node, as in a workstation cluster on Ethernet), 1 a NIC per device (a
    # rail-optimised training node). Messages that leave or enter a NIC at once share its bandwidth.
    devices_per_nic: int | None = None

    @property
    def nic_size(self) -> int:
        """Devices behind one NIC."""
        return self.devices_per_nic or self.devices_per_node

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
    nic: int = 0  # global index of the NIC the device reaches other nodes through


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
    # which the ring model over the p2p link does not see.
    allreduce: tuple[tuple[int, Link], ...] = ()
    # ``emulated_links = true``: messages between ranks of different (emulated) nodes are held back to
    # arrive as over Cluster.link(a, b) (hethub.runtime.emulated_links), so a CPU run can show slow networks.
    links: bool = False


@dataclass(frozen=True)
class Cluster:
    name: str
    kinds: dict[str, DeviceKind]
    groups: tuple[NodeGroup, ...]
    inter_node: Link
    cross_kind: Link
    description: str = ""
    cross_kind_source: str = ""  # ``[network] cross_kind_source``: what the cross-kind figures rest on
    # Local emulation only (see EmulationHost). None: each device computes on its own hardware, as on
    # any real cluster.
    host: EmulationHost | None = None
    devices: tuple[Device, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        devices, node, nic = [], 0, 0
        for gi, g in enumerate(self.groups):
            for _ in range(g.num_nodes):
                for local in range(g.devices_per_node):
                    devices.append(Device(id=len(devices), kind=g.kind, node=node, local_index=local, group=gi,
                                          nic=nic + local // g.nic_size))
                node += 1
                nic += -(-g.devices_per_node // g.nic_size)
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

    def only_kinds(self, kinds: Iterable[str]) -> Cluster:
        """This cluster without the node groups of every other kind (a fleet of some of its kinds),
        named after the kinds it keeps."""
        keep = [k for k in self.kind_names if k in set(kinds)]
        if not keep:
            raise SpecError(f"cluster {self.name!r}: no kind of {sorted(kinds)} is in it (kinds: "
                            f"{', '.join(self.kind_names)}). Fix: name kinds of this cluster.")
        return replace(self, name=f"{self.name}[{'+'.join(keep)}]",
                       groups=tuple(g for g in self.groups if g.kind in keep),
                       kinds={k: v for k, v in self.kinds.items() if k in keep})

    def link(self, a: int, b: int) -> Link:
        """The link data takes from device a to device b."""
        da, db = self.devices[a], self.devices[b]
        if da.node == db.node:
            return node_link(self.kinds[da.kind])
        bw = min(self._nic_bw(da.group), self._nic_bw(db.group))
        lat, fabric = self.inter_node.latency_s, self.inter_node.fabric
        if da.kind != db.kind:
            if self.cross_kind.bw_bytes_per_s < bw:
                bw, fabric = self.cross_kind.bw_bytes_per_s, self.cross_kind.fabric
            lat = max(lat, self.cross_kind.latency_s)
        return Link(bw, lat, fabric)

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
            # devices_per_nic only where given, so plans of clusters without it keep their bytes
            "groups": [{k: v for k, v in asdict(g).items() if k != "devices_per_nic" or v is not None}
                       for g in self.groups],
            "network": {
                "inter_node_bw_bytes_per_s": self.inter_node.bw_bytes_per_s,
                "inter_node_latency_s": self.inter_node.latency_s,
                "cross_kind_bw_bytes_per_s": self.cross_kind.bw_bytes_per_s,
                "cross_kind_latency_s": self.cross_kind.latency_s,
                **({_CROSS_SOURCE: self.cross_kind_source} if self.cross_kind_source else {}),
                **({"inter_node_fabric": self.inter_node.fabric}
                   if self.inter_node.fabric != DEFAULT_NETWORK_FABRIC else {}),
                **({"cross_kind_fabric": self.cross_kind.fabric}
                   if self.cross_kind.fabric != self.inter_node.fabric else {}),
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
        keys = set(net) - {_CROSS_SOURCE} if isinstance(net, dict) else set()
        if not isinstance(net, dict) or not _NETWORK_NUMBERS <= keys or not keys <= _NETWORK_KEYS:
            raise field_error(where, "network", f"must give {', '.join(sorted(_NETWORK_NUMBERS))} and at most "
                              f"{', '.join(sorted(_NETWORK_KEYS - _NETWORK_NUMBERS))} (is malformed)",
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
    """A kind embedded in a plan written before the memory fields (or the intra-node fabric) existed
    takes them from the catalog kind of the same name (every field it does give still wins)."""
    if "base" not in table and name in catalog() and not {"attention", "precisions"} <= set(table):
        return {"base": name, **table}
    if "intra_node_fabric" not in table and name in catalog():  # written before fabrics existed
        return {**table, "intra_node_fabric": catalog()[name].intra_node_fabric}
    return table


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
        check_keys(g, allowed={"kind", "nodes", "devices_per_node", "inter_node_bw_bytes_per_s", "devices_per_nic"},
                   where=gw)
        kind = get_str(g, "kind", where=gw)
        kinds[kind] = resolve_kind(kind, where=where, local=local)
        nic = g.get("inter_node_bw_bytes_per_s")
        per_node = get_int(g, "devices_per_node", where=gw)
        if per_node > MAX_DEVICES_PER_NODE:
            raise field_error(gw, "devices_per_node", f"is {per_node}; a node holds at most {MAX_DEVICES_PER_NODE}",
                              "give the devices of one node and the node count in 'nodes'")
        per_nic = None if g.get("devices_per_nic") is None else get_int(g, "devices_per_nic", where=gw)
        if per_nic is not None and (per_nic < 1 or per_node % per_nic):
            raise field_error(gw, "devices_per_nic", f"is {per_nic}, which does not divide devices_per_node "
                              f"({per_node})", "give how many of a node's devices share one NIC: 1 for a NIC per "
                              "device, devices_per_node (or leave it out) for one NIC per node")
        groups.append(NodeGroup(
            kind=kind, num_nodes=get_int(g, "nodes", where=gw), devices_per_node=per_node,
            inter_node_bw_bytes_per_s=None if nic is None else check_range(
                gw, "inter_node_bw_bytes_per_s", get_number(g, "inter_node_bw_bytes_per_s", where=gw)),
            devices_per_nic=per_nic,
        ))
    total = sum(g.num_nodes * g.devices_per_node for g in groups)
    if total > MAX_DEVICES:
        sizes = " + ".join(f"{g.num_nodes} x {g.devices_per_node}" for g in groups)
        raise field_error(where, "nodes", f"gives {total:,} devices ({sizes}), more than the {MAX_DEVICES:,} "
                          "hethub plans for", "check the node counts of the [[group]] tables")
    net = data.get("network", {})
    nw = f"{where}: network"
    check_keys(net, allowed=_NETWORK_KEYS | {_CROSS_SOURCE}, where=nw)
    host = _host(data, where)
    # A local emulation's links are its host's own numbers (measured or given), not a fabric's.
    fabric = _network_fabric(net, "inter_node_fabric", where=nw, default=DEFAULT_NETWORK_FABRIC if host is None else "")
    inter = Link(get_number(net, "inter_node_bw_bytes_per_s", where=nw, default=12.5e9),
                 get_number(net, "inter_node_latency_s", where=nw, default=10e-6, positive=False), fabric)
    cross = Link(get_number(net, "cross_kind_bw_bytes_per_s", where=nw, default=inter.bw_bytes_per_s),
                 get_number(net, "cross_kind_latency_s", where=nw, default=inter.latency_s, positive=False),
                 # cited or measured figures (cross_kind_source) are already an achieved rate
                 _network_fabric(net, "cross_kind_fabric", where=nw, default="" if net.get(_CROSS_SOURCE) else fabric))
    for key, v in (("inter_node_bw_bytes_per_s", inter.bw_bytes_per_s), ("inter_node_latency_s", inter.latency_s),
                   ("cross_kind_bw_bytes_per_s", cross.bw_bytes_per_s), ("cross_kind_latency_s", cross.latency_s)):
        check_range(nw, key, v)
    name = data.get("name", "cluster")
    if not isinstance(name, str):
        raise field_error(where, "name", "must be a string", 'write name = "my-cluster"')
    desc = data.get("description", "")
    return Cluster(name=name, description=desc if isinstance(desc, str) else "", kinds=kinds,
                   groups=tuple(groups), inter_node=inter, cross_kind=cross, host=host,
                   cross_kind_source=get_str(net, _CROSS_SOURCE, where=nw, default=""))


def _network_fabric(net: dict[str, Any], key: str, *, where: str, default: str) -> str:
    """A network fabric name; "" (a link built in code without one) is priced at its own numbers."""
    if net.get(key) == "":
        return ""
    return get_str(net, key, where=where, default=default, choices=NETWORK_FABRICS)


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
