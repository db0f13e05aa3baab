"""The bridge's transport: the one seam between hethub's cross-vendor path and the library that moves
bytes between vendors.

The bridge (``comm/bridge.py``, ``comm/hierarchical.py``) decides *what* crosses between islands
(which rank sends which piece, which leader reduces what, where host copies are staged); a
:class:`Transport` only moves buffers between ranks of different islands. Today that is gloo over
TCP (:class:`GlooTransport`, the tested default); a cross-vendor collective library (BAAI's FlagCX,
UCC, an RDMA verbs layer) plugs in here, registered by name in ``comm/transport_choice.py``, without
touching schedules, groups or the runtime.

What a transport must provide (docs/communicator.md, "The transport seam"):

* ``group(ranks, channel)``: a handle for a set of world ranks. Called in the same order with the
  same arguments on every rank of the world (members or not), so a library whose group creation
  is collective over the world (torch's ``new_group``) can create it there. A different
  ``channel`` is a different handle over the same ranks, whose operations are ordered apart.
* ``isend(buf, dst, tag, group)`` / ``irecv(buf, src, tag, group)``: asynchronous point-to-point
  of a contiguous buffer, returning a work with ``wait()`` and ``is_completed()``. Messages between
  one pair with one tag are received in the order they were sent; messages with different tags
  never block each other (the pipeline's lanes and the reductions' tags rely on it). ``buf`` stays
  untouched by the caller until ``wait()`` returns.
* ``all_reduce(buf, op, group)``: an asynchronous in-place reduction (``dist.ReduceOp.SUM`` and
  ``MAX``) over the group's members, every member ending with identical values.
* ``caps``: :class:`TransportCaps`, what memory it reads directly (others are staged through
  host buffers by the bridge) and what it is called in logs and links profiles.

Nothing else: the control plane (barriers, object gathers, the world's rendezvous) stays on
torch.distributed, and the native collectives inside each island stay on the island's library.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TransportCaps:
    """What the bridge may rely on. ``device_types``: the torch device types whose memory the
    transport reads and writes directly (gloo: host memory only); a tensor elsewhere is staged
    through a host buffer. ``name``: how logs, ``describe()`` and links profiles name the path."""

    name: str
    device_types: frozenset[str] = frozenset({"cpu"})


class Work(Protocol):
    def wait(self, timeout: Any = None) -> Any: ...

    def is_completed(self) -> bool: ...


class Transport(Protocol):
    caps: TransportCaps

    def group(self, ranks: Sequence[int], *, channel: str = "") -> Any: ...

    def isend(self, buf: torch.Tensor, *, dst: int, tag: int, group: Any) -> Work: ...

    def irecv(self, buf: torch.Tensor, *, src: int, tag: int, group: Any) -> Work: ...

    def all_reduce(self, buf: torch.Tensor, *, op: Any, group: Any) -> Work: ...


class GlooTransport:
    """gloo over TCP through torch.distributed: every vendor's torch build has it, and it reads host
    memory (so device tensors are staged). Groups come from the bridge's ``GroupMaker`` (created in
    one order on every rank; the world is torch's default group when the world's backend is gloo)."""

    caps = TransportCaps(name="gloo")

    def __init__(self, make_group: Callable[[Sequence[int], str, str], Any]) -> None:
        self._make_group = make_group

    def group(self, ranks: Sequence[int], *, channel: str = "") -> Any:
        return self._make_group(ranks, "gloo", channel)

    def isend(self, buf: torch.Tensor, *, dst: int, tag: int, group: Any) -> Work:
        return dist.isend(buf, dst=dst, tag=tag, group=group)

    def irecv(self, buf: torch.Tensor, *, src: int, tag: int, group: Any) -> Work:
        return dist.irecv(buf, src=src, tag=tag, group=group)

    def all_reduce(self, buf: torch.Tensor, *, op: Any, group: Any) -> Work:
        return dist.all_reduce(buf, op=op, group=group, async_op=True)
