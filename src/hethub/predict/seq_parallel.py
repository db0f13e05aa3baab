"""Time of sequence and context parallelism: the one home of their rules, which the predictor calls
per stage and the planner can call the same way (their memory terms are the memory model's,
``predict/memory/activations.py``).

Sequence parallelism (a stage's ``sequence_parallel``, TP > 1): per layer, the two all-reduces of
forward and the two of backward become an all-gather and a reduce-scatter each (forward: gather
before the column-parallel GEMMs, reduce-scatter after the row-parallel ones; backward the reverse),
each a ring pass of 1/t of the layer's activation: the same bytes and latencies as the all-reduces
(an all-reduce is a reduce-scatter plus an all-gather), so SP's gain is memory, not time. What it
adds: its norms' weight gradients (2 per layer, ``h`` fp32 elements each) all-reduced over the TP
group in every micro-batch's backward (``runtime/tensor_parallel.sum_grad_over_tp``).

Context parallelism (``cp``): each rank holds s/cp tokens of every sequence, chunks c and 2cp-1-c of
2cp (``layout.seq_positions``), so under the causal mask each does 1/cp of the attention work: its
compute is the stage's at the whole sequence divided by cp (linear parts scale with tokens, the
attention core with s^2/cp). An estimate: kernels at 1/cp of the shape may run less efficiently.
The ring (``runtime/context_parallel.py``) passes each layer's K/V block cp - 1 times forward, and
in backward the block again (cp - 1 times) and its fp32 gradients (cp times), over the CP ring's
slowest link, all TP ranks' rings at once (NIC sharing, ``comm.rings_link``). The runtime posts each
pass before the block's kernels, so on an accelerator they overlap; here they are priced whole, an
upper bound (the prediction's sources say so). TP collectives and stage messages carry s/cp tokens.

Stage messages follow ``layout.hop`` (whole tensor, a flat 1/t or the receiver's sequence slice; the
sender or the receiver all-gathers over its TP group): ``boundary_hop_s`` prices the hop the runtime
makes in each direction and takes the slower, the simulation's one transfer per boundary.
"""

from __future__ import annotations

from collections.abc import Sequence

from hethub.layout import Hop, hop
from hethub.plan_parts import Stage
from hethub.predict.comm import (
    hop_messages,
    hop_messages_time_s,
    ring_pass_time_s,
    rings_link,
    small_allreduce_time_s,
)
from hethub.runtimes import DEFAULT_RUNTIME, runtime_runs
from hethub.spec.cluster import Cluster, Link
from hethub.spec.model import ModelSpec

GRAD_BYTES = 4  # the norms' weight gradients and the ring's K/V gradients travel in fp32


