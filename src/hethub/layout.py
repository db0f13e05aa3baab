"""Rank layout from a plan: who holds what, who talks to whom, which groups exist.

The one home of rank placement and parameter holders, for the runtime (process groups, p2p peers,
gradient sync, checkpoint resharding) and the predictor's sync model alike. Pure Python (no torch)
so it is unit-tested without processes. The runtime creates every group listed in
``Topology.groups`` on every rank, in that order (gloo's ``new_group`` is collective over the world;
creating groups lazily or per rank hangs), and passes the handles explicitly.

Parameters are grouped into *units* (``embed``, ``pos``, ``layer.<i>``, ``final_norm``, ``head``):
all parameters of a unit live on the same stages. A unit's *holders* are the stages, across all
pipelines, that hold it, in pipeline order (for a tied embedding: the embedding stages, then the
head stages holding the tied copy); its gradients are summed among exactly those stages' ranks.
Units whose parameters have the same holders are synced as one flat buffer, in the order of their
parameter names (``unit_param_prefix``), which the predictor's sync model follows too.
"""

from __future__ import annotations

from dataclasses import dataclass

from hethub.layout_parts import (
    WHOLE,
    Hop,
    StagePlace,
    block_starts,
    bwd_source,
    bwd_targets,
    fwd_source,
    fwd_targets,
    hop,
    split_hop,
    stage_hops,
    wrap_hops,
)
from hethub.layout_units import (
    DEFAULT_BUCKET_ELEMS,
    ZERO_IN_FLIGHT_ROUNDS,
    bucket_ranges,
    gathers_params,
    reduction_key,
    split_elems,
    stage_units,
    unit_of,
    unit_param_prefix,
    unit_position,
)
from hethub.memo import Kept, reference
from hethub.plan import Plan
from hethub.spec.cluster import Cluster

# Re-exported: the stage records and activation routing (layout_parts.py) and the parameter units
# (layout_units.py) are part of this module's interface, which the runtime and the predictor import.
__all__ = [
    "DEFAULT_BUCKET_ELEMS",
    "WHOLE",
    "ZERO_IN_FLIGHT_ROUNDS",
    "GradGroup",
    "Hop",
    "RankPlace",
    "StagePlace",
    "Topology",
    "block_starts",
    "bucket_ranges",
    "build_topology",
    "bwd_source",
    "bwd_targets",
    "fwd_source",
    "fwd_targets",
    "gathers_params",
    "hop",
    "kind_nodes",
    "reduction_key",
    "seq_positions",
    "single_holder_units",
    "split_elems",
    "split_hop",
    "stage_hops",
    "stage_places",
    "stage_units",
    "unit_holders",
    "unit_of",
    "unit_param_prefix",
    "unit_position",
    "wrap_hops",
]


