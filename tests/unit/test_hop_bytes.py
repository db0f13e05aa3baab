"""The predictor prices the bytes the runtime puts on each stage-to-stage link: every message the
real executor posts in a step (recorded through the communicator seam, ``test_nccl_replay``'s
in-process ranks) equals, sender, receiver and bytes, the predictor's messages of each boundary
(``predict.seq_parallel.boundary_messages`` over ``layout.hop``) times the micro-batches, both
directions, for every plan shape: TP hops between equal and unequal degrees (across the bridge
too), sequence slices, context-parallel pipelines, the wrap of virtual stages."""

from __future__ import annotations

from collections import Counter

import pytest
from test_nccl_replay import SHAPES, Post, _pipeline_send, make_plan, record_all

from hethub.layout import hop
from hethub.plan import Plan
from hethub.predict.memory.model import act_bytes_for
from hethub.predict.seq_parallel import boundary_messages, stage_hop

Sends = Counter[tuple[int, int, int]]  # (sending rank, receiving rank, bytes) -> messages in one step
# On test_nccl_replay's worker, whose recordings (record_all, kept per process) these tests read.
pytestmark = pytest.mark.xdist_group("nccl_replay")


def recorded_sends(schedule: str, chunks: int, shape: str) -> Sends:
    out: Sends = Counter()
    for rank, rec in record_all(schedule, chunks, shape).items():
        for e in rec.events:
            if isinstance(e, Post) and _pipeline_send(e):
                out.update((rank, o.peer, o.nbytes) for o in e.ops)
    return out


def predicted_sends(plan: Plan) -> Sends:
    """Each boundary's messages (forward, and the gradient back) times the pipeline's micro-batches;
    with virtual stages each chunk boundary once per micro-batch, the wrap from the last stage to the
    first v - 1 times (never a flat slice: layout.wrap_hops)."""
    rank = plan.rank_of_device()
    out: Sends = Counter()
    for p in plan.pipelines:
        elem = act_bytes_for(plan.precision_of(p.stages[0].kind))
        numel = p.micro_batch_size * plan.seq_len // p.stages[0].cp * plan.model.hidden_size
        v, n = p.virtual_stages, len(p.stages)
        hops = [(p.stages[i], p.stages[i + 1], True, v) for i in range(n - 1)]
        hops += [(p.stages[-1], p.stages[0], False, v - 1)] if v > 1 else []
        for a, b, flat, times in hops:
            for src, dst in ((a, b), (b, a)):
                the_hop = stage_hop(src, dst, numel=numel, flat=flat)
                for s, r, nbytes in boundary_messages(src, dst, the_hop, nbytes=numel * elem):
                    out[(rank[s], rank[r], int(nbytes))] += times * p.num_micro_batches
    return out


@pytest.mark.parametrize("chunks", [1, 2])
@pytest.mark.parametrize("shape", [name for name, _ in SHAPES])
def test_predicted_link_bytes_equal_what_the_runtime_sends(shape, chunks):
    schedule = "1f1b" if chunks == 1 else "interleaved"
    assert recorded_sends(schedule, chunks, shape) == predicted_sends(make_plan(schedule, chunks, shape))


def test_unequal_tp_hops_carry_one_copy_across_the_bridge():
    """2 -> 4 and 4 -> 1 (mi250 -> a100 -> mi250, through the bridge): each direction of each hop
    moves one micro-batch's activation once, in pieces, where whole tensors moved one per receiver."""
    plan = make_plan("1f1b", 1, "bridged-unequal-tp")
    p = plan.pipelines[0]
    whole = p.micro_batch_size * plan.seq_len * plan.model.hidden_size * 4
    sent = recorded_sends("1f1b", 1, "bridged-unequal-tp")
    stage_of = {plan.rank_of_device()[d]: i for i, s in enumerate(p.stages) for d in s.devices}
    per_boundary: Counter[tuple[int, int]] = Counter()
    for (s, r, nbytes), count in sent.items():
        per_boundary[(stage_of[s], stage_of[r])] += nbytes * count
    assert per_boundary == {k: whole * p.num_micro_batches for k in [(0, 1), (1, 0), (1, 2), (2, 1)]}
    # the pieces are each receiving rank's share, all-gathered on arrival
    assert {n for (s, r, n) in sent if (stage_of[s], stage_of[r]) == (0, 1)} == {whole // 4}
    assert hop(src_tp=2, src_sp=False, dst_tp=4, dst_sp=False, numel=whole // 4).dest_gathers
