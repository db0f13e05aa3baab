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

import functools
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from hethub.memo import Kept
from hethub.plan import Plan, Recompute
from hethub.plan_parts import LayerChunks, SeqGrid


@dataclass(frozen=True)
class StagePlace(LayerChunks, SeqGrid):
    pipeline: int
    stage: int
    num_stages: int
    kind: str
    ranks: tuple[int, ...]  # torch ranks, CP-major, TP rank order within each CP rank (SeqGrid)
    layers: tuple[int, int]  # with chunks: the first chunk's
    embedding: bool
    head: bool
    recompute: Recompute = Recompute.NONE
    chunks: tuple[tuple[int, int], ...] = ()  # layer ranges of the stage's model chunks (virtual stages)
    cp: int = 1
    sequence_parallel: bool = False

    def _members(self) -> tuple[int, ...]:
        return self.ranks


@dataclass(frozen=True)
class Hop:
    """How one message between adjacent stages travels, from each sending rank to each receiving rank
    of the same CP rank (receiver q's sender is TP rank q mod (sender's TP)).

    ``piece``: ``whole`` (the receiver gets the whole tensor), ``flat`` (1/t of the flattened tensor,
    t the receiver's TP degree: receiver q gets slice q; Megatron's scatter-gather, here between any
    two degrees) or ``seq`` (the receiver's own sequence slice: positions [q s/t, (q+1) s/t) of the
    CP-local sequence). ``source_gathers``: the sender, holding only its own sequence slice (a
    sequence-parallel stage), first all-gathers the slices over its TP group. ``dest_gathers``: the
    receiver all-gathers the pieces over its TP group on arrival (``flat`` or ``seq``)."""

    piece: str = "whole"
    source_gathers: bool = False
    dest_gathers: bool = False
    parts: int = 1  # ``flat``, ``seq``: the receiving stage's TP degree (how many pieces the tensor is cut into)


WHOLE = Hop()


def hop(*, src_tp: int, src_sp: bool, dst_tp: int, dst_sp: bool, numel: int, flat: bool = True) -> Hop:
    """How a tensor moves from a stage of TP degree ``src_tp`` to one of ``dst_tp``, each holding it
    sequence-split over its TP ranks or not (``*_sp``): forward, the sender's output to the receiver's
    input; backward, the receiver's input gradient back to the sender (the same rule, roles swapped).

    The link between the stages carries one copy of the tensor whatever the two degrees: each
    receiver gets only its piece and the receiving TP group all-gathers on its own (usually fast,
    native) link. Sequence slices travel as they are held (Korthikanti et al. 2022): a
    sequence-parallel receiver gets only its slice, a sequence-parallel sender of the same TP degree
    sends its own; a sequence-parallel sender facing another degree gathers first. Otherwise the
    receiver's flat slice (``split_hop``; allowed only where ``flat``: the wrap of virtual stages
    sends whole tensors), or the whole tensor to a receiver alone in its stage or where it does not
    split evenly. The predictor prices each case from the same result (``predict/comm.py``:
    ``hop_messages``)."""
    if dst_sp:
        return Hop("seq", source_gathers=src_sp and src_tp != dst_tp, parts=dst_tp)
    if src_sp and src_tp == dst_tp:
        return Hop("seq", dest_gathers=True, parts=dst_tp)
    if flat and split_hop(a=src_tp, b=dst_tp, numel=numel):
        return Hop("flat", source_gathers=src_sp, dest_gathers=True, parts=dst_tp)
    return Hop("whole", source_gathers=src_sp)


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


# ---- activation routing between stages of TP degree a (sender) and b (receiver) -----------------
def fwd_source(*, a: int, q: int) -> int:
    """TP rank of the previous stage that receiver q gets its activation from."""
    return q % a


def fwd_targets(*, a: int, b: int, j: int) -> tuple[int, ...]:
    """TP ranks of the next stage that sender j sends its activation to."""
    return tuple(q for q in range(b) if fwd_source(a=a, q=q) == j)


def bwd_source(*, b: int, j: int) -> int:
    """TP rank of the next stage that sender j gets its output gradient from."""
    return j % b


def bwd_targets(*, a: int, b: int, q: int) -> tuple[int, ...]:
    """TP ranks of the previous stage that receiver q sends its input gradient to."""
    return tuple(j for j in range(a) if bwd_source(b=b, j=j) == q)


def split_hop(*, a: int, b: int, numel: int) -> bool:
    """Whether the hop from a stage of TP degree a to one of degree b sends each receiving TP rank
    only its slice of the replicated activation (Megatron's scatter-gather, any two degrees): receiver
    q gets slice q of b from sender q mod a and all-gathers the whole tensor over its TP group
    (usually the fast intra-node link), so the link between the stages carries one copy, not one per
    receiver (4 -> 8: one copy where whole tensors sent eight). A receiving stage of one rank, or a
    tensor that does not split into b equal slices, gets whole tensors from sender q mod a."""
    return b > 1 and numel % b == 0


