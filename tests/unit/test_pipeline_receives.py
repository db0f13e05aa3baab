"""Receives posted ahead in the pipeline executor, and the per-peer order NCCL-like backends need."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from hethub.layout import WHOLE
from hethub.runtime.pipeline import StepTrace, _Receives, bwd_tag, fwd_tag
from hethub.schedules import SCHEDULES, get_schedule

STAGES, MICRO = 4, 6


class FakeComm:
    """Records each rank's point-to-point posts, per peer, in the order they are made."""

    def __init__(self, *, ordered: bool) -> None:
        self.ordered = ordered
        self.log: dict[int, list[tuple[str, int]]] = {}

    def p2p_in_issue_order(self, peer: int, *, device: torch.device) -> bool:
        return self.ordered

    def irecv(self, tensor: torch.Tensor, *, src: int, tag: int) -> SimpleNamespace:
        self.log.setdefault(src, []).append(("recv", tag))
        return SimpleNamespace(wait=lambda: True)


def _executor(stage: int, schedule: str, comm: FakeComm) -> SimpleNamespace:
    place = SimpleNamespace(fwd_recv_from=stage - 1, bwd_recv_from=stage + 1,
                            fwd_send_to=(stage + 1,), bwd_send_to=(stage - 1,), split_in=False, split_out=False)
    ops = get_schedule(schedule).ops(stage=stage, num_stages=STAGES, num_micro_batches=MICRO)
    return SimpleNamespace(ops=ops,
                           first=stage == 0, last=stage == STAGES - 1, place=place, comm=comm, act_shape=(1,),
                           act_dtype=torch.float32, in_dtype=torch.float32, out_dtype=torch.float32,
                           device=torch.device("cpu"), hop_into=lambda op, chunk: WHOLE,
                           messages=SimpleNamespace(recv_shape=lambda hop: (1,), arrived=lambda buf, hop: buf))


def _posts(stage: int, schedule: str, *, ordered: bool, lookahead: int) -> tuple[dict, list[int]]:
    """Per peer, the receives and sends one stage posts, in order; and for each op, how many ops
    ahead of it its receive was posted."""
    comm = FakeComm(ordered=ordered)
    ex = _executor(stage, schedule, comm)
    recvs = _Receives(ex, lookahead=lookahead)  # type: ignore[arg-type]
    ahead = []
    for i, (op, mb, _chunk) in enumerate(ex.ops):
        before = recvs.next
        recvs.take(i, StepTrace())
        ahead.append(before)
        sends = () if (op == "F" and ex.last) or (op == "B" and ex.first) else recvs._sends_to(i)
        for peer in sends:
            comm.log.setdefault(peer, []).append(("send", fwd_tag(mb) if op == "F" else bwd_tag(mb)))
    return comm.log, ahead


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("stage", range(STAGES))
def test_ordered_backends_keep_each_peers_order_exactly(schedule, stage):
    # NCCL runs a pair's messages in the order posted: posting a receive before a send the peer needs
    # first would deadlock. The order must be that of receiving at each op's start.
    plain, _ = _posts(stage, schedule, ordered=False, lookahead=0)
    ordered, _ = _posts(stage, schedule, ordered=True, lookahead=2)
    assert ordered == plain


def test_tag_matched_backends_post_receives_ahead():
    plain, _ = _posts(1, "1f1b", ordered=False, lookahead=0)
    ahead, posted_at = _posts(1, "1f1b", ordered=False, lookahead=2)
    assert ahead != plain  # some receive now precedes an earlier op's send to the same peer
    # Every receive is posted, and each one exactly once.
    assert sorted(ahead[0]) == sorted(plain[0]) and sorted(ahead[2]) == sorted(plain[2])
    assert max(posted_at) <= len(posted_at)