@dataclass(frozen=True)
class RankPlace:
    """Everything one rank needs to know about its own position."""

    rank: int
    stage: StagePlace
    tp_rank: int
    micro_batch_size: int
    num_micro_batches: int
    sample_offset: int  # first sequence of this replica within the global batch
    fwd_recv_from: int | None  # rank sending this rank its input activation
    fwd_send_to: tuple[int, ...]  # ranks this rank sends its output activation to
    bwd_recv_from: int | None  # rank sending this rank the gradient of its output
    bwd_send_to: tuple[int, ...]  # ranks this rank sends its input gradient to
    # TP-split hops (split_hop): the activation from the previous stage / to the next stage travels as
    # the receiver's flat slice, all-gathered over the receiving TP group on arrival.
    split_in: bool = False
    split_out: bool = False
    # Virtual stages: the last stage's chunk c sends its output to the first stage's chunk c + 1
    # (and gets that chunk's input gradient back), routed between the two stages' TP degrees as
    # between adjacent stages. Set on the first and last stage of a pipeline with v > 1 chunks.
    wrap_recv_from: int | None = None  # first stage: rank sending chunk c > 0 its input
    wrap_send_to: tuple[int, ...] = ()  # last stage: ranks chunk c < v - 1 sends its output to
    wrap_grad_recv_from: int | None = None  # last stage: rank sending chunk c < v - 1 its output gradient
    wrap_grad_send_to: tuple[int, ...] = ()  # first stage: ranks chunk c > 0 sends its input gradient to
    cp_rank: int = 0  # this rank's CP rank: it holds sequence positions seq_positions(.., cp, cp_rank)
    # How each message this rank sends or receives travels (``hop``): the input from the previous
    # stage, the output to the next, the output's gradient from the next, the input's gradient to the
    # previous; and the wrap between the last and first stage (virtual stages), both directions.
    hop_in: Hop = WHOLE
    hop_out: Hop = WHOLE
    hop_grad_in: Hop = WHOLE
    hop_grad_out: Hop = WHOLE
    wrap_hop: Hop = WHOLE  # the last stage's output to the first (from either end)
    wrap_grad_hop: Hop = WHOLE  # its gradient back

    @property
    def tp_group(self) -> tuple[int, ...]:
        """This rank's TP group (its CP rank's), in TP rank order."""
        return self.stage.tp_group(self.cp_rank)

    @property
    def cp_group(self) -> tuple[int, ...]:
        """This rank's CP ring: the stage's ranks of its TP rank, in CP rank order."""
        return self.stage.cp_group(self.tp_rank)

    def fwd_peers(self, chunk: int) -> tuple[int | None, tuple[int, ...]]:
        """(rank chunk ``chunk``'s forward input comes from or None, ranks its output goes to)."""
        st = self.stage
        src = self.fwd_recv_from if st.stage > 0 else self.wrap_recv_from if chunk > 0 else None
        dst = self.fwd_send_to if st.stage < st.num_stages - 1 else \
            self.wrap_send_to if chunk < st.num_chunks - 1 else ()
        return src, dst

    def bwd_peers(self, chunk: int) -> tuple[int | None, tuple[int, ...]]:
        """(rank chunk ``chunk``'s output gradient comes from or None, ranks its input gradient goes to)."""
        st = self.stage
        src = self.bwd_recv_from if st.stage < st.num_stages - 1 else \
            self.wrap_grad_recv_from if chunk < st.num_chunks - 1 else None
        dst = self.bwd_send_to if st.stage > 0 else self.wrap_grad_send_to if chunk > 0 else ()
        return src, dst


@dataclass(frozen=True)
class GradGroup:
    """Ranks that all-reduce one set of gradients. ``mixed``: holders differ in TP degree, so every
    rank contributes full-size gradients (its shard in place, zeros elsewhere)."""

    ranks: tuple[int, ...]
    mixed: bool


@dataclass(frozen=True)
class Topology:
    world_size: int
    places: tuple[RankPlace, ...]  # indexed by rank
    stages: tuple[StagePlace, ...]  # every stage of every pipeline
    unit_holders: dict[str, tuple[StagePlace, ...]]  # first holder owns the unit for norm counting
    groups: tuple[tuple[int, ...], ...]  # creation order; identical on every rank
    global_batch: int
    log_rank: int  # last stage of pipeline 0, TP rank 0: logs metrics

    def place(self, rank: int) -> RankPlace:
        return self.places[rank]

    @property
    def p2p_lanes(self) -> tuple[tuple[int, int, str], ...]:
        """Every (source rank, destination rank, kind) that carries pipeline messages, kind "fwd" for
        activations and "bwd" for their gradients (the wrap between the last and first stage of
        virtual stages included), sorted: the runtime gives each its own communicator (comm's
        ``create_p2p_lanes``; why: docs/communicator.md). Identical on every rank."""
        lanes = set()
        for pl in self.places:
            for chunk in range(pl.stage.num_chunks):
                lanes.update((pl.rank, d, "fwd") for d in pl.fwd_peers(chunk)[1])
                lanes.update((pl.rank, d, "bwd") for d in pl.bwd_peers(chunk)[1])
        return tuple(sorted(lanes))

    def sync_group(self, unit: str, rank: int) -> GradGroup:
        holders = self.unit_holders[unit]
        tps = {s.tp for s in holders}
        if len(tps) > 1:
            return GradGroup(ranks=tuple(sorted(r for s in holders for r in s.ranks)), mixed=True)
        # Every CP rank of a holder is one more holder: it saw other positions of the same sequences
        # (Megatron's data-parallel group with context parallelism).
        q = self.places[rank].tp_rank
        return GradGroup(ranks=tuple(sorted(r for s in holders for r in s.cp_group(q))), mixed=False)

    def owns(self, unit: str, rank: int) -> bool:
        """True on the ranks of CP rank 0 of the unit's first holder stage: they count it in the
        gradient norm (after the sync every CP rank has the same gradient)."""
        return rank in self.unit_holders[unit][0].tp_group(0)


