"""Data-parallel gradient synchronisation among whichever stages hold each parameter group: the groups
and the step's sync after the schedule.

Parameter groups are the embedding, each decoder layer l, and the head with the final norm. A
group's holders are the stages (one per pipeline) that contain it, so replicas that split layers
differently still sync layer by layer. With tied embeddings, a pipeline whose embedding and head
sit on different stages holds the shared matrix twice: both stages join the embedding group (as
Megatron's embedding group does), and the head group keeps only the final norm. Holders come from
the rank layout (:func:`hethub.layout.unit_holders`), the same the runtime syncs among.

Each group is one all-reduce (:mod:`hethub.predict.sync_rules`: a ring inside one vendor island, the
bridge's two-level all-reduce across islands; a local emulation host prices it with its measured
all-reduce instead, through the predictor's hook):

* participants: the number of holder stages;
* bytes per participant: the group's parameters on one device of a holder x grad bytes, taking
  the largest over holders (the smallest TP degree), because the biggest shard bounds the ring;
* link: :func:`hethub.predict.comm.rings_link`: the TP ranks of a holder all-reduce their shards at
  once, one ring per rank of the smallest TP degree (rank q of each holder, in pipeline order), so
  a ring that crosses kinds pays the cross-kind link and the rings' hops that leave a node share
  its NIC (a TP-8 stage syncing across nodes moves its whole gradient through one NIC).

Groups with the same holders are fused into one all-reduce of their summed bytes, as the runtime
flattens them into one buffer (so a plan of plain replicas syncs with a single collective). A sharded
optimizer prices each fused group as a reduce-scatter and an all-gather instead
(:mod:`hethub.predict.sync_sharded`); what the last backward hides of the sync is
:mod:`hethub.predict.sync_overlap`'s.

Timing, as the runtime's step runs (runtime/trainer.py): after its last backward every rank joins
the world all-reduce of the loss, a barrier of the whole plan; then a fused group's all-reduce
starts once every holder is there and done with its previous syncs, each stage running its
all-reduces one after another in the runtime's order (parameters sorted by name,
:func:`hethub.layout.unit_param_prefix`: embedding, head, then "layers.0", "layers.1", "layers.10",
.., and a tied head's final norm last); then the world all-reduce of the gradient norm (clipping),
a second barrier; then each stage's optimizer update. The step ends when the last stage does.
(The per-step gather of metrics to the logging rank comes after the timed step and is not
modelled.)

Approximations: mismatched TP shard layouts among holders are costed as if they lined up; a NIC is
shared only among one group's rings, not with another stage's sync that happens to run on the same
node at the same time.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from hethub.layout import stage_places, unit_holders, unit_param_prefix
from hethub.memo import Kept, reference
from hethub.plan import Plan
from hethub.predict.comm import allreduce_time_s, rings_link, slowest_link, small_allreduce_time_s
from hethub.predict.sync_records import StageId, SyncGroup, SyncResult
from hethub.predict.sync_rules import group_allreduce_s
from hethub.predict.sync_sharded import sharded_group
from hethub.spec.cluster import Cluster, Link
from hethub.spec.model import ModelSpec

# The gradient rings' bottleneck link by cluster (id, pinned) and rings: plans the planner compares
# share most of their holders' devices (the local search's moves keep them all).
_RINGS = Kept(100_000)
# An unsharded plan's sync groups by what they depend on: the model and cluster (ids, pinned), the
# precision and every stage's devices and units. The planner prices a layout's sync in its step floor
# (predictor.sync_tail_s) and then again in the prediction that follows.
_GROUPS = Kept(256)
# world_collectives by cluster (id, pinned), pipeline lengths and each stage's first device.
_WORLD = Kept(1024)


def sync_groups(plan: Plan, *, shard_weights: dict[int, float] | None = None, floor: bool = False) -> list[SyncGroup]:
    """The plan's all-reduces: parameter groups fused by holders, in the runtime's order, with their cost.
    ``shard_weights`` (per rank, ``predict/sharding.py``): a sharded optimizer's split; each group is then
    priced as reduce-scatter + all-gather (:mod:`hethub.predict.sync_sharded`). ``floor``: a sharded
    optimizer's groups at times no split exceeds below (equal slices, ``sharded_group``'s floor)."""
    key = (id(plan.model), id(plan.cluster), plan.precision,
           tuple(tuple((s.devices, s.layers, s.chunks, s.embedding, s.head, s.cp) for s in p.stages)
                 for p in plan.pipelines))
    fused = _GROUPS.get(key, lambda: tuple(_fused_groups(plan)), pin=(plan.model, plan.cluster))
    if not plan.sharded_optimizer:
        return list(fused)
    # The split depends on the ranks' weights: each fused group priced as its reduce-scatter + all-gather.
    grad_bytes = ModelSpec.state_bytes_per_param(plan.precision)["grads"]
    weights = shard_weights if shard_weights is not None and not floor else dict.fromkeys(range(plan.world_size), 1.0)
    weight = {(pi, si): weights[plan.rank_of(s.devices[0])] for pi, p in enumerate(plan.pipelines)
              for si, s in enumerate(p.stages)}
    return [sharded_group(g, plan=plan, weight=weight, grad_bytes=grad_bytes, floor=floor) for g in fused]


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
    # A group's bytes by holders and part (every layer's sizes are the same), and whether no stage has CP
    # ranks (each TP rank's ring then its holders' devices at that rank): shortcuts too.
    largest: dict[tuple, float] = {}
    one_cp = not fresh and all(s.cp == 1 for s in stage_of.values())

    def group(name: str, stages: Sequence[StageId], params_at_tp: dict[int, float], *, part: str) -> SyncGroup:
        hs = tuple(stages)
        nbytes = None if fresh else largest.get((hs, part))
        if nbytes is None:
            nbytes = largest[(hs, part)] = max(params_at_tp[tp_of[x]] for x in hs) * grad_bytes
        got = None if fresh else priced.get((hs, nbytes))
        if got is not None:
            return replace(got, name=name)
        link = links.get(hs)
        if link is None:  # one ring per TP rank of the smallest degree, all at once (lined up)
            # Every CP rank of a holder is in the ring (layout.Topology.sync_group); without CP, TP rank q's
            # ring is each holder's q-th device.
            k = min(tp_of[x] for x in hs)
            rings = (tuple(zip(*(stage_of[x].devices[:k] for x in hs), strict=True)) if one_cp else
                     tuple(tuple(d for x in hs for d in stage_of[x].cp_group(q)) for q in range(k)))
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
    groups = [group("embedding", holders["embed"], {t: model.embedding_elems(model.vocab_tp(t)) for t in tps},
                    part="embedding")]
    layer_params = {t: model.layer_matmul_params / t + norm_layer for t in tps}
    groups.extend(group(f"layer {layer}", holders[f"layer.{layer}"], layer_params, part="layer")
                  for layer in range(model.num_layers))
    # A tied head's matrix is synced with the embedding; only the final norm is left here.
    head_matrix = 0 if model.tied_embeddings else model.head_params
    head_params = {t: head_matrix / model.vocab_tp(t) + model.final_norm_params for t in tps}
    groups.append(group("head", holders["final_norm"], head_params, part="head"))
    # Where the runtime meets each group's parameters: its units' name prefixes, the first of them.
    head_units = ("final_norm",) if model.tied_embeddings else ("head", "final_norm")
    units = [("embed",), *((f"layer.{layer}",) for layer in range(model.num_layers)), head_units]
    first_names = {g.name: min(unit_param_prefix(u) for u in us) for g, us in zip(groups, units, strict=True)}
    return _buckets(groups, first_names=first_names)


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
