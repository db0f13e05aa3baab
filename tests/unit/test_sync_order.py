"""The predictor's gradient-sync model follows the runtime: the same holders (both from
hethub.layout) and, on every rank, the same order of fused all-reduces as the runtime's GradSync
(parameters sorted by name, one bucket per group of ranks, in order of first appearance)."""

from __future__ import annotations

from dataclasses import replace

import pytest
from test_layout import SPEC, plan

from hethub.layout import build_topology, unit_of
from hethub.predict.sync import sync_groups
from hethub.runtime.model import StageModel
from hethub.runtime.tensor_parallel import TPContext


def _runtime_bucket_order(p, rank: int) -> list[frozenset[tuple[int, int]]]:
    """GradSync's buckets on ``rank`` in the order it all-reduces them, each as the holder stages."""
    topo = build_topology(p)
    st = topo.place(rank).stage
    model = StageModel(p.model, layers=st.layers, embedding=st.embedding, head=st.head, tp=TPContext())
    order: list[tuple[int, ...]] = []
    holders: dict[tuple[int, ...], frozenset[tuple[int, int]]] = {}
    for name, _ in sorted(model.named_parameters()):  # as data_parallel.GradSync walks them
        unit = unit_of(name)
        ranks = topo.sync_group(unit, rank).ranks
        if ranks not in holders:
            order.append(ranks)
            holders[ranks] = frozenset((h.pipeline, h.stage) for h in topo.unit_holders[unit])
    return [holders[r] for r in order if len(r) > 1]


def _predicted_order(p, stage: tuple[int, int]) -> list[frozenset[tuple[int, int]]]:
    return [frozenset(g.holders) for g in sync_groups(p) if stage in g.holders and g.participants > 1]


TIED = replace(SPEC, tied_embeddings=True)
GPT = replace(SPEC, arch="gpt", activation="gelu", num_kv_heads=SPEC.num_heads, tied_embeddings=True)
PLANS = {
    # Replicas that split layers differently: the head stage of one shares layers with the middle of
    # the other, so the head stage runs several buckets.
    "uneven": plan([(1, 2, [((0,), 2), ((1,), 2), ((2,), 2)]), (1, 2, [((4,), 3), ((5,), 3)])]),
    "uneven-tied": plan([(1, 2, [((0,), 2), ((1,), 2), ((2,), 2)]), (1, 2, [((4,), 3), ((5,), 3)])], spec=TIED),
    "uneven-gpt": plan([(1, 2, [((0,), 2), ((1,), 2), ((2,), 2)]), (1, 2, [((4,), 3), ((5,), 3)])], spec=GPT),
    "aligned-tied": plan([(1, 2, [((0,), 3), ((1,), 3)]), (1, 2, [((4,), 3), ((5,), 3)])], spec=TIED),
}


@pytest.mark.parametrize("name", PLANS)
def test_predicted_sync_order_is_the_runtimes_on_every_rank(name):
    p = PLANS[name]
    topo = build_topology(p)
    for rank in range(p.world_size):
        st = topo.place(rank).stage
        assert _predicted_order(p, (st.pipeline, st.stage)) == _runtime_bucket_order(p, rank), (name, rank)


def _runtime_bucket_elems(p, rank: int) -> dict[frozenset[tuple[int, int]], int]:
    """GradSync's all-reduced elements on ``rank`` per group of holder stages (its TP shard of each)."""
    topo = build_topology(p)
    pl = topo.place(rank)
    st = pl.stage
    model = StageModel(p.model, layers=st.layers, embedding=st.embedding, head=st.head,
                       tp=TPContext(size=st.tp, rank=pl.tp_rank, group=st.tp_group(pl.cp_rank)))
    out: dict[frozenset[tuple[int, int]], int] = {}
    for name, param in model.named_parameters():
        unit = unit_of(name)
        if len(topo.sync_group(unit, rank).ranks) > 1:
            holders = frozenset((h.pipeline, h.stage) for h in topo.unit_holders[unit])
            out[holders] = out.get(holders, 0) + param.numel()
    return out


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("vocab", [256, 255])
def test_predicted_sync_bytes_are_the_runtimes_on_tp_stages(vocab, tied):
    """Each predicted all-reduce carries what the runtime's TP-2 ranks reduce: the embedding and head
    split by vocabulary where 2 divides it, whole where it does not (255: the runtime replicates them,
    ModelSpec.vocab_tp)."""
    spec = replace(SPEC, vocab_size=vocab, tied_embeddings=tied)
    p = plan([(1, 2, [((0, 1), 3), ((2, 3), 3)]), (1, 2, [((4, 5), 3), ((6, 7), 3)])], spec=spec)
    predicted = {frozenset(g.holders): g.nbytes / 4 for g in sync_groups(p)}  # fp32 gradients
    for rank in range(p.world_size):
        for holders, elems in _runtime_bucket_elems(p, rank).items():
            assert predicted[holders] == elems, (rank, sorted(holders))
