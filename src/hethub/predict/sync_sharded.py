"""The gradient sync under a sharded optimizer (ZeRO-1/2/3, ``training.optimizer_sharding``,
``runtime/zero.py``): each fused group a reduce-scatter of the gradients to their owners and an
all-gather of the updated parameters.

Inside one vendor island each is a ring pass of the largest owner's slice (the runtime pads uneven
slices): (p-1) x (latency + largest slice / bandwidth) each, an all-reduce's volume when slices are
equal and more when they are not. Where the holders' kinds sit in several islands (``comm/bridge.py``),
both run the bridge's two-level exchange (``hethub.islands``): each island's native ring pass of its
padded blocks over the island's slowest link, then each owner's real (unpadded) slice over the
slowest bridge pair used, a member's messages one after another. The gradients pass in the timing
model's gradient bytes (``ModelSpec.state_bytes_per_param``, as the all-reduce), the parameters in
their storage dtype (bf16 or fp16 when every holder trains in that precision, fp32 otherwise). The
all-gather is counted in the group's sync slot (it runs after the update in the runtime; the update's
own waiting is not modelled), and slices are those of ``predict/sharding.py`` with the holder stages as
the members (mixed TP degrees costed as lined up, as for all-reduces). ZeRO-2/3 keep one micro-batch's
reduction (``round_s``) and ZeRO-3 its per-use gathers on the group, for
:mod:`hethub.predict.sync_overlap`.
"""

from __future__ import annotations

from collections.abc import Sequence

from hethub.islands import Exchange
from hethub.layout import gathers_params, split_elems
from hethub.plan import Plan
from hethub.predict.comm import p2p_time_s, ring_pass_time_s, slowest_link
from hethub.predict.sync_records import StageId, SyncGroup
from hethub.predict.sync_rules import holder_exchange
from hethub.spec.cluster import Link
from hethub.spec.model import ModelSpec


def gather_bytes_per_param(plan: Plan, holders: Sequence[StageId]) -> int:
    """Bytes per element of a ZeRO-1 group's all-gather of updated parameters (``runtime/zero.py``): the
    holders' parameter storage when all train in the same precision (2 in bf16/fp16-mixed, whose
    parameters are stored in the compute dtype), else fp32."""
    precisions = {plan.precision_of(plan.pipelines[pi].stages[si].kind) for pi, si in holders}
    return ModelSpec.state_bytes_per_param(precisions.pop())["weights"] if len(precisions) == 1 else 4


def sharded_group(g: SyncGroup, *, plan: Plan, weight: dict[StageId, float], grad_bytes: float,
                  floor: bool = False) -> SyncGroup:
    """A fused group under ZeRO-1: reduce-scatter + all-gather of padded slices (module doc); ZeRO-2/3 keep
    a micro-batch's reduction and ZeRO-3 its per-use gathers beside it. ``floor`` (with equal ``weight``):
    times no split of the group exceeds below, for a step floor that knows no split (`_hierarchical_pass_s`)."""
    p = g.participants
    if p <= 1:
        return g
    elems = round(g.nbytes / grad_bytes)
    # With CP ranks among the members, their slices are taken as equal (an estimate; the runtime
    # splits by each rank's weight).
    slices = (split_elems(elems, [weight[x] for x in g.holders]) if not g.members
              else split_elems(elems, [1.0] * g.members))
    chunk_elems = max(slices)
    param_bytes = gather_bytes_per_param(plan, g.holders)
    ex = holder_exchange(plan, g.holders)
    if len(ex.islands) == 1:
        rs, ag = (ring_pass_time_s(chunk_bytes=chunk_elems * b, participants=p, link=g.link)
                  for b in (grad_bytes, param_bytes))
    else:
        rs, ag = (_hierarchical_pass_s(plan, g.holders, ex, slices=slices, elem_bytes=b, floor=floor)
                  for b in (grad_bytes, param_bytes))
    # nbytes: the volume of an all-reduce of equal cost (what a measured host all-reduce is priced on).
    nbytes = chunk_elems * (grad_bytes + param_bytes) / 2 * p
    if plan.zero_stage < 2:
        return SyncGroup(g.name, g.holders, nbytes, g.link, rs + ag)
    # ZeRO-2/3: the last micro-batch's reduction here, the earlier ones in exposed_sync_groups; ZeRO-3
    # gathers a group's parameters before each use (a forward and a backward per micro-batch) instead
    # of after the update, each gather one pass of the group's bytes (one broadcast per owner moves
    # what a ring all-gather moves).
    gathered = plan.zero_stage == 3 and gathers_params(
        [(si, len(plan.pipelines[pi].stages)) for pi, si in g.holders])
    m = plan.pipelines[g.holders[0][0]].num_micro_batches
    return SyncGroup(g.name, g.holders, nbytes, g.link, rs + (0.0 if gathered else ag), round_s=rs,
                     gather_s=2 * m * ag if gathered else 0.0, gather_units=len(g.name.split(", ")))


def _hierarchical_pass_s(plan: Plan, holders: Sequence[StageId], ex: Exchange, *, slices: Sequence[int],
                         elem_bytes: float, floor: bool = False) -> float:
    """One pass of the bridged two-level exchange (``hethub.islands``): each island's ring pass of
    its padded blocks over its own slowest link, and each owner's real slice over the slowest bridge
    pair used. ``floor`` (``slices`` equal): only the terms of ``Exchange.pass_time_s`` that read the
    largest slice alone, which no split has smaller than the equal one's, and each term grows with it
    (every fabric's curve has a shape below 1, fabrics.py); the terms summing several owners' slices
    could shrink with an unequal split."""
    first = [plan.pipelines[pi].stages[si].devices[0] for pi, si in holders]
    pad_bytes = max(slices) * elem_bytes
    island_s = [ring_pass_time_s(chunk_bytes=ex.slots[isl[0]] * pad_bytes, participants=len(isl),
                                 link=slowest_link(plan.cluster, [first[m] for m in isl])) for isl in ex.islands]
    pairs = [plan.cluster.link(first[m], first[o]) for m in ex.members for o in ex.blocks[m][1:]]
    bridge = Link(min(lk.bw_bytes_per_s for lk in pairs), max(lk.latency_s for lk in pairs),
                  min(pairs, key=lambda lk: lk.bw_bytes_per_s).fabric)
    message_s = {m: p2p_time_s(bridge, slices[m] * elem_bytes) for m in ex.members}
    if floor:
        return max(max(island_s), max(message_s.values()) * (len(ex.islands) - 1))
    return ex.pass_time_s(island_s=island_s, message_s=message_s)
