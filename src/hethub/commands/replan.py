"""Re-planning for fewer devices: the same job on the first N devices of a plan.

A training job under torchrun's elastic agent may come back with fewer processes than its plan has
devices (``--nnodes MIN:MAX``). With ``--replan-on-shrink`` the entry point (``python -m
hethub.train``, :func:`hethub.train.rank_plan`) settles the plan for them before the runtime starts,
before any process group or communication thread exists: rank 0 plans the same model, global batch,
sequence length, schedule, precision, optimizer sharding and memory headroom for the surviving
devices in its own process (the planner forks nothing here) and writes the plan next to the
checkpoints; every other rank waits for that file and reads it, so all ranks run one plan even
though the planner's polish is bounded by wall time. The surviving devices are taken to be those of
ranks 0..N-1 of the old plan (torchrun numbers ranks node by node and cannot say which machine
left). Checkpoints are stored per parameter, so the runtime resumes under any plan.
"""

from __future__ import annotations

import os
import time
from dataclasses import replace
from pathlib import Path

from hethub.errors import HethubError, RuntimeSetupError
from hethub.fanout import serial
from hethub.plan import Plan
from hethub.predict.host import HostModel
from hethub.predict.memory import DEFAULT_MEM_HEADROOM
from hethub.predict.predictor import with_shard_weights
from hethub.search.config import PlannerConfig
from hethub.search.planner import make_plan
from hethub.spec.cluster import Cluster, NodeGroup

POLL_S = 0.2  # how often a waiting rank looks for rank 0's plan file


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
    """A plan for the same model, global batch, sequence length, schedule, precision, optimizer
    sharding and memory headroom on the devices of ranks 0..world_size-1 of ``plan`` (its first
    ``world_size`` devices), using every one of them (a rank without work cannot run). The planner
    searches in this process (it never forks). Raises RuntimeSetupError when no such plan exists.
    `host`: as for make_plan (the local emulation host, if any)."""
    cluster = restrict_cluster(plan.cluster, plan.devices[:world_size])
    headroom = plan.shard_weights.mem_headroom if plan.shard_weights is not None else DEFAULT_MEM_HEADROOM
    cfg = PlannerConfig(global_batch=plan.global_batch, seq_len=plan.seq_len, schedule=plan.schedule,
                        precision=plan.precision, top_k=top_k, optimizer_sharding=plan.optimizer_sharding,
                        optimizer_shares=plan.optimizer_shares, mem_headroom=headroom)
    try:
        with serial():  # in a training rank's process: fork nothing
            result = make_plan(cluster=cluster, model=plan.model, config=cfg, host=host)
    except HethubError as err:
        raise RuntimeSetupError(f"re-planning for the {world_size} surviving devices failed: {err}") from None
    for cand, _ in result.alternatives:
        if cand.world_size == world_size:
            return with_shard_weights(cand, mem_headroom=headroom).with_meta(replanned_from_world_size=plan.world_size)
    raise RuntimeSetupError(f"re-planning found no plan that uses all {world_size} surviving devices (the best uses "
                            f"{result.plan.world_size}). Fix: restart with --nproc-per-node/--nnodes giving "
                            f"{result.plan.world_size} processes, or with a plan written for them.")


def replan_path(root: str | Path, world_size: int) -> Path:
    return Path(root) / f"plan-world{world_size}.json"


def shrunk_plan(plan: Plan, *, world_size: int, rank: int, root: str | Path, timeout_s: float,
                host: HostModel | None = None) -> Plan:
    """The plan this rank runs when the job came back with ``world_size`` < plan.world_size ranks.

    Rank 0 re-plans (or reuses the plan an earlier attempt wrote for these devices) and writes it to
    ``root/plan-world{N}.json`` atomically; any other rank waits up to ``timeout_s`` for a plan there
    for these devices and reads it. No process group is needed, so none exists yet when the planner
    runs; ``root`` must be a directory every rank sees (the checkpoint directory)."""
    path = replan_path(root, world_size)
    survivors = restrict_cluster(plan.cluster, plan.devices[:world_size])
    if rank == 0:
        found = _replanned(path, plan, survivors)
        if found is not None:
            return found
        new = replan(plan, world_size=world_size, host=host)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
        new.save(tmp)
        os.replace(tmp, path)
        return Plan.load(path)
    deadline = time.monotonic() + timeout_s
    while (found := _replanned(path, plan, survivors)) is None:
        if time.monotonic() > deadline:
            raise RuntimeSetupError(
                f"rank {rank}: no plan for {world_size} devices appeared at {path} within {timeout_s:g} s (rank 0 "
                "writes it; its own message says why it did not). Fix: give --checkpoint-dir a directory every "
                "node sees (a shared file system), or a larger --timeout-s if planning takes longer.")
        time.sleep(POLL_S)
    return found


def _replanned(path: Path, plan: Plan, survivors: Cluster) -> Plan | None:
    """The plan at ``path`` if it is one for ``plan``'s job on exactly these surviving devices."""
    if not path.is_file():
        return None
    try:
        old = Plan.load(path)
    except HethubError:
        return None
    c = old.cluster
    same_job = (old.model == plan.model and old.global_batch == plan.global_batch and old.seq_len == plan.seq_len
                and c.name == survivors.name
                and [(d.kind, d.node) for d in c.devices] == [(d.kind, d.node) for d in survivors.devices]
                and all(survivors.kinds.get(k) == kind for k, kind in c.kinds.items()))
    return old if same_job else None
