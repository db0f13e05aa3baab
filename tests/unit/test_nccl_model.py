"""The tests' model of NCCL's ordering rules (``_nccl_model``) on hand-written posting orders: it
must find the hangs NCCL has and pass what NCCL runs."""

from __future__ import annotations

import pytest
from _nccl_model import Deadlock, Mismatch, replay

from hethub.comm.recording import Channel, Collective, OpRecord, Post, Wait

NCCL, GLOO = Channel("world", ordered=True), Channel("bridge", ordered=False)
MSG = 1 << 20


class _Rank:
    """Builds one rank's events."""

    def __init__(self) -> None:
        self.events: list = []
        self.n = 0

    def post(self, *ops: tuple[str, int, int], batched: bool = True, channel: Channel = NCCL, nbytes: int = MSG) -> int:
        self.n += 1
        self.events.append(Post(handle=self.n, ops=tuple(OpRecord(op=o, peer=p, tag=t, nbytes=nbytes, channel=channel)
                                                         for o, p, t in ops), batched=batched))
        return self.n

    def wait(self, h: int) -> None:
        self.events.append(Wait(h))

    def coll(self, group: tuple[int, ...], name: str = "all_reduce", nbytes: int = 8) -> None:
        self.n += 1
        self.events.append(Collective(handle=self.n, name=name, group=group, nbytes=nbytes,
                                      channel=Channel(f"group{group}", ordered=True)))
        self.wait(self.n)


def _issue_order(*, batched: bool) -> dict[int, list]:
    """The issue's example: rank 0 posts send(mb0) send(mb2) recv(grad mb1); rank 1 posts recv(mb0)
    send(grad mb1) recv(mb2); each waits for all of it at the end."""
    r0, r1 = _Rank(), _Rank()
    hs0 = [r0.post(("send", 1, 0), batched=batched), r0.post(("send", 1, 4), batched=batched),
           r0.post(("recv", 1, 3), batched=batched)]
    hs1 = [r1.post(("recv", 0, 0), batched=batched), r1.post(("send", 0, 3), batched=batched),
           r1.post(("recv", 0, 4), batched=batched)]
    for h in hs0:
        r0.wait(h)
    for h in hs1:
        r1.wait(h)
    return {0: r0.events, 1: r1.events}


@pytest.mark.parametrize("batched", [False, True])
def test_the_issues_order_hangs_above_the_eager_limit_only(batched):
    with pytest.raises(Deadlock, match="rank 0: blocked"):
        replay(_issue_order(batched=batched), eager_bytes=MSG - 1)
    replay(_issue_order(batched=batched), eager_bytes=MSG)  # buffered sends: what gloo does


def test_one_batch_progresses_together_whatever_its_order():
    r0, r1 = _Rank(), _Rank()
    r0.wait(r0.post(("send", 1, 4), ("recv", 1, 3)))
    r1.wait(r1.post(("recv", 0, 4), ("send", 0, 3)))
    replay({0: r0.events, 1: r1.events})
    # The same operations as two lone posts each, sends first on both sides, hang.
    r0, r1 = _Rank(), _Rank()
    hs = [r0.post(("send", 1, 4), batched=False), r0.post(("recv", 1, 3), batched=False)]
    ht = [r1.post(("send", 0, 3), batched=False), r1.post(("recv", 0, 4), batched=False)]
    for h, t in zip(hs, ht, strict=True):
        r0.wait(h)
        r1.wait(t)
    with pytest.raises(Deadlock):
        replay({0: r0.events, 1: r1.events})


def test_batches_on_one_communicator_run_one_after_the_other():
    # Rank 1's first batch waits on rank 2, which first needs rank 1's second batch: on one stream
    # the second batch cannot overtake the first.
    r0, r1, r2 = _Rank(), _Rank(), _Rank()
    r1.post(("recv", 2, 1))
    r1.wait(r1.post(("send", 2, 2)))
    r2.wait(r2.post(("recv", 1, 2)))
    r2.wait(r2.post(("send", 1, 1)))
    with pytest.raises(Deadlock):
        replay({0: r0.events, 1: r1.events, 2: r2.events})


def test_a_wait_blocks_the_rank():
    r0, r1 = _Rank(), _Rank()
    r0.wait(r0.post(("recv", 1, 0)))  # waits before posting the send rank 1 waits for
    r0.wait(r0.post(("send", 1, 1)))
    r1.wait(r1.post(("recv", 0, 1)))
    r1.wait(r1.post(("send", 0, 0)))
    with pytest.raises(Deadlock):
        replay({0: r0.events, 1: r1.events}, eager_bytes=1 << 40)


def test_collectives_need_every_member_in_the_same_order():
    r0, r1 = _Rank(), _Rank()
    r0.coll((0, 1))
    with pytest.raises(Deadlock):
        replay({0: r0.events, 1: r1.events})
    r1.coll((0, 1))
    replay({0: r0.events, 1: r1.events})
    r0.coll((0, 1), name="all_gather")
    r1.coll((0, 1), name="all_reduce")
    with pytest.raises(Mismatch):
        replay({0: r0.events, 1: r1.events})


def test_nccl_pairs_by_order_not_tag():
    r0, r1 = _Rank(), _Rank()
    r0.wait(r0.post(("send", 1, 0), ("send", 1, 2)))
    r1.wait(r1.post(("recv", 0, 2), ("recv", 0, 0)))
    with pytest.raises(Mismatch, match="issue order"):
        replay({0: r0.events, 1: r1.events})


def test_gloo_matches_by_tag_and_needs_no_order():
    r0, r1 = _Rank(), _Rank()
    hs = [r0.post(("send", 1, 0), batched=False, channel=GLOO), r0.post(("send", 1, 4), batched=False, channel=GLOO),
          r0.post(("recv", 1, 3), batched=False, channel=GLOO)]
    ht = [r1.post(("recv", 0, 0), batched=False, channel=GLOO), r1.post(("send", 0, 3), batched=False, channel=GLOO),
          r1.post(("recv", 0, 4), batched=False, channel=GLOO)]
    for h in hs:
        r0.wait(h)
    for h in ht:
        r1.wait(h)
    replay({0: r0.events, 1: r1.events})
    # A receive that is never posted leaves the send incomplete.
    r2 = _Rank()
    r2.post(("send", 0, 9), channel=GLOO)
    with pytest.raises(Deadlock, match="never complete"):
        replay({0: [], 2: r2.events})