def sp_applies(*, tp: int, seq_len: int, cp: int = 1, runtime: str = DEFAULT_RUNTIME) -> bool:
    """Whether a TP-``tp`` stage can run sequence parallelism (what ``plan_check.check_seq_split`` accepts:
    TP > 1 and each CP rank's tokens split over the TP ranks) under ``runtime``."""
    return tp > 1 and (seq_len // cp) % tp == 0 and runtime_runs(runtime, sequence_parallel=True)


def sp_tp_comm_s(*, act_bytes_per_layer: float, layers: int, tp: int, hidden_size: int, link: Link,
                 ) -> tuple[float, float]:
    """Forward and backward time of a sequence-parallel stage's TP collectives over ``link``: per
    layer two all-gathers and two reduce-scatters each way (ring passes of 1/tp of the activation),
    plus the two norm-weight gradient all-reduces of backward."""
    if tp <= 1:
        return 0.0, 0.0
    one = ring_pass_time_s(chunk_bytes=act_bytes_per_layer / tp, participants=tp, link=link)
    norms = 2 * small_allreduce_time_s(nbytes=hidden_size * GRAD_BYTES, participants=tp, link=link)
    return 2 * layers * 2 * one, layers * (2 * 2 * one + norms)


def cp_ring_s(cluster: Cluster, stage: Stage, *, model: ModelSpec, mbs: int, seq_len: int, act_bytes: int,
              layers: int) -> tuple[float, float]:
    """Forward and backward time of a CP stage's ring passes (not overlapped: see the module doc)."""
    cp, tp = stage.cp, stage.tp
    if cp <= 1 or layers <= 0:
        return 0.0, 0.0
    link = cp_ring_link(cluster, stage)
    kv_elems = 2 * mbs * seq_len / cp * model.kv_dim / tp  # K and V of one rank's tokens and heads
    kv = ring_pass_time_s(chunk_bytes=kv_elems * act_bytes, participants=cp, link=link)
    grads = ring_pass_time_s(chunk_bytes=kv_elems * GRAD_BYTES, participants=cp, link=link)
    # ring_pass is cp - 1 hops; backward's gradients make one hop more (home to their owner).
    return layers * kv, layers * (kv + grads * cp / (cp - 1))


def cp_ring_link(cluster: Cluster, stage: Stage) -> Link:
    """The bottleneck link of the stage's CP rings (one per TP rank, all at once)."""
    return rings_link(cluster, [stage.cp_group(q) for q in range(stage.tp)])


def cp_compute_share(cp: int) -> float:
    """The share of the stage's whole-sequence compute one CP rank does (balanced causal chunks)."""
    return 1.0 / cp


def stage_hop(src: Stage, dst: Stage, *, numel: int, flat: bool = True) -> Hop:
    """``layout.hop`` between two plan stages (``numel``: one CP rank's message)."""
    return hop(src_tp=src.tp, src_sp=src.sequence_parallel, dst_tp=dst.tp, dst_sp=dst.sequence_parallel,
               numel=numel, flat=flat)


def boundary_messages(src: Stage, dst: Stage, the_hop: Hop, *, nbytes: float) -> list[tuple[int, int, float]]:
    """(sending device, receiving device, bytes) of every message of one micro-batch's hop from ``src``
    to ``dst`` (every CP rank's pairs; ``nbytes``: one CP rank's whole message), as the runtime posts
    them (``comm.hop_messages``; tests/unit/test_hop_bytes.py counts the runtime's)."""
    return [m for c in range(dst.cp) for m in hop_messages(src.tp_group(c), dst.tp_group(c), the_hop, nbytes=nbytes)]


def hop_time_s(cluster: Cluster, src: Stage, dst: Stage, the_hop: Hop, *, nbytes: float) -> float:
    """One direction of a boundary: ``nbytes`` is one CP rank's message; every CP rank's pairs send at
    once (sharing NICs), then the receiver's TP all-gather, after the sender's where it gathers."""
    worst = hop_messages_time_s(cluster, boundary_messages(src, dst, the_hop, nbytes=nbytes))
    gathers = 0.0
    if the_hop.source_gathers:
        gathers += _tp_gather_s(cluster, src, nbytes=nbytes)
    if the_hop.dest_gathers:
        gathers += _tp_gather_s(cluster, dst, nbytes=nbytes)
    return worst + gathers


def _tp_gather_s(cluster: Cluster, stage: Stage, *, nbytes: float) -> float:
    """An all-gather of ``nbytes`` in tp pieces over the stage's TP groups (one per CP rank, at once)."""
    return ring_pass_time_s(chunk_bytes=nbytes / stage.tp, participants=stage.tp,
                            link=rings_link(cluster, [stage.tp_group(c) for c in range(stage.cp)]))


def boundary_hop_s(cluster: Cluster, src: Stage, dst: Stage, *, mbs: int, seq_len: int, hidden_size: int,
                   act_bytes: int, flat: bool = True) -> float:
    """The transfer of one micro-batch across the boundary ``src`` -> ``dst``: the slower of the
    activation forward and its gradient back, each as the runtime sends it (``layout.hop``)."""
    numel = mbs * seq_len // dst.cp * hidden_size
    nbytes = numel * act_bytes
    fwd = hop_time_s(cluster, src, dst, stage_hop(src, dst, numel=numel, flat=flat), nbytes=nbytes)
    bwd = hop_time_s(cluster, dst, src, stage_hop(dst, src, numel=numel, flat=flat), nbytes=nbytes)
    return max(fwd, bwd)


def splits_sequence(stages: Sequence[Stage]) -> bool:
    """Whether any of ``stages`` uses sequence or context parallelism (priced here, not by the
    plain TP and hop rules)."""
    return any(s.cp > 1 or s.sequence_parallel for s in stages)
