"""The records a rank layout (layout.py) is built from: a stage's place (``StagePlace``), how an
activation travels between stages of any two TP degrees (``Hop``, ``hop``, the TP-rank routing), and
the one prefix-sum helper (``block_starts``). Pure Python (no torch)."""

from __future__ import annotations

from dataclasses import dataclass

from hethub.plan import Recompute
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


def block_starts(sizes: list[int] | tuple[int, ...]) -> list[int]:
    """Where each of consecutive blocks of these sizes starts (an exclusive prefix sum): replica r
    takes sequences [start_r, start_r + samples_r) of each global batch; stage s's first layer."""
    out, acc = [], 0
    for n in sizes:
        out.append(acc)
        acc += n
    return out
