"""Data-parallel gradient synchronisation among whichever stages hold each parameter group.

Parameter groups are the embedding, each decoder layer l, and the head with the final norm. A
group's holders are the stages (one per pipeline) that contain it, so replicas that split layers
differently still sync layer by layer. With tied embeddings, a pipeline whose embedding and head
sit on different stages holds the shared matrix twice: both stages join the embedding group (as
Megatron's embedding group does), and the head group keeps only the final norm. Holders come from
the rank layout (:func:`hethub.layout.unit_holders`), the same the runtime syncs among.

Each group is one ring all-reduce (:func:`hethub.predict.comm.allreduce_time_s`; a local emulation
host prices it with its measured all-reduce instead, through the predictor's hook):

* participants: the number of holder stages;
* bytes per participant: the group's parameters on one device of a holder x grad bytes, taking
  the largest over holders (the smallest TP degree), because the biggest shard bounds the ring;
* link: :func:`hethub.predict.comm.rings_link`: the TP ranks of a holder all-reduce their shards at
  once, one ring per rank of the smallest TP degree (rank q of each holder, in pipeline order), so
  a ring that crosses kinds pays the cross-kind link and the rings' hops that leave a node share
  its NIC (a TP-8 stage syncing across nodes moves its whole gradient through one NIC).

Groups with the same holders are fused into one all-reduce of their summed bytes, as the runtime
flattens them into one buffer (so a plan of plain replicas syncs with a single collective).

Timing, as the runtime's step runs (runtime/trainer.py): after its last backward every rank joins
the world all-reduce of the loss, a barrier of the whole plan; then a fused group's all-reduce
starts once every holder is there and done with its previous syncs, each stage running its
all-reduces one after another in the runtime's order (parameters sorted by name,
:func:`hethub.layout.unit_param_prefix`: embedding, head, then "layers.0", "layers.1", "layers.10",
.., and a tied head's final norm last); then the world all-reduce of the gradient norm (clipping),
a second barrier; then each stage's optimizer update. The step ends when the last stage does.
(The per-step gather of metrics to the logging rank comes after the timed step and is not
modelled.)

With a sharded optimizer (``training.optimizer_sharding`` zero1, ``runtime/zero.py``) a fused group
is a reduce-scatter of the gradients to their owners and, after the update, an all-gather of the
updated parameters. Inside one vendor island each is a ring pass of the largest owner's slice (the
runtime pads uneven slices): (p-1) x (latency + largest slice / bandwidth) each, an all-reduce's
volume when slices are equal and more when they are not. Where the holders' kinds sit in several
islands (``comm/bridge.py``), both run the bridge's two-level exchange (``hethub.islands``, the one
home of that schedule and of its critical path): each island's native ring pass of its padded
blocks over the island's slowest link, then each owner's real (unpadded) slice over the slowest
bridge pair used, a member's messages one after another. The gradients pass in the timing model's
gradient bytes (``ModelSpec.state_bytes_per_param``, as the all-reduce), the parameters in their
storage dtype (bf16 or fp16 when every holder trains in that precision, fp32 otherwise). The
all-gather is counted in the group's sync slot (it runs after the update in the runtime; the
update's own waiting is not modelled), and slices are those of ``predict/sharding.py`` with the
holder stages as the members (mixed TP degrees costed as lined up, as for all-reduces).

Overlap (:func:`exposed_sync_groups`): the runtime reduces gradients in buckets of ~40M elements
(``runtime/grad_buffer.py``), each started as soon as its parameters' gradients are final in the
last micro-batch's backward, in reverse layer order, one after another per rank. Only what is left
after the backward counts: a group's buckets become ready through its holders' last backward (the
backward taken as proportional to the parameters it has passed, units in reverse forward order), run
back to back on each holder from then, and the group is priced by the part of its buckets' time
after the backward's end (every holder's end taken as the same instant, as the loss barrier makes
it). Each bucket is its own all-reduce (its latency counts). ZeRO-1 groups are priced whole: their
all-gather follows the update.

Approximations: mismatched TP shard layouts among holders are costed as if they lined up; a NIC is
shared only among one group's rings, not with another stage's sync that happens to run on the same
node at the same time; the overlap above is an estimate (a backward is not uniform over its
parameters, and the collective shares the device with it).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

from hethub.islands import Exchange, exchange, island_of_kind, padded_numel, segment_bytes
from hethub.layout import (
    DEFAULT_BUCKET_ELEMS,
    gathers_params,
    split_elems,
    stage_places,
    stage_units,
    unit_holders,
    unit_param_prefix,
    unit_position,
)
from hethub.memo import Kept, reference
from hethub.plan import Plan
from hethub.predict.comm import (
    allreduce_time_s,
    p2p_time_s,
    ring_pass_time_s,
    rings_link,
    slowest_link,
    small_allreduce_time_s,
)
from hethub.predict.sharding import unit_elems
from hethub.runtimes import runtime_profile
from hethub.spec.cluster import Cluster, Link
from hethub.spec.model import ModelSpec

StageId = tuple[int, int]  # (pipeline index, stage index)

# The gradient rings' bottleneck link by cluster (id, pinned) and rings: plans the planner compares
# share most of their holders' devices (the local search's moves keep them all).
_RINGS = Kept(100_000)
# An unsharded plan's sync groups by what they depend on: the model and cluster (ids, pinned), the
# precision and every stage's devices and units. The planner prices a layout's sync in its step floor
# (predictor.sync_tail_s) and then again in the prediction that follows.
_GROUPS = Kept(256)
# world_collectives by cluster (id, pinned), pipeline lengths and each stage's first device.
_WORLD = Kept(1024)


@dataclass(frozen=True)
class SyncGroup:
    name: str  # "embedding", "layer 12", "head"
    holders: tuple[StageId, ...]
    nbytes: float  # per participant
    link: Link
    time_s: float
    members: int = 0  # ranks per reduction line where holders have several CP ranks (0: one per holder)
    # ZeRO-2/3 (exposed_sync_groups): one micro-batch's reduction onto the owners, and under ZeRO-3 a
    # step's per-use gathers of the group's parameters with the units they are cut into.
    round_s: float = 0.0
    gather_s: float = 0.0
    gather_units: int = 0

    @property
    def participants(self) -> int:
        return self.members or len(self.holders)


@dataclass(frozen=True)
class SyncResult:
    step_time_s: float
    stage_end_s: dict[StageId, float]  # sync end + optimizer update
    sync_s: dict[StageId, float]  # summed all-reduce durations of the stage's groups (no waiting; no world ones)
    # (group name, start, end) per stage, in execution order; only when recorded.
    intervals: dict[StageId, list[tuple[str, float, float]]]


def sync_groups(plan: Plan, *, shard_weights: dict[int, float] | None = None) -> list[SyncGroup]:
    """The plan's all-reduces: parameter groups fused by holders, in the runtime's order, with their cost.
    ``shard_weights`` (per rank, ``predict/sharding.py``): a sharded optimizer's split; each group is then
    priced as reduce-scatter + all-gather (see the module doc)."""
    key = (id(plan.model), id(plan.cluster), plan.precision,
           tuple(tuple((s.devices, s.layers, s.chunks, s.embedding, s.head, s.cp) for s in p.stages)
                 for p in plan.pipelines))
    fused = _GROUPS.get(key, lambda: tuple(_fused_groups(plan)), pin=(plan.model, plan.cluster))
    if not plan.sharded_optimizer:
        return list(fused)
    # The split depends on the ranks' weights: each fused group priced as its reduce-scatter + all-gather.
    grad_bytes = ModelSpec.state_bytes_per_param(plan.precision)["grads"]
    weights = shard_weights if shard_weights is not None else dict.fromkeys(range(plan.world_size), 1.0)
    weight = {(pi, si): weights[plan.rank_of(s.devices[0])] for pi, p in enumerate(plan.pipelines)
              for si, s in enumerate(p.stages)}
    return [_sharded_group(g, plan=plan, weight=weight, grad_bytes=grad_bytes) for g in fused]


def _fused_groups(plan: Plan) -> list[SyncGroup]:
    """Every parameter group's all-reduce, groups with the same holders fused (``_buckets``): the
    unsharded sync, which a sharded one prices again by its split. Depends on what ``sync_groups``
    keeps it by."""
    model, cluster = plan.model, plan.cluster
    grad_bytes = ModelSpec.state_bytes_per_param(plan.precision)["grads"]
    holders = {u: [(st.pipeline, st.stage) for st in hs] for u, hs in unit_holders(plan, stage_places(plan)).items()}

    tp_of = {(pi, si): s.tp for pi, p in enumerate(plan.pipelines) for si, s in enumerate(p.stages)}
    stage_of = {(pi, si): s for pi, p in enumerate(plan.pipelines) for si, s in enumerate(p.stages)}
    norm_layer = model.layer_params - model.layer_matmul_params
    links: dict[tuple[StageId, ...], Link] = {}
    # A group's price by its holders and bytes (all it depends on): the layers between two stage
    # boundaries of every pipeline share both, so it is found once per such run, not per layer (a
    # shortcut: memo.py).
    priced: dict[tuple, SyncGroup] = {}
    fresh = reference()

    def group(name: str, stages: Sequence[StageId], params_at_tp: dict[int, float]) -> SyncGroup:
        hs = tuple(stages)
        nbytes = max(params_at_tp[tp_of[x]] for x in hs) * grad_bytes
        got = None if fresh else priced.get((hs, nbytes))
        if got is not None:
            return replace(got, name=name)
        link = links.get(hs)
        if link is None:  # one ring per TP rank of the smallest degree, all at once (lined up)
            # Every CP rank of a holder is in the ring (layout.Topology.sync_group).
            rings = tuple(tuple(d for x in hs for d in stage_of[x].cp_group(q))
                          for q in range(min(tp_of[x] for x in hs)))
            link = links[hs] = _RINGS.get((id(cluster), rings), lambda: rings_link(cluster, rings), pin=(cluster,))
        members = sum(stage_of[x].cp for x in hs)
        got = priced[(hs, nbytes)] = SyncGroup(
            name, hs, nbytes, link, group_allreduce_s(plan, hs, nbytes=nbytes, link=link, participants=members,
                                                      elem_bytes=grad_bytes),
            members=members if members != len(hs) else 0)
        return got

    tps = set(tp_of.values())
    # Tied holders on the head side hold the vocab matrix without position embeddings: costing all
    # holders at the embedding stage's count keeps the max-over-holders rule simple and safe.
    groups = [group("embedding", holders["embed"], {t: model.embedding_elems(model.vocab_tp(t)) for t in tps})]
    layer_params = {t: model.layer_matmul_params / t + norm_layer for t in tps}
    groups.extend(group(f"layer {layer}", holders[f"layer.{layer}"], layer_params) for layer in range(model.num_layers))
    # A tied head's matrix is synced with the embedding; only the final norm is left here.
    head_matrix = 0 if model.tied_embeddings else model.head_params
    head_params = {t: head_matrix / model.vocab_tp(t) + model.final_norm_params for t in tps}
    groups.append(group("head", holders["final_norm"], head_params))
    # Where the runtime meets each group's parameters: its units' name prefixes, the first of them.
    head_units = ("final_norm",) if model.tied_embeddings else ("head", "final_norm")
    units = [("embed",), *((f"layer.{layer}",) for layer in range(model.num_layers)), head_units]
    first_names = {g.name: min(unit_param_prefix(u) for u in us) for g, us in zip(groups, units, strict=True)}
    return _buckets(groups, first_names=first_names)


def island_labels(plan: Plan, stages: Sequence[StageId]) -> dict[StageId, str]:
    """Each holder stage's vendor island (``hethub.islands.island_of_kind``, as the bridge forms them
    unforced)."""
    kinds = {x: plan.pipelines[x[0]].stages[x[1]].kind for x in stages}
    labels = kind_island_labels(plan.cluster, set(kinds.values()))
    return {x: labels[k] for x, k in kinds.items()}


def holder_exchange(plan: Plan, holders: Sequence[StageId]) -> Exchange:
    """The hierarchical schedule among a group's holders, members (indices into ``holders``) in the
    runtime's chunk order: ascending rank of each holder's first device."""
    first = [plan.rank_of(plan.pipelines[pi].stages[si].devices[0]) for pi, si in holders]
    labels = island_labels(plan, holders)
    order = sorted(range(len(holders)), key=lambda i: first[i])
    return exchange(order, {i: labels[holders[i]] for i in order})


def gather_bytes_per_param(plan: Plan, holders: Sequence[StageId]) -> int:
    """Bytes per element of a ZeRO-1 group's all-gather of updated parameters (``runtime/zero.py``): the
    holders' parameter storage when all train in the same precision (2 in bf16/fp16-mixed, whose
    parameters are stored in the compute dtype), else fp32."""
    precisions = {plan.precision_of(plan.pipelines[pi].stages[si].kind) for pi, si in holders}
    return ModelSpec.state_bytes_per_param(precisions.pop())["weights"] if len(precisions) == 1 else 4


def _sharded_group(g: SyncGroup, *, plan: Plan, weight: dict[StageId, float], grad_bytes: float) -> SyncGroup:
    """A fused group under ZeRO-1: reduce-scatter + all-gather of padded slices (module doc)."""
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
        rs, ag = (_hierarchical_pass_s(plan, g.holders, ex, slices=slices, elem_bytes=b)
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


def group_allreduce_s(plan: Plan, holders: Sequence[StageId], *, nbytes: float, link: Link, participants: int,
                      elem_bytes: float) -> float:
    """A sync group's all-reduce: a ring over ``link`` inside one vendor island; across islands the
    bridge's two-level all-reduce (:func:`two_level_allreduce_time_s`) over each island's slowest
    ring link and the slowest cross-island pair of the holders' first devices. Holders with CP ranks
    (``participants`` above the holder count) are priced as the ring."""
    if participants != len(holders):
        return islands_allreduce_s(nbytes=nbytes, elem_bytes=elem_bytes, participants=participants, link=link)
    ex = holder_exchange(plan, holders)
    if len(ex.islands) == 1:
        return islands_allreduce_s(nbytes=nbytes, elem_bytes=elem_bytes, participants=participants, link=link)
    first = [plan.pipelines[pi].stages[si].devices[0] for pi, si in holders]
    islands = [(len(isl), slowest_link(plan.cluster, [first[m] for m in isl])) for isl in ex.islands]
    pairs = [plan.cluster.link(first[a], first[b]) for i, isl in enumerate(ex.islands) for a in isl
             for other in ex.islands[i + 1:] for b in other]
    bridge = Link(min(lk.bw_bytes_per_s for lk in pairs), max(lk.latency_s for lk in pairs))
    return islands_allreduce_s(nbytes=nbytes, elem_bytes=elem_bytes, participants=participants, link=link,
                               islands=islands, bridge=bridge)


def islands_allreduce_s(*, nbytes: float, elem_bytes: float, participants: int, link: Link,
                        islands: Sequence[tuple[int, Link]] = (), bridge: Link | None = None) -> float:
    """The gradient sync's all-reduce rule, shared by the predictor (:func:`group_allreduce_s`, on a
    plan's devices) and the planner's closed form (search/combine.py, on representative links): the
    ring over ``link`` among ``participants`` inside one vendor island; across several (``islands``:
    each island's holder count and slowest ring link, ``bridge`` the slowest cross-island pair) the
    bridge's two-level all-reduce (:func:`two_level_allreduce_time_s`)."""
    if len(islands) <= 1 or bridge is None:
        return allreduce_time_s(nbytes=nbytes, participants=participants, link=link)
    return two_level_allreduce_time_s(elems=max(1, round(nbytes / elem_bytes)), elem_bytes=elem_bytes,
                                      island_links=[lk for _, lk in islands],
                                      island_sizes=[n for n, _ in islands], bridge=bridge)


def kind_island_labels(cluster: Cluster, kinds: Iterable[str]) -> dict[str, str]:
    """Each kind's vendor island (``hethub.islands.island_of_kind``, as the bridge forms them unforced)."""
    out = {}
    for kind in kinds:
        k = cluster.kinds[kind]
        out[kind] = island_of_kind(kind, backend=k.backend, vendor=k.vendor, force_bridge=False)
    return out


def two_level_allreduce_time_s(*, elems: int, elem_bytes: float, island_links: Sequence[Link],
                               island_sizes: Sequence[int], bridge: Link) -> float:
    """The bridge's all-reduce across islands as ``comm/hierarchical.py`` runs it (``hethub.islands``:
    shard_segments): each island's ring reduce-scatter of the padded buffer over its own link, every
    member's segments all-reduced among one owner per island over the bridge (a member's one after
    another, members in parallel), then each island's ring all-gather."""
    padded = padded_numel(elems, island_sizes)
    island_s = max(ring_pass_time_s(chunk_bytes=padded // k * elem_bytes, participants=k, link=lk)
                   for k, lk in zip(island_sizes, island_links, strict=True))
    per_member = segment_bytes(elems, island_sizes, elem_bytes=elem_bytes)
    bridge_s = max(sum(allreduce_time_s(nbytes=b, participants=len(island_sizes), link=bridge) for b in segs)
                   for isl in per_member for segs in isl)
    return 2 * island_s + bridge_s


def _hierarchical_pass_s(plan: Plan, holders: Sequence[StageId], ex: Exchange, *, slices: Sequence[int],
                         elem_bytes: float) -> float:
    """One pass of the bridged two-level exchange (``hethub.islands``): each island's ring pass of
    its padded blocks over its own slowest link, and each owner's real slice over the slowest bridge
    pair used."""
    first = [plan.pipelines[pi].stages[si].devices[0] for pi, si in holders]
    pad_bytes = max(slices) * elem_bytes
    island_s = [ring_pass_time_s(chunk_bytes=ex.slots[isl[0]] * pad_bytes, participants=len(isl),
                                 link=slowest_link(plan.cluster, [first[m] for m in isl])) for isl in ex.islands]
    pairs = [plan.cluster.link(first[m], first[o]) for m in ex.members for o in ex.blocks[m][1:]]
    bridge = Link(min(lk.bw_bytes_per_s for lk in pairs), max(lk.latency_s for lk in pairs),
                  min(pairs, key=lambda lk: lk.bw_bytes_per_s).fabric)
    return ex.pass_time_s(island_s=island_s,
                          message_s={m: p2p_time_s(bridge, slices[m] * elem_bytes) for m in ex.members})


def _buckets(groups: list[SyncGroup], *, first_names: dict[str, str]) -> list[SyncGroup]:
    """Groups with the same holders fused into one all-reduce, in the runtime's order.

    The runtime's GradSync flattens every parameter with the same holders into one buffer and
    all-reduces each buffer once, walking parameters sorted by name; one collective instead of one
    per layer saves a latency per layer (and on a CPU host most of the cost is per collective).
    """
    by_holders: dict[tuple[StageId, ...], list[SyncGroup]] = {}
    for g in groups:  # members stay in layer order
        by_holders.setdefault(g.holders, []).append(g)
    out = []
    # A bucket's collective comes where the runtime meets its first parameter name.
    for gs in sorted(by_holders.values(), key=lambda gs: min(first_names[g.name] for g in gs)):
        if len(gs) == 1:
            out.append(gs[0])
            continue
        hs, nbytes = gs[0].holders, sum(g.nbytes for g in gs)
        out.append(SyncGroup(", ".join(g.name for g in gs), hs, nbytes, gs[0].link,
                             allreduce_time_s(nbytes=nbytes, participants=gs[0].participants, link=gs[0].link),
                             members=gs[0].members))
    return out


def exposed_sync_groups(plan: Plan, groups: Sequence[SyncGroup], *, backward_s: Mapping[StageId, float],
                        bucket_elems: int = DEFAULT_BUCKET_ELEMS) -> list[SyncGroup]:
    """``groups`` (:func:`sync_groups`, unsharded) with each one's time cut to the part of its bucketed
    reduction left after its holders' last backward (module doc: Overlap). ``backward_s``: each
    stage's backward of one micro-batch (its last one overlaps the buckets). A runtime that reduces
    after the schedule (hethub.runtimes: dp_overlap False, DeepSpeed's pipeline engine) overlaps
    nothing: ``groups`` as they are."""
    model = plan.model
    if plan.zero_stage >= 2:
        return _exposed_rounds(plan, groups, backward_s=backward_s)
    if plan.sharded_optimizer or not runtime_profile(plan.runtime).dp_overlap:
        return list(groups)
    grad_bytes = ModelSpec.state_bytes_per_param(plan.precision)["grads"]
    places = {(st.pipeline, st.stage): st for st in stage_places(plan)}
    units_of: dict[tuple[StageId, ...], list[str]] = {}
    for u, hs in unit_holders(plan, tuple(places.values())).items():
        units_of.setdefault(tuple((st.pipeline, st.stage) for st in hs), []).append(u)
    spans: dict[StageId, dict[str, tuple[float, float]]] = {}

    def span(x: StageId) -> dict[str, tuple[float, float]]:
        """Each unit of stage x: the fractions of its backward done when the unit starts and ends."""
        if x not in spans:
            st = places[x]
            us = sorted(stage_units(st, tied=model.tied_embeddings, learned_pos=model.arch == "gpt"),
                        key=lambda u: -unit_position(u, num_layers=model.num_layers))
            sizes = [unit_elems(model, u, tp=st.tp) for u in us]
            total, acc, out = float(sum(sizes)) or 1.0, 0.0, {}
            for u, n in zip(us, sizes, strict=True):
                out[u] = (acc / total, (acc + n) / total)
                acc += n
            spans[x] = out
        return spans[x]

    buckets = []  # (order key, group, holders, ready time per holder relative to the backward's end, duration)
    for gi, g in enumerate(groups):
        us = units_of.get(g.holders)
        if g.time_s <= 0 or g.participants <= 1 or not us:
            continue
        n, d = _buckets_of(plan, g, grad_bytes=grad_bytes, bucket_elems=bucket_elems)
        first = -max(unit_position(u, num_layers=model.num_layers) for u in us)
        ends = {x: (min(sp[u][0] for u in us), max(sp[u][1] for u in us)) for x in g.holders for sp in (span(x),)}
        for k in range(n):
            ready = {x: -backward_s[x] * (1.0 - (a + (c - a) * (k + 1) / n)) for x, (a, c) in ends.items()}
            buckets.append(((first, g.name, k), gi, g.holders, ready, d))
    buckets.sort(key=lambda b: b[0])
    cursor: dict[StageId, float] = {}
    exposed = dict.fromkeys({b[1] for b in buckets}, 0.0)
    for _, gi, hs, ready, d in buckets:
        start = max(max(ready[x], cursor.get(x, -math.inf)) for x in hs)
        for x in hs:
            cursor[x] = start + d
        exposed[gi] += max(0.0, start + d) - max(0.0, start)
    return [replace(g, time_s=exposed[gi]) if gi in exposed else g for gi, g in enumerate(groups)]


def _exposed_rounds(plan: Plan, groups: Sequence[SyncGroup], *, backward_s: Mapping[StageId, float],
                    ) -> list[SyncGroup]:
    """ZeRO-2/3 groups (an estimate): each micro-batch's reduction runs beside the next micro-batch's
    work, so the earlier rounds show only where one outlasts a backward of the slowest-to-hide holder
    (the shortest backward); the last round is priced whole, after the backward. ZeRO-3's per-use
    gathers are prefetched one unit ahead: per op the first unit's gather shows, and the rest only
    where the step's gathers outlast the compute they hide behind (a forward taken as half a
    backward)."""
    out = []
    for g in groups:
        if g.participants <= 1 or g.round_s <= 0:
            out.append(g)
            continue
        m = plan.pipelines[g.holders[0][0]].num_micro_batches
        bwd = min(backward_s[x] for x in g.holders)
        extra = (m - 1) * max(0.0, g.round_s - bwd)
        if g.gather_s > 0:
            first = g.gather_s / max(1, g.gather_units)  # one unit's gather per op, 2m ops
            extra += first + max(0.0, g.gather_s - first - m * 1.5 * bwd)
        out.append(replace(g, time_s=g.time_s + extra))
    return out


def bucket_count(nbytes: float, *, elem_bytes: float, bucket_elems: int = DEFAULT_BUCKET_ELEMS) -> int:
    """How many buckets a runtime that overlaps its reduction (runtimes: dp_overlap) reduces ``nbytes``
    of gradients in (runtime/grad_buffer.py), each its own all-reduce."""
    return max(1, math.ceil(nbytes / elem_bytes / bucket_elems))


def _buckets_of(plan: Plan, g: SyncGroup, *, grad_bytes: float, bucket_elems: int) -> tuple[int, float]:
    """How many buckets the runtime reduces group ``g`` in, and each one's all-reduce time (across
    vendor islands the bridge's two-level all-reduce, :func:`group_allreduce_s`)."""
    n = bucket_count(g.nbytes, elem_bytes=grad_bytes, bucket_elems=bucket_elems)
    return n, group_allreduce_s(plan, g.holders, nbytes=g.nbytes / n, link=g.link, participants=g.participants,
                                elem_bytes=grad_bytes)


def unoverlapped_sync_s(plan: Plan, groups: Sequence[SyncGroup], *,
                        bucket_elems: int = DEFAULT_BUCKET_ELEMS) -> dict[StageId, float]:
    """Each holder stage's gradient-sync time as its runtime reduces it, before any overlap: in
    buckets where :func:`exposed_sync_groups` overlaps them (each bucket its own all-reduce, at its own
    size's achievable bandwidth), else the groups as they are."""
    bucketed = not plan.sharded_optimizer and runtime_profile(plan.runtime).dp_overlap
    grad_bytes = ModelSpec.state_bytes_per_param(plan.precision)["grads"]
    out: dict[StageId, float] = {}
    for g in groups:
        if g.participants <= 1 or g.time_s <= 0:
            continue
        n, d = _buckets_of(plan, g, grad_bytes=grad_bytes, bucket_elems=bucket_elems) if bucketed else (1, g.time_s)
        for x in g.holders:
            out[x] = out.get(x, 0.0) + n * d
    return out


def world_collectives(plan: Plan) -> tuple[SyncGroup, SyncGroup]:
    """The runtime's two world all-reduces of every step, each a barrier of every stage: the loss
    (8 bytes, after a rank's last backward, before the gradient sync) and the gradient norm (before
    the optimizer update). Among the first device of every stage (TP ranks of a stage take part at
    once, as in the gradient sync), over the slowest link of them, the faster of ring and tree
    (:func:`hethub.predict.comm.small_allreduce_time_s`): for 8 bytes, latencies."""
    sizes = tuple(len(p.stages) for p in plan.pipelines)
    firsts = tuple(s.devices[0] for p in plan.pipelines for s in p.stages)
    return _WORLD.get((id(plan.cluster), sizes, firsts), lambda: _world_collectives(plan.cluster, sizes, firsts),
                      pin=(plan.cluster,))


def _world_collectives(cluster: Cluster, sizes: tuple[int, ...],
                       firsts: tuple[int, ...]) -> tuple[SyncGroup, SyncGroup]:
    stages = tuple((pi, si) for pi, n in enumerate(sizes) for si in range(n))
    link = slowest_link(cluster, firsts)
    t = small_allreduce_time_s(nbytes=8.0, participants=len(firsts), link=link)
    return SyncGroup("loss", stages, 8.0, link, t), SyncGroup("grad norm", stages, 8.0, link, t)


def simulate_sync(
    plan: Plan, *, finish_s: Sequence[Sequence[float]], update_s: Sequence[Sequence[float]], record: bool = False,
    groups: Sequence[SyncGroup] | None = None, world: Sequence[SyncGroup] | None = None,
) -> SyncResult:
    """The step after each stage's last backward (`finish_s[p][s]`): the loss all-reduce (a world
    barrier), every group's all-reduce once its holders are there, the gradient-norm all-reduce (a
    world barrier), then each stage's optimizer update. `world`: (loss, grad norm), default
    :func:`world_collectives`."""
    groups = sync_groups(plan) if groups is None else groups
    loss, norm = world_collectives(plan) if world is None else world
    cursor: dict[StageId, float] = {
        (pi, si): float(f) for pi, row in enumerate(finish_s) for si, f in enumerate(row)
    }
    sync_s = dict.fromkeys(cursor, 0.0)
    intervals: dict[StageId, list[tuple[str, float, float]]] = {k: [] for k in cursor} if record else {}

    def barrier(g: SyncGroup) -> None:
        start = max(cursor.values())
        for x in cursor:
            cursor[x] = start + g.time_s
            if record and g.time_s > 0:
                intervals[x].append((g.name, start, start + g.time_s))

    barrier(loss)
    for g in groups:
        if g.time_s <= 0.0:
            continue  # one holder only: nothing to wait for or send
        hs = g.holders
        start = max(cursor[x] for x in hs)
        end = start + g.time_s
        for x in hs:
            cursor[x] = end
            sync_s[x] += g.time_s
        if record:
            for x in hs:
                intervals[x].append((g.name, start, end))
    barrier(norm)
    stage_end = {(pi, si): cursor[(pi, si)] + u for pi, row in enumerate(update_s) for si, u in enumerate(row)}
    return SyncResult(step_time_s=max(stage_end.values()), stage_end_s=stage_end, sync_s=sync_s,
                      intervals=intervals)
