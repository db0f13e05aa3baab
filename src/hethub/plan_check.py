"""Checks of a plan's parts (``Plan.validate`` runs them): each raises PlanError naming the field
and the fix."""

from __future__ import annotations

import math

from hethub.errors import PlanError
from hethub.memo import Kept
from hethub.plan_parts import Pipeline, ShardWeights, Stage
from hethub.schedules import get_schedule
from hethub.spec.cluster import Cluster
from hethub.spec.model import ModelSpec


def fail(fieldname: str, problem: str, fix: str) -> None:
    raise PlanError(f"plan field '{fieldname}' {problem}. Fix: {fix}.")


def check_layer_ranges(p: Pipeline, where: str, *, model: ModelSpec, schedule: str) -> None:
    """Every stage holds v chunks, and the chunks in virtual-stage order (chunk 0 of every stage,
    then chunk 1, ...; without chunks: the stages in order) cover the layers contiguously, once."""
    v, n = p.virtual_stages, len(p.stages)
    for si, s in enumerate(p.stages):
        if s.num_chunks != v:
            fail(f"{where}.stages[{si}].chunks", f"holds {s.num_chunks} chunk(s) but stage 0 holds {v}",
                 "give every stage of a pipeline the same number of layer chunks")
        if s.chunks and s.layers != s.chunks[0]:
            fail(f"{where}.stages[{si}].layers", f"is {list(s.layers)}, not the first chunk {list(s.chunks[0])}",
                 "leave 'layers' out of a stage that lists 'chunks'")
    if v > 1:
        try:
            get_schedule(schedule, chunks=v)
        except ValueError:
            fail(f"{where}.virtual_stages", f"is {v} but the plan's schedule is {schedule!r}, which runs one "
                 "chunk per stage", "set training.schedule to \"interleaved\", or give each stage one layer range")
        if n < 2:
            fail(f"{where}.virtual_stages", f"is {v} on a pipeline of one stage (nothing to interleave)",
                 "give the stage one layer range, or use two or more stages")
    expect = 0
    for k in range(v * n):
        c, si = divmod(k, n)
        start, end = p.stages[si].layer_ranges[c]
        if start != expect or end < start or end > model.num_layers:
            order = " (virtual stage order: chunk 0 of every stage, then chunk 1, ...)" if v > 1 else ""
            fail(f"{where}.stages[{si}]." + (f"chunks[{c}]" if v > 1 else "layers"),
                 f"is [{start}, {end}), expected to start at {expect} and end by {model.num_layers}",
                 f"give contiguous layer ranges covering every layer once{order}")
        expect = end
    for si, s in enumerate(p.stages):
        # An empty chunk of a stage with other layers passes its input on (one more hop, no work).
        if s.num_layers == 0 and not (s.embedding or s.head):
            fail(f"{where}.stages[{si}].{'chunks' if v > 1 else 'layers'}", "is empty and the stage holds no "
                 "embedding or head", "remove the stage or give it layers")
    if expect != model.num_layers:
        fail(f"{where}.stages", f"cover layers 0..{expect}, but the model has {model.num_layers}",
             f"make the last {'chunk' if v > 1 else 'stage'}'s layers end at {model.num_layers}")


def check_seq_split(s: Stage, sw: str, *, seq_len: int, cp0: int) -> None:
    """Context and sequence parallelism: a CP degree that divides the devices and the sequence into
    2cp load-balanced chunks, equal on every stage of the pipeline (CP rank c of each stage holds the
    same positions, so stage messages go CP rank to CP rank); SP only with TP > 1 and a CP-local
    sequence the TP degree divides."""
    if isinstance(s.cp, bool) or not isinstance(s.cp, int) or s.cp < 1:
        fail(f"{sw}.cp", f"is {s.cp!r}", "give the context-parallel degree, an integer >= 1")
    if len(s.devices) % s.cp:
        fail(f"{sw}.cp", f"is {s.cp}, which does not divide the stage's {len(s.devices)} devices",
             "list tp x cp devices (CP-major: CP rank c's TP group first, then the next)")
    if s.cp != cp0:
        fail(f"{sw}.cp", f"is {s.cp} but the pipeline's first stage has cp {cp0}",
             "give every stage of a pipeline the same CP degree (replicas may differ)")
    if s.cp > 1 and seq_len % (2 * s.cp):
        fail(f"{sw}.cp", f"is {s.cp}, but seq_len {seq_len} does not split into 2 x cp = {2 * s.cp} equal chunks "
             "(causal load balancing: CP rank c holds chunks c and 2cp-1-c)",
             f"use a CP degree with seq_len divisible by 2 x cp, or a sequence length divisible by {2 * s.cp}")
    if not isinstance(s.sequence_parallel, bool):
        fail(f"{sw}.sequence_parallel", f"is {s.sequence_parallel!r}", "write true or false")
    if s.sequence_parallel and s.tp < 2:
        fail(f"{sw}.sequence_parallel", "is true on a stage with TP 1 (sequence parallelism splits what TP "
             "replicates)", "give the stage TP > 1 or set it false")
    local = seq_len // s.cp
    if s.sequence_parallel and local % s.tp:
        fail(f"{sw}.sequence_parallel", f"is true, but the {local} tokens each CP rank holds do not split "
             f"evenly over TP {s.tp}",
             "use a sequence length (per CP rank) divisible by the TP degree, or set it false")