# stage_places by the plan's pipelines (id, pinned; frozen), all it reads (the ranks are their devices in
# order): the predictor's sync and sharding rules ask it several times per prediction, O(devices) each, and
# the planner's plans that differ only in their training settings (runtime, optimizer sharding) share them.
_PLACES = Kept(64, shortcut=True)
# unit_holders by stage places (the tuple: id, pinned) and the model's unit rules: the sync groups, their
# buckets, the optimizer's split and the planner's sharding check each ask it of the same places.
_HOLDERS = Kept(64, shortcut=True)


def stage_places(plan: Plan) -> tuple[StagePlace, ...]:
    """Every stage of every pipeline, in pipeline then stage order, with its torch ranks."""
    return _PLACES.get((id(plan.pipelines),), lambda: _stage_places(plan), pin=(plan.pipelines,))


def _stage_places(plan: Plan) -> tuple[StagePlace, ...]:
    rank_of = plan.rank_of_device()
    return tuple(StagePlace(pipeline=pi, stage=si, num_stages=len(p.stages), kind=s.kind,
                            ranks=tuple(map(rank_of.__getitem__, s.devices)), layers=s.layers, embedding=s.embedding,
                            head=s.head, recompute=s.recompute, chunks=s.chunks, cp=s.cp,
                            sequence_parallel=s.sequence_parallel)
                 for pi, p in enumerate(plan.pipelines) for si, s in enumerate(p.stages))


def unit_holders(plan: Plan, stages: tuple[StagePlace, ...] | None = None) -> dict[str, tuple[StagePlace, ...]]:
    """Each unit's holder stages (see the module doc for their order), units in first-met order."""
    stages = stage_places(plan) if stages is None else stages
    tied, learned_pos = plan.model.tied_embeddings, plan.model.arch == "gpt"
    return dict(_HOLDERS.get((id(stages), tied, learned_pos),
                             lambda: _unit_holders(stages, tied=tied, learned_pos=learned_pos), pin=(stages,)))


def _unit_holders(stages: tuple[StagePlace, ...], *, tied: bool, learned_pos: bool,
                  ) -> dict[str, tuple[StagePlace, ...]]:
    holders: dict[str, list[StagePlace]] = {}
    for st in stages:
        for u in stage_units(st, tied=tied, learned_pos=learned_pos):
            holders.setdefault(u, []).append(st)
    if "embed" in holders:  # the embedding stages first, then the head stages holding a tied copy
        holders["embed"].sort(key=lambda st: not st.embedding)
    return {u: tuple(h) for u, h in holders.items()}


def single_holder_units(plan: Plan) -> list[str]:
    """Parameter units held by one stage only (a plan of one replica): a sharded optimizer has nothing
    to split them across, so the runtime refuses such a plan sharded and the planner writes it
    unsharded. Of a valid plan (``Plan.validate``): each pipeline's stages hold every unit (its layers
    once, the embedding first, the head last), so with two pipelines or more none is alone (a shortcut
    off the reference path: memo.py), and the holders are walked only for one."""
    if len(plan.pipelines) > 1 and not reference():
        return []
    return [u for u, holders in unit_holders(plan).items() if len(holders) == 1]


# kind_nodes by cluster (id, pinned): every layout the search builds starts from the same free nodes.
_NODES = Kept(16, shortcut=True)


def kind_nodes(cluster: Cluster) -> dict[str, tuple[tuple[int, ...], ...]]:
    """Per kind, its devices' ids node by node (a run of consecutive devices on one node), in
    cluster order: what the planner's ``layout_assemble.allocate_devices`` hands out, each call from a fresh copy."""
    return _NODES.get((id(cluster),), lambda: _kind_nodes(cluster), pin=(cluster,))


def _kind_nodes(cluster: Cluster) -> dict[str, tuple[tuple[int, ...], ...]]:
    free: dict[str, list[list[int]]] = {}
    for d in cluster.devices:
        nodes = free.setdefault(d.kind, [])
        if not nodes or cluster.devices[nodes[-1][0]].node != d.node:
            nodes.append([])
        nodes[-1].append(d.id)
    return {kind: tuple(map(tuple, nodes)) for kind, nodes in free.items()}