# ---- parameter units ------------------------------------------------------------------------------
def stage_units(stage: StagePlace, *, tied: bool, learned_pos: bool) -> tuple[str, ...]:
    """The units a stage holds, in module order."""
    return _units(stage.layer_ranges, embedding=stage.embedding, head=stage.head, tied=tied, learned_pos=learned_pos)


# Cached: a large plan has thousands of stages but few distinct (layers, embedding, head) shapes.
@functools.lru_cache(maxsize=4096)
def _units(ranges: tuple[tuple[int, int], ...], *, embedding: bool, head: bool, tied: bool,
           learned_pos: bool) -> tuple[str, ...]:
    units: list[str] = []
    if embedding:
        units.append("embed")
        if learned_pos:
            units.append("pos")
    units += [f"layer.{i}" for a, b in ranges for i in range(a, b)]
    if head:
        units.append("final_norm")
        if not tied:
            units.append("head")
        elif "embed" not in units:
            units.append("embed")  # the tied head holds the embedding under its own name
    return tuple(units)


_MODULE_OF_UNIT = {"embed": "embed", "pos": "pos", "final_norm": "norm", "head": "head"}
_UNIT_OF_MODULE = {m: u for u, m in _MODULE_OF_UNIT.items()}


def unit_of(param_name: str) -> str:
    """Map a parameter name of the stage module to its unit."""
    parts = param_name.split(".")
    if parts[0] == "layers":
        return f"layer.{parts[1]}"
    return _UNIT_OF_MODULE[parts[0]]


def unit_param_prefix(unit: str) -> str:
    """The name every parameter of ``unit`` starts with in a stage module (the inverse of ``unit_of``);
    the runtime walks parameters sorted by name, so this orders the gradient syncs."""
    if unit.startswith("layer."):
        return f"layers.{unit[len('layer.'):]}"
    return _MODULE_OF_UNIT[unit]


# Megatron-LM's default data-parallel bucket (``--ddp-bucket-size``: 40M elements, 160 MB of fp32
# gradients): large enough to amortise a collective's latency, small enough that the backward still
# has work left to hide the next bucket behind.
DEFAULT_BUCKET_ELEMS = 40_000_000


def unit_position(unit: str, *, num_layers: int) -> int:
    """A unit's place in the forward pass: embedding, positions, layers 0..L-1, final norm, head."""
    if unit.startswith("layer."):
        return 2 + int(unit[len("layer."):])
    return {"embed": 0, "pos": 1, "final_norm": num_layers + 2, "head": num_layers + 3}[unit]


def reduction_key(param_name: str, *, num_layers: int) -> tuple[int, str]:
    """Sort key of a parameter in the gradient reduction order: units in reverse forward order (the
    order the backward makes their gradients final), then by name. Every rank sorts its gradient
    buckets by it, so ranks sharing a group issue their collectives in the same order (NCCL requires
    it). A tied head's embedding matrix sorts with the embedding, last."""
    return (-unit_position(unit_of(param_name), num_layers=num_layers), param_name)


def bucket_ranges(numels: list[int] | tuple[int, ...], *, cap_elems: int) -> list[tuple[int, int]]:
    """Consecutive items ``[i, j)`` of each bucket over tensors of these sizes, in order: a bucket
    closes once it holds at least ``cap_elems`` elements (Megatron's rule: a tensor is never split, so
    one larger than the cap is a bucket of its own)."""
    if cap_elems < 1:
        raise ValueError(f"the gradient bucket size must be >= 1 element, got {cap_elems}")
    out, start, acc = [], 0, 0
    for i, n in enumerate(numels):
        acc += n
        if acc >= cap_elems:
            out.append((start, i + 1))
            start, acc = i + 1, 0
    if start < len(numels):
        out.append((start, len(numels)))
    return out


def block_starts(sizes: list[int] | tuple[int, ...]) -> list[int]:
    """Where each of consecutive blocks of these sizes starts (an exclusive prefix sum): replica r
    takes sequences [start_r, start_r + samples_r) of each global batch; stage s's first layer."""
    out, acc = [], 0
    for n in sizes:
        out.append(acc)
        acc += n
    return out


def split_elems(n: int, weights: Sequence[float]) -> list[int]:
    """``n`` elements split in proportion to ``weights`` (largest remainder; ties to the earlier
    member), summing to ``n`` exactly: a bucket's slices among its ZeRO-1 owners, sized the same by
    the runtime and the memory model. Zero weights get nothing unless every weight is zero (then
    equal shares)."""
    w = list(map(max, itertools.repeat(0.0), map(float, weights)))
    total = sum(w)
    if total <= 0:
        w, total = [1.0] * len(weights), float(len(weights))
    # Members of equal weight (a stage's ranks, replicas' stages) have equal shares: each distinct
    # weight's share and remainder found once.
    exact = {x: n * x / total for x in set(w)}
    whole = {x: int(e) for x, e in exact.items()}
    sizes = list(map(whole.__getitem__, w))
    left = n - sum(sizes)
    if left:
        # Largest remainder first, ties to the earlier member (a stable sort keeps index order).
        behind = {x: -(e - whole[x]) for x, e in exact.items()}
        for i in sorted(range(len(w)), key=list(map(behind.__getitem__, w)).__getitem__)[:left]:
            sizes[i] += 1
    return sizes


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