def stage_shape(s: Stage, *, first: bool, last: bool, cp0: int) -> tuple | None:
    """All of stage ``s`` that ``check_stage`` and ``check_seq_split`` read but its device ids (the plan's
    model, cluster and sequence length aside), so that stages of one shape pass them alike and a plan
    checks each shape once (its device ids always: ``check_stage_devices``); None where a field is not
    of its plain type (a str kind, int CP degrees, bool flags), whose checks then run as they are."""
    plain = (type(s.kind), type(s.cp), type(cp0), type(s.sequence_parallel), type(s.embedding), type(s.head))
    if plain != (str, int, int, bool, bool, bool):
        return None
    return (s.kind, len(s.devices), s.cp, s.sequence_parallel, s.embedding, s.head, first, last, cp0)


def check_stage(s: Stage, sw: str, *, model: ModelSpec, cluster: Cluster, first: bool, last: bool) -> None:
    if s.kind not in cluster.kinds:
        fail(f"{sw}.kind", f"is {s.kind!r}, not a kind of cluster {cluster.name!r}",
             f"use one of {', '.join(cluster.kind_names)}")
    if not s.devices:
        fail(f"{sw}.devices", "is empty", "give the stage at least one device")
    if isinstance(s.cp, int) and not isinstance(s.cp, bool) and s.cp > len(s.devices):  # else no TP group
        fail(f"{sw}.cp", f"is {s.cp}, more than the stage's {len(s.devices)} devices",
             "list tp x cp devices (CP-major: CP rank c's TP group first, then the next)")
    _DEVICES_PASSED.get((id(cluster), s.kind, s.devices, s.cp), lambda: _check_devices(s, sw, cluster=cluster),
                        pin=(cluster,))
    tp = s.tp
    if model.num_heads % tp or model.num_kv_heads % tp or model.ffn_hidden_size % tp:
        fail(f"{sw}.tp", f"is {tp}, which does not divide the model's heads ({model.num_heads}), KV heads "
             f"({model.num_kv_heads}) and FFN size ({model.ffn_hidden_size})", "use a TP degree that divides them")
    if s.embedding != first:
        fail(f"{sw}.embedding", f"is {s.embedding}", "put the embedding on the first stage of each pipeline only")
    if s.head != last:
        fail(f"{sw}.head", f"is {s.head}", "put the head on the last stage of each pipeline only")


# The stages whose devices passed _check_devices, by cluster (id, pinned), kind, devices and CP degree:
# the planner validates every layout it builds, and its layouts reuse the same TP groups.
_DEVICES_PASSED = Kept(100_000, shortcut=True)


def check_stage_devices(s: Stage, *, cluster: Cluster, where: str, index: int) -> None:
    """``check_stage``'s checks of the device ids of stage ``index`` of pipeline ``where`` (a stage
    whose kind is the cluster's and whose devices are not empty)."""
    _DEVICES_PASSED.get((id(cluster), s.kind, s.devices, s.cp),
                        lambda: _check_devices(s, f"{where}.stages[{index}]", cluster=cluster), pin=(cluster,))


def _check_devices(s: Stage, sw: str, *, cluster: Cluster) -> bool:
    """The stage's devices are the cluster's, of its kind, each TP group inside one node (True, else
    PlanError): all it reads of the stage are its kind, devices and CP degree."""
    for d in s.devices:
        if not 0 <= d < cluster.num_devices:
            fail(f"{sw}.devices", f"names device {d}, but the cluster has devices 0..{cluster.num_devices - 1}",
                 "use device ids of this cluster")
        if cluster.devices[d].kind != s.kind:
            fail(f"{sw}.devices", f"includes device {d} of kind {cluster.devices[d].kind!r}, not {s.kind!r}",
                 "use only devices of the stage's kind")
    for c in range(s.cp):
        if len({cluster.devices[d].node for d in s.tp_group(c)}) > 1:
            where = f" (CP rank {c}'s TP group {list(s.tp_group(c))})" if s.cp > 1 else ""
            fail(f"{sw}.devices", f"span several nodes{where}", "keep a tensor-parallel group inside one node"
                 + (" (devices are CP-major: CP rank c's TP group is devices[c*tp:(c+1)*tp])" if s.cp > 1 else ""))
    return True


def check_shard_weights(w: ShardWeights, *, world_size: int) -> None:
    where = "training.optimizer_shard_weights"
    if not 0 <= w.mem_headroom < 1:
        fail(f"{where}.mem_headroom", f"is {w.mem_headroom!r}", "give a fraction in [0, 1)")
    if len(w.by_rank) != world_size:
        fail(f"{where}.by_rank", f"lists {len(w.by_rank)} weights for {world_size} ranks",
             "re-create the plan with 'hethub plan' (or delete the field: 'hethub train' then recomputes it)")
    if not all(math.isfinite(x) and x >= 0 for x in w.by_rank):
        fail(f"{where}.by_rank", "holds a negative or non-finite weight", "give weights >= 0 (free bytes, or 1 each)")
