"""Typed specifications of clusters and models (pure Python, no torch)."""

from hethub.spec.cluster import Cluster, Device, Link, NodeGroup, load_cluster
from hethub.spec.kind import DeviceKind
from hethub.spec.model import ModelSpec, get_model

__all__ = ["Cluster", "Device", "DeviceKind", "Link", "ModelSpec", "NodeGroup", "get_model", "load_cluster"]