def build_topology(plan: Plan) -> Topology:
    offsets = block_starts([p.num_samples for p in plan.pipelines])
    stages = stage_places(plan)
    places: dict[int, RankPlace] = {}
    by_pipeline: list[list[StagePlace]] = [[] for _ in plan.pipelines]
    for st in stages:
        by_pipeline[st.pipeline].append(st)
    for pi, (p, sp) in enumerate(zip(plan.pipelines, by_pipeline, strict=True)):
        first, last = sp[0], sp[-1]
        wraps = first.num_chunks > 1
        numel = p.micro_batch_size * plan.seq_len // first.cp * plan.model.hidden_size  # one CP rank's message
        for si, st in enumerate(sp):
            prev = sp[si - 1] if si > 0 else None
            nxt = sp[si + 1] if si + 1 < len(sp) else None
            hops = stage_hops(prev, st, nxt, numel=numel)
            if wraps and si in (0, len(sp) - 1):
                hops.update(wrap_hops(last, first, numel=numel))
            # The CP ranks of adjacent stages hold the same positions (Plan.validate: one CP degree per
            # pipeline), so each talks to its own: TP routing happens within CP rank c.
            for c in range(st.cp):
                pt, nt = (prev.tp_group(c) if prev else ()), (nxt.tp_group(c) if nxt else ())
                for q, r in enumerate(st.tp_group(c)):
                    wrap: dict[str, object] = {}
                    if wraps and si == 0:
                        lt = last.tp_group(c)
                        wrap.update(wrap_recv_from=lt[fwd_source(a=last.tp, q=q)],
                                    wrap_grad_send_to=tuple(lt[t] for t in bwd_targets(a=last.tp, b=st.tp, q=q)))
                    if wraps and si == len(sp) - 1:
                        ft = first.tp_group(c)
                        wrap.update(wrap_send_to=tuple(ft[t] for t in fwd_targets(a=st.tp, b=first.tp, j=q)),
                                    wrap_grad_recv_from=ft[bwd_source(b=first.tp, j=q)])
                    places[r] = RankPlace(
                        split_in=hops["hop_in"].piece == "flat", split_out=hops["hop_out"].piece == "flat",
                        rank=r, stage=st, tp_rank=q, cp_rank=c, micro_batch_size=p.micro_batch_size,
                        num_micro_batches=p.num_micro_batches, sample_offset=offsets[pi],
                        fwd_recv_from=pt[fwd_source(a=prev.tp, q=q)] if prev else None,
                        fwd_send_to=tuple(nt[t] for t in fwd_targets(a=st.tp, b=nxt.tp, j=q)) if nxt else (),
                        bwd_recv_from=nt[bwd_source(b=nxt.tp, j=q)] if nxt else None,
                        bwd_send_to=tuple(pt[t] for t in bwd_targets(a=prev.tp, b=st.tp, q=q)) if prev else (),
                        **hops, **wrap,  # type: ignore[arg-type]
                    )
    topo = Topology(world_size=plan.world_size, places=tuple(places[r] for r in range(plan.world_size)),
                    stages=stages, unit_holders=unit_holders(plan, stages), groups=(),
                    global_batch=plan.global_batch,
                    log_rank=next(s for s in stages if s.pipeline == 0 and s.head).ranks[0])
    return _with_groups(topo)


def seq_positions(seq_len: int, *, cp: int, cp_rank: int) -> tuple[tuple[int, int], ...]:
    """The sequence positions [start, end) CP rank ``cp_rank`` of ``cp`` holds, in the order it holds
    them: the sequence cut into 2cp equal chunks, rank c takes chunks c and 2cp-1-c, so under a causal
    mask every rank has the same attention work (an early chunk sees few keys, its partner many).
    One chunk pair, the whole sequence, for cp 1."""
    if cp == 1:
        return ((0, seq_len),)
    n = seq_len // (2 * cp)
    late = 2 * cp - 1 - cp_rank
    return ((cp_rank * n, (cp_rank + 1) * n), (late * n, (late + 1) * n))


def _with_groups(topo: Topology) -> Topology:
    """TP groups first, then CP rings, then gradient-sync groups; singletons skipped (nothing to reduce)."""
    seen: dict[tuple[int, ...], None] = {}
    for st in topo.stages:
        if st.tp > 1:
            for c in range(st.cp):
                seen.setdefault(tuple(sorted(st.tp_group(c))), None)
    for st in topo.stages:
        if st.cp > 1:
            for q in range(st.tp):
                seen.setdefault(tuple(sorted(st.cp_group(q))), None)
    for unit in topo.unit_holders:
        for st in topo.unit_holders[unit]:
            for r in st.ranks:
                g = topo.sync_group(unit, r).ranks
                if len(g) > 1:
                    seen.setdefault(g, None)
    return Topology(world_size=topo.world_size, places=topo.places, stages=topo.stages,
                    unit_holders=topo.unit_holders, groups=tuple(seen), global_batch=topo.global_batch,
                    log_rank=topo.log_rank)
