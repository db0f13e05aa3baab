"""Measured links: the profile `hethub bench comm` writes, its alpha-beta fit, and applying it.

A links profile replaces the catalog's nominal link numbers with measured ones, per link class:

- ``intra_node:<kind>``: two devices of one kind in one node (the kind's intra-node link);
- ``inter_node:<kind>``: two devices of one kind in different nodes (that kind's node groups' NIC);
- ``cross_kind``: two devices of different kinds (through the bridge).

Each class holds the fitted model ``time = latency_s + bytes / bw_bytes_per_s`` and the samples it was
fitted to. For a local emulation cluster (``host_cores`` set) the profile may also hold the host's
measured all-reduce, by number of participating ranks, fitted the same way to the bytes each rank
contributes (``host_allreduce``; optional, version 1 files without it stay valid). Format (JSON)::

    {"format": "hethub-links", "version": 1, "cluster": "local-cpu", "note": "...",
     "links": {"intra_node:cpu-fast": {"latency_s": 6.1e-05, "bw_bytes_per_s": 1.9e9,
                                        "samples": [[4096, 6.3e-05], ...]}, ...},
     "host_allreduce": {"2": {"latency_s": 1.2e-04, "bw_bytes_per_s": 6.0e8, "samples": [...]}, ...}}

Pure Python: the predictor reads profiles without torch.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from hethub.errors import SpecError, load_json
from hethub.plan import Plan
from hethub.spec.cluster import Cluster, Link

LINKS_FORMAT = "hethub-links"
LINKS_VERSION = 1
CROSS_KIND = "cross_kind"


@dataclass(frozen=True)
class LinkFit:
    latency_s: float
    bw_bytes_per_s: float
    samples: tuple[tuple[int, float], ...] = ()  # (message bytes, one-way seconds)

    @property
    def link(self) -> Link:
        return Link(self.bw_bytes_per_s, self.latency_s)


@dataclass(frozen=True)
class LinksProfile:
    cluster: str
    links: dict[str, LinkFit]
    note: str = ""
    meta: dict[str, Any] = field(default_factory=dict, compare=False)
    host_allreduce: dict[int, LinkFit] = field(default_factory=dict)  # participants -> fit

    def to_dict(self) -> dict[str, Any]:
        out = {"format": LINKS_FORMAT, "version": LINKS_VERSION, "cluster": self.cluster, "note": self.note,
               "meta": self.meta, "links": {name: _fit_dict(f) for name, f in self.links.items()}}
        if self.host_allreduce:
            out["host_allreduce"] = {str(p): _fit_dict(f) for p, f in sorted(self.host_allreduce.items())}
        return out


def _fit_dict(f: LinkFit) -> dict[str, Any]:
    return {"latency_s": f.latency_s, "bw_bytes_per_s": f.bw_bytes_per_s, "samples": [list(s) for s in f.samples]}


def fit_alpha_beta(samples: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """(latency_s, bw_bytes_per_s) of ``t = alpha + beta * bytes`` by least squares on relative error.

    Plain least squares is dominated by the largest messages and leaves alpha to noise (often
    negative); weighting each sample by 1/t^2 fits small messages' latency and large ones'
    bandwidth equally well. Alpha is clamped to >= 0 and beta to > 0.
    """
    pts = [(float(n), float(t)) for n, t in samples if t > 0]
    if not pts:
        raise ValueError("no positive timings to fit")
    if len({n for n, _ in pts}) < 2:
        n, t = pts[0]
        return 0.0, n / t if n > 0 else math.inf
    w = [1.0 / (t * t) for _, t in pts]
    sw = sum(w)
    sx = sum(wi * n for wi, (n, _) in zip(w, pts, strict=True))
    sy = sum(wi * t for wi, (_, t) in zip(w, pts, strict=True))
    sxx = sum(wi * n * n for wi, (n, _) in zip(w, pts, strict=True))
    sxy = sum(wi * n * t for wi, (n, t) in zip(w, pts, strict=True))
    beta = (sw * sxy - sx * sy) / (sw * sxx - sx * sx)
    if beta <= 0:  # no measurable bandwidth cost: all time is latency
        return sy / sw, math.inf
    alpha = (sy - beta * sx) / sw
    if alpha < 0:  # refit the slope through the origin
        alpha, beta = 0.0, sxy / sxx
    return alpha, 1.0 / beta


# ---- io ---------------------------------------------------------------------------------------------
def _bad(where: str, problem: str) -> SpecError:
    return SpecError(f"{where}: {problem}. Fix: re-measure with 'hethub bench comm --cluster FILE --out {where}'.")


def links_profile_from_dict(data: Any, *, where: str = "links profile") -> LinksProfile:
    if not isinstance(data, dict) or data.get("format") != LINKS_FORMAT:
        raise _bad(where, f"not a links profile (field 'format' must be {LINKS_FORMAT!r})")
    if data.get("version") != LINKS_VERSION:
        raise _bad(where, f"field 'version' is {data.get('version')!r}; this hethub reads {LINKS_VERSION}")
    links = data.get("links")
    if not isinstance(links, dict) or not links:
        raise _bad(where, "field 'links' must be a non-empty object")
    fits = {}
    for name, entry in links.items():
        if not (name == CROSS_KIND or name.startswith(("intra_node:", "inter_node:"))):
            raise _bad(where, f"link class {name!r} is not cross_kind, intra_node:<kind> or inter_node:<kind>")
        fits[name] = _parse_fit(entry, where=where, key=f"links.{name}")
    host = data.get("host_allreduce", {})
    if not isinstance(host, dict):
        raise _bad(where, "field 'host_allreduce' must be an object of participants -> fit")
    allreduce = {}
    for p, entry in host.items():
        if not (isinstance(p, str) and p.isdigit() and int(p) >= 2):
            raise _bad(where, f"host_allreduce key {p!r} is not a participant count >= 2")
        allreduce[int(p)] = _parse_fit(entry, where=where, key=f"host_allreduce.{p}")
    meta = data.get("meta") if isinstance(data.get("meta"), dict) else {}
    return LinksProfile(cluster=str(data.get("cluster", "")), links=fits, note=str(data.get("note", "")), meta=meta,
                        host_allreduce=allreduce)


def _parse_fit(entry: Any, *, where: str, key: str) -> LinkFit:
    try:
        lat, bw = float(entry["latency_s"]), float(entry["bw_bytes_per_s"])
        samples = tuple((int(n), float(t)) for n, t in entry.get("samples", []))
    except (TypeError, KeyError, ValueError):
        raise _bad(where, f"{key} needs numbers latency_s and bw_bytes_per_s") from None
    if not (lat >= 0 and bw > 0 and math.isfinite(lat)):
        raise _bad(where, f"{key} has latency_s={lat}, bw_bytes_per_s={bw} (need latency_s >= 0, finite, and "
                          "bw_bytes_per_s > 0)")
    return LinkFit(latency_s=lat, bw_bytes_per_s=bw, samples=samples)


def read_links_profile(path: str | Path) -> LinksProfile:
    p = Path(path)
    remeasure = f"'hethub bench comm --cluster FILE --out {p}'"
    data = load_json(p, missing=f"links profile '{p}' does not exist. Fix: write it with {remeasure}.",
                     invalid_fix=f"re-measure with {remeasure}")
    return links_profile_from_dict(data, where=str(p))


def write_links_profile(profile: LinksProfile, path: str | Path) -> None:
    from hethub.outfiles import write_text_atomic

    write_text_atomic(path, json.dumps(profile.to_dict(), indent=2) + "\n")


# ---- applying it ------------------------------------------------------------------------------------
def apply_links_profile(cluster: Cluster, profile: LinksProfile) -> Cluster:
    """``cluster`` with its links replaced by the profile's measurements, where it has them.

    intra_node:<kind> -> that kind's intra-node link; inter_node:<kind> -> the NIC bandwidth of that
    kind's node groups, and the network's inter-node latency (one number for the cluster: the largest
    measured); cross_kind -> the cluster's cross-kind link. Classes the profile lacks keep the file's
    numbers. A class naming a kind the cluster lacks is an error (the profile is for another cluster).
    The host all-reduce applies to local emulation clusters (``host_cores`` set) only. Measured classes
    are priced at their fitted numbers, not through a fabric's curve (predict/fabrics.py): the fit is
    already what the link achieves.
    """
    kinds = dict(cluster.kinds)
    groups = list(cluster.groups)
    inter_latencies = []
    cross, cross_source = cluster.cross_kind, cluster.cross_kind_source
    for name, fit in profile.links.items():
        if name == CROSS_KIND:
            cross = replace(fit.link, fabric="measured")  # measured: already the achievable rate
            cross_source = (f"measured: links profile of {profile.cluster!r} "
                            f"({profile.meta.get('transport', 'unknown transport')}, host "
                            f"{profile.meta.get('host', 'unknown')}), through the bridge")
            continue
        klass, kind = name.split(":", 1)
        if kind not in kinds:
            raise SpecError(f"links profile (cluster {profile.cluster!r}) measures kind {kind!r}, which cluster "
                            f"{cluster.name!r} lacks. Fix: measure this cluster with 'hethub bench comm'.")
        if klass == "intra_node":
            kinds[kind] = replace(kinds[kind], intra_node_bw_bytes_per_s=fit.bw_bytes_per_s,
                                  intra_node_latency_s=fit.latency_s, intra_node_fabric="")
        else:
            groups = [replace(g, inter_node_bw_bytes_per_s=fit.bw_bytes_per_s) if g.kind == kind else g
                      for g in groups]
            inter_latencies.append(fit.latency_s)
    inter = cluster.inter_node
    if inter_latencies:
        inter = Link(inter.bw_bytes_per_s, max(inter_latencies), "measured")
    host = cluster.host
    if profile.host_allreduce and host is not None:
        host = replace(host, allreduce=tuple((p, f.link) for p, f in sorted(profile.host_allreduce.items())))
    return replace(cluster, kinds=kinds, groups=tuple(groups), inter_node=inter, cross_kind=cross, host=host,
                   cross_kind_source=cross_source)


def plan_with_links(plan: Plan, profile: LinksProfile) -> Plan:
    """``plan`` predicted on measured links: the embedded cluster with the profile applied."""
    return replace(plan, cluster=apply_links_profile(plan.cluster, profile))
