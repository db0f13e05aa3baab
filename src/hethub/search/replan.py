"""Re-planning for fewer devices: the same job on the first N devices of a plan.

Used by the runtime's elastic restarts (``hethub.train --replan-on-shrink``, docs/reliability.md):
when torchrun starts an attempt with fewer processes than the plan has devices, rank 0 plans the
same model, global batch, sequence length, schedule and precision for the surviving devices.
Pure (no torch): it lives with the planner, and the runtime calls it.
"""

from __future__ import annotations

from dataclasses import replace

from hethub.errors import HethubError, RuntimeSetupError
from hethub.plan import Plan
from hethub.predict.host import HostModel
from hethub.search.config import PlannerConfig
from hethub.search.planner import make_plan
from hethub.spec.cluster import Cluster, NodeGroup


def restrict_cluster(cluster: Cluster, device_ids: list[int] | tuple[int, ...]) -> Cluster:
    """The sub-cluster of ``device_ids`` (nodes keep their kind and NIC; a node may lose devices).
    Its device i is the i-th smallest of ``device_ids``, so rank order is preserved."""
    ids = sorted(set(device_ids))
    if not ids or not all(0 <= d < cluster.num_devices for d in ids):
        raise RuntimeSetupError(f"cannot restrict cluster {cluster.name!r} ({cluster.num_devices} devices) to devices "
                                f"{ids}. Fix: launch between 1 and {cluster.num_devices} processes.")
    per_node: dict[int, int] = {}
    for d in ids:
        per_node[cluster.devices[d].node] = per_node.get(cluster.devices[d].node, 0) + 1
    groups: list[NodeGroup] = []
    for node, count in per_node.items():  # ascending: device ids grow node by node
        g = cluster.groups[next(d for d in cluster.devices if d.node == node).group]
        one = replace(g, num_nodes=1, devices_per_node=count)
        if groups and replace(groups[-1], num_nodes=1) == one:
            groups[-1] = replace(groups[-1], num_nodes=groups[-1].num_nodes + 1)
        else:
            groups.append(one)
    return replace(cluster, name=f"{cluster.name}[{len(ids)} devices]", groups=tuple(groups))


def replan(plan: Plan, *, world_size: int, top_k: int = 16, host: HostModel | None = None) -> Plan:
    """A plan for the same model, global batch, sequence length, schedule and precision on the devices
    of ranks 0..world_size-1 of ``plan`` (its first ``world_size`` devices), using every one of them
    (a rank without work cannot run). Raises RuntimeSetupError when no such plan exists. `host`: as
    for make_plan (the runtime passes its local emulation host, if any)."""
    cluster = restrict_cluster(plan.cluster, plan.devices[:world_size])
    cfg = PlannerConfig(global_batch=plan.global_batch, seq_len=plan.seq_len, schedule=plan.schedule,
                        precision=plan.precision, top_k=top_k)
    try:
        result = make_plan(cluster=cluster, model=plan.model, config=cfg, host=host)
    except HethubError as err:
        raise RuntimeSetupError(f"re-planning for the {world_size} surviving devices failed: {err}") from None
    for cand, _ in result.alternatives:
        if cand.world_size == world_size:
            return cand.with_meta(replanned_from_world_size=plan.world_size)
    raise RuntimeSetupError(f"re-planning found no plan that uses all {world_size} surviving devices (the best uses "
                            f"{result.plan.world_size}). Fix: restart with --nproc-per-node/--nnodes giving "
                            f"{result.plan.world_size} processes, or with a plan written for them.")
