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
from collections.abc import Sequence
from dataclasses import dataclass

from hethub.plan import Plan, Recompute
from hethub.plan_parts import LayerChunks


@dataclass(frozen=True)
class StagePlace(LayerChunks):
    pipeline: int
    stage: int
    num_stages: int
    kind: str
    ranks: tuple[int, ...]  # torch ranks, TP rank order
    layers: tuple[int, int]  # with chunks: the first chunk's
    embedding: bool
    head: bool
    recompute: Recompute = Recompute.NONE
    chunks: tuple[tuple[int, int], ...] = ()  # layer ranges of the stage's model chunks (virtual stages)

    @property
    def tp(self) -> int:
        return len(self.ranks)


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
    # TP-split hops (split_hop): the activation from the previous stage / to the next stage (and the
    # gradient back) travels as this rank's 1/tp slice, all-gathered over the TP group on arrival.
    split_in: bool = False
    split_out: bool = False
    # Virtual stages: the last stage's chunk c sends its output to the first stage's chunk c + 1
    # (and gets that chunk's input gradient back), routed between the two stages' TP degrees as
    # between adjacent stages. Set on the first and last stage of a pipeline with v > 1 chunks.
    wrap_recv_from: int | None = None  # first stage: rank sending chunk c > 0 its input
    wrap_send_to: tuple[int, ...] = ()  # last stage: ranks chunk c < v - 1 sends its output to
    wrap_grad_recv_from: int | None = None  # last stage: rank sending chunk c < v - 1 its output gradient
    wrap_grad_send_to: tuple[int, ...] = ()  # first stage: ranks chunk c > 0 sends its input gradient to

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
    """Whether the hop between adjacent stages of TP degrees a and b sends each TP rank's slice only
    (Megatron's scatter-gather: sender j sends slice j of the replicated activation to receiver j,
    which all-gathers the whole tensor over its TP group, usually the fast intra-node link; the
    gradient back likewise). Equal degrees only, and a tensor that splits evenly; otherwise receiver q
    gets the whole tensor from sender q mod a."""
    return a == b > 1 and numel % a == 0


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
    w = [max(0.0, float(x)) for x in weights]
    total = sum(w)
    if total <= 0:
        w, total = [1.0] * len(weights), float(len(weights))
    exact = [n * x / total for x in w]
    sizes = [int(e) for e in exact]
    left = n - sum(sizes)
    order = sorted(range(len(w)), key=lambda i: (-(exact[i] - sizes[i]), i))
    for i in order[:left]:
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

    def sync_group(self, unit: str, rank: int) -> GradGroup:
        holders = self.unit_holders[unit]
        tps = {s.tp for s in holders}
        if len(tps) > 1:
            return GradGroup(ranks=tuple(sorted(r for s in holders for r in s.ranks)), mixed=True)
        q = self.places[rank].tp_rank
        return GradGroup(ranks=tuple(sorted(s.ranks[q] for s in holders)), mixed=False)

    def owns(self, unit: str, rank: int) -> bool:
        """True on the ranks of the unit's first holder stage: they count it in the gradient norm."""
        return rank in self.unit_holders[unit][0].ranks


def stage_places(plan: Plan) -> tuple[StagePlace, ...]:
    """Every stage of every pipeline, in pipeline then stage order, with its torch ranks."""
    rank_of = plan.rank_of_device()
    return tuple(StagePlace(pipeline=pi, stage=si, num_stages=len(p.stages), kind=s.kind,
                            ranks=tuple(rank_of[d] for d in s.devices), layers=s.layers, embedding=s.embedding,
                            head=s.head, recompute=s.recompute, chunks=s.chunks)
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
        for si, st in enumerate(sp):
            prev = sp[si - 1] if si > 0 else None
            nxt = sp[si + 1] if si + 1 < len(sp) else None
            numel = p.micro_batch_size * plan.seq_len * plan.model.hidden_size
            split_in = prev is not None and split_hop(a=prev.tp, b=st.tp, numel=numel)
            split_out = nxt is not None and split_hop(a=st.tp, b=nxt.tp, numel=numel)
            for q, r in enumerate(st.ranks):
                wrap: dict[str, object] = {}
                if wraps and si == 0:
                    wrap.update(wrap_recv_from=last.ranks[fwd_source(a=last.tp, q=q)],
                                wrap_grad_send_to=tuple(last.ranks[t] for t in bwd_targets(a=last.tp, b=st.tp, q=q)))
                if wraps and si == len(sp) - 1:
                    wrap.update(wrap_send_to=tuple(first.ranks[t] for t in fwd_targets(a=st.tp, b=first.tp, j=q)),
                                wrap_grad_recv_from=first.ranks[bwd_source(b=first.tp, j=q)])
                places[r] = RankPlace(
                    split_in=split_in, split_out=split_out,
                    rank=r, stage=st, tp_rank=q, micro_batch_size=p.micro_batch_size,
                    num_micro_batches=p.num_micro_batches, sample_offset=offsets[pi],
                    fwd_recv_from=prev.ranks[fwd_source(a=prev.tp, q=q)] if prev else None,
                    fwd_send_to=tuple(nxt.ranks[t] for t in fwd_targets(a=st.tp, b=nxt.tp, j=q)) if nxt else (),
                    bwd_recv_from=nxt.ranks[bwd_source(b=nxt.tp, j=q)] if nxt else None,
                    bwd_send_to=tuple(prev.ranks[t] for t in bwd_targets(a=prev.tp, b=st.tp, q=q)) if prev else (),
                    **wrap,  # type: ignore[arg-type]
                )
    topo = Topology(world_size=plan.world_size, places=tuple(places[r] for r in range(plan.world_size)),
                    stages=stages, unit_holders=unit_holders(plan, stages), groups=(),
                    global_batch=plan.global_batch,
                    log_rank=next(s for s in stages if s.pipeline == 0 and s.head).ranks[0])
    return _with_groups(topo)


def _with_groups(topo: Topology) -> Topology:
    """TP groups first, then gradient-sync groups; singletons skipped (nothing to reduce)."""
    seen: dict[tuple[int, ...], None] = {}
    for st in topo.stages:
        if st.tp > 1:
            seen.setdefault(tuple(sorted(st.ranks)), None)
    for unit in topo.unit_holders:
        for st in topo.unit_holders[unit]:
            for r in st.ranks:
                g = topo.sync_group(unit, r).ranks
                if len(g) > 1:
                    seen.setdefault(g, None)
    return Topology(world_size=topo.world_size, places=topo.places, stages=topo.stages,
                    unit_holders=topo.unit_holders, groups=tuple(seen), global_batch=topo.global_batch,
                    log_rank=topo.log_rank)
