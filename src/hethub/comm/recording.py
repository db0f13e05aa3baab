"""Record the communication a rank posts, in the order it posts it, through the Communicator seam.

:class:`RecordingCommunicator` wraps any communicator (a real one, or a stand-in that never blocks)
and logs every point-to-point post, batch, wait and collective as plain records, then forwards the
call. The records are what a model of a backend's ordering rules replays (the tests' model of NCCL:
``tests/unit/_nccl_model.py``): whether a pipeline can hang is decided by the order each rank
*posts* its operations, which the recording captures exactly, whatever the transport underneath
did with them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Channel:
    """The communicator an operation runs on, and how that communicator orders its operations.

    ``ordered``: NCCL's rule (a rank's operations on one communicator run in the order it issued
    them, one stream each; sends and receives match in that order, whatever their tags). False:
    gloo's (each operation progresses on its own; sends and receives match by peer and tag)."""

    name: str
    ordered: bool


@dataclass(frozen=True)
class OpRecord:
    """One point-to-point operation: ``op`` is "send" or "recv"; ``peer`` the other rank."""

    op: str
    peer: int
    tag: int
    nbytes: int
    channel: Channel


@dataclass(frozen=True)
class Post:
    """Point-to-point operations posted together. ``batched``: one ``batch_isend_irecv`` (under NCCL
    one group on the communicator of ``channel``, whose operations progress together); otherwise a
    lone isend or irecv (under NCCL on the communicator of its rank pair)."""

    handle: int
    ops: tuple[OpRecord, ...]
    batched: bool


@dataclass(frozen=True)
class Collective:
    """A collective over ``group`` (sorted ranks), posted on ``channel``."""

    handle: int
    name: str
    group: tuple[int, ...]
    nbytes: int
    channel: Channel


@dataclass(frozen=True)
class Wait:
    """The rank blocks until every operation posted under ``handle`` has completed."""

    handle: int


@dataclass(frozen=True)
class Note:
    """A label the caller adds between posts (a test marks where each op computes); no operation."""

    label: str


Event = Post | Collective | Wait | Note


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class _RecordedWork:
    def __init__(self, work: Any, *, log: RecordingCommunicator, handle: int) -> None:
        self.work, self.log, self.handle = work, log, handle

    def wait(self, *args: Any) -> Any:
        self.log.events.append(Wait(self.handle))
        return self.work.wait(*args)

    def is_completed(self) -> bool:
        return bool(self.work.is_completed())


class RecordingCommunicator:
    """``inner`` with every post, batch, wait and collective appended to ``events`` before it runs.

    Synchronous collectives are recorded as a :class:`Collective` then a :class:`Wait` on it (the
    caller blocks on the result). The channel of each operation is the inner communicator's
    (``p2p_channel``, ``group_channel``). Anything else is forwarded unrecorded."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.events: list[Event] = []
        self._next = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def _handle(self) -> int:
        self._next += 1
        return self._next

    def _op(self, op: str, tensor: torch.Tensor, peer: int, tag: int, lane: str | None) -> OpRecord:
        src, dst = (self.inner.rank, peer) if op == "send" else (peer, self.inner.rank)
        return OpRecord(op=op, peer=peer, tag=tag, nbytes=_nbytes(tensor),
                        channel=self.inner.p2p_channel(src, dst, device=tensor.device, lane=lane))

    def _post(self, ops: Iterable[OpRecord], *, batched: bool) -> int:
        h = self._handle()
        self.events.append(Post(handle=h, ops=tuple(ops), batched=batched))
        return h

    def _started(self, name: str, tensor: torch.Tensor, group: Sequence[int] | None) -> int | None:
        """Record a collective's start; its handle (None for a group of one: nothing runs)."""
        key = tuple(sorted(range(self.inner.world_size) if group is None else group))
        if len(key) == 1:
            return None
        h = self._handle()
        self.events.append(Collective(handle=h, name=name, group=key, nbytes=_nbytes(tensor),
                                      channel=self.inner.group_channel(key)))
        return h

    def _collective(self, name: str, tensor: torch.Tensor, group: Sequence[int] | None) -> None:
        h = self._started(name, tensor, group)
        if h is not None:
            self.events.append(Wait(h))

    # ---- point to point --------------------------------------------------------------------------
    def isend(self, tensor: torch.Tensor, *, dst: int, tag: int, lane: str | None = None) -> _RecordedWork:
        h = self._post([self._op("send", tensor, dst, tag, lane)], batched=False)
        return _RecordedWork(self.inner.isend(tensor, dst=dst, tag=tag, lane=lane), log=self, handle=h)

    def irecv(self, tensor: torch.Tensor, *, src: int, tag: int, lane: str | None = None) -> _RecordedWork:
        h = self._post([self._op("recv", tensor, src, tag, lane)], batched=False)
        return _RecordedWork(self.inner.irecv(tensor, src=src, tag=tag, lane=lane), log=self, handle=h)

    def recv(self, tensor: torch.Tensor, *, src: int, tag: int) -> torch.Tensor:
        self.irecv(tensor, src=src, tag=tag).wait()
        return tensor

    # ---- collectives -----------------------------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor, *, group: Sequence[int] | None = None, op: str = "sum") -> torch.Tensor:
        self._collective(f"all_reduce.{op}", tensor, group)
        return self.inner.all_reduce(tensor, group=group, op=op)

    def start_all_reduce(self, tensor: torch.Tensor, *, group: Sequence[int]) -> Any:
        """An asynchronous all-reduce: recorded when started, its wait when waited."""
        h = self._started("all_reduce.sum", tensor, group)
        work = self.inner.start_all_reduce(tensor, group=group)
        return work if h is None else _RecordedWork(work, log=self, handle=h)

    def start_reduce(self, tensor: torch.Tensor, *, group: Sequence[int], dst: int) -> Any:
        h = self._started(f"reduce.{dst}", tensor, group)
        work = self.inner.start_reduce(tensor, group=group, dst=dst)
        return work if h is None else _RecordedWork(work, log=self, handle=h)

    def all_gather(self, tensor: torch.Tensor, *, group: Sequence[int], dim: int = 0,
                   sizes: Sequence[int] | None = None) -> torch.Tensor:
        self._collective("all_gather", tensor, group)
        return self.inner.all_gather(tensor, group=group, dim=dim, sizes=sizes)

    def reduce_scatter(self, tensor: torch.Tensor, *, group: Sequence[int],
                       sizes: Sequence[int] | None = None) -> torch.Tensor:
        self._collective("reduce_scatter", tensor, group)
        return self.inner.reduce_scatter(tensor, group=group, sizes=sizes)