# stage_places by plan (id, pinned; plans are frozen): the predictor's sync and sharding rules ask
# it several times per prediction, O(devices) each.
_PLACES = Kept(64, shortcut=True)


def stage_places(plan: Plan) -> tuple[StagePlace, ...]:
    """Every stage of every pipeline, in pipeline then stage order, with its torch ranks."""
    return _PLACES.get((id(plan),), lambda: _stage_places(plan), pin=(plan,))


def _stage_places(plan: Plan) -> tuple[StagePlace, ...]:
    rank_of = plan.rank_of_device()
    return tuple(StagePlace(pipeline=pi, stage=si, num_stages=len(p.stages), kind=s.kind,
                            ranks=tuple(rank_of[d] for d in s.devices), layers=s.layers, embedding=s.embedding,
                            head=s.head, recompute=s.recompute, chunks=s.chunks, cp=s.cp,
                            sequence_parallel=s.sequence_parallel)
                 for pi, p in enumerate(plan.pipelines) for si, s in enumerate(p.stages))


def unit_holders(plan: Plan, stages: tuple[StagePlace, ...] | None = None) -> dict[str, tuple[StagePlace, ...]]:
    """Each unit's holder stages (see the module doc for their order), units in first-met order."""
    stages = stage_places(plan) if stages is None else stages
    tied, learned_pos = plan.model.tied_embeddings, plan.model.arch == "gpt"
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
    unsharded."""
    return [u for u, holders in unit_holders(plan).items() if len(holders) == 1]


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


def stage_hops(prev: StagePlace | None, st: StagePlace, nxt: StagePlace | None, *, numel: int) -> dict[str, Hop]:
    """RankPlace's four hops of a stage between ``prev`` and ``nxt`` (``hop``; ``numel``: one CP rank's
    micro-batch activation)."""
    out = {"hop_in": WHOLE, "hop_out": WHOLE, "hop_grad_in": WHOLE, "hop_grad_out": WHOLE}
    sp = st.sequence_parallel
    if prev is not None:
        out["hop_in"] = hop(src_tp=prev.tp, src_sp=prev.sequence_parallel, dst_tp=st.tp, dst_sp=sp, numel=numel)
        out["hop_grad_out"] = hop(src_tp=st.tp, src_sp=sp, dst_tp=prev.tp, dst_sp=prev.sequence_parallel, numel=numel)
    if nxt is not None:
        out["hop_out"] = hop(src_tp=st.tp, src_sp=sp, dst_tp=nxt.tp, dst_sp=nxt.sequence_parallel, numel=numel)
        out["hop_grad_in"] = hop(src_tp=nxt.tp, src_sp=nxt.sequence_parallel, dst_tp=st.tp, dst_sp=sp, numel=numel)
    return out


def wrap_hops(last: StagePlace, first: StagePlace, *, numel: int) -> dict[str, Hop]:
    """The hops of the wrap from a pipeline's last stage to its first (virtual stages): never ``flat``."""
    return {"wrap_hop": hop(src_tp=last.tp, src_sp=last.sequence_parallel, dst_tp=first.tp,
                            dst_sp=first.sequence_parallel, numel=numel, flat=False),
            "wrap_grad_hop": hop(src_tp=first.tp, src_sp=first.sequence_parallel, dst_tp=last.tp,
                                 dst_sp=last.sequence_parallel, numel=numel, flat=False)}


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


# ZeRO-2/3's rounds of gradient reductions a rank keeps in flight at once (runtime/zero_grads.py), which
# the memory model counts.
ZERO_IN_FLIGHT_ROUNDS = 2


def gathers_params(positions: Sequence[tuple[int, int]]) -> bool:
    """Whether ZeRO-3 shards the parameters of a unit whose holder stages sit at these positions
    ((stage index, stages in its pipeline) each; runtime/zero_params.py): two or more holders, all at
    the same position of pipelines of the same depth. Their forwards and
    backwards then run in one order, so gathering before each use (a collective of all holders) pairs
    up; holders at different positions interleave them differently (a last stage runs B(0) before
    F(1), a first stage F(1) before B(0)) and per-use gathers would wait on each other in a cycle, so
    such a unit keeps its parameters whole (its gradients and optimizer state stay sharded)."""
    return len(positions) > 1 and len(set(positions)) == 1
