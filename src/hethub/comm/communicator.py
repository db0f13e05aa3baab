"""The one seam through which the runtime communicates.

Everything the runtime sends or reduces goes through :class:`Communicator`: point-to-point
activations, gradient all-reduces, TP all-reduce/all-gather, and small object gathers for metrics.
This implementation uses plain ``torch.distributed`` over the groups it is given (gloo on CPU).
A later bridge for p2p/all-reduce across device kinds replaces it behind the same methods, so the
runtime never names a backend.

Groups are identified by their sorted rank tuple and a *channel* (default ""): the same ranks on
another channel are another process group, whose collectives are ordered apart (ZeRO-3 gathers the
forward's and the backward's parameters on two channels, runtime/zero_params.py). ``create_groups``
must be called on every rank with the same list in the same order (``new_group`` is collective over
the world).

Pipeline messages run on *lanes*: one communicator per direction of a rank pair and per message
kind (``layout.Topology.p2p_lanes``, ``create_p2p_lanes``). NCCL runs each communicator's operations
in issue order on a stream of its own, so a lane carries one ordered stream of messages whose sends
and receives the two ends post in the same order, and nothing on another lane can queue ahead of
them: a forward send never waits behind a backward receive (docs/communicator.md).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from hethub.comm.recording import Channel
from hethub.comm.reduce_scatter import reduce_scatter_into
from hethub.islands import HOST_BACKENDS

GroupKey = tuple[int, ...]
# (source rank, destination rank, message kind): one direction of one rank pair's messages of a kind.
Lane = tuple[int, int, str]


class _Done:
    """A started operation that had nothing to do (a group of one)."""

    def wait(self) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


DONE = _Done()


def group_name(key: GroupKey, *, world_size: int) -> str:
    """The name of the communicator a group's operations run on ("world" for every rank)."""
    return "world" if len(key) == world_size else f"group{key}"


def lane_name(src: int, dst: int, lane: str) -> str:
    """The name of the communicator of a lane (what a recording's channel carries)."""
    return f"lane{src}>{dst}.{lane}"


class Communicator:
    def __init__(self, *, timeout: timedelta | None = None) -> None:
        if not dist.is_initialized():
            raise RuntimeError("Communicator needs torch.distributed initialised first (init_process_group)")
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self._timeout = timeout
        self._groups: dict[GroupKey, Any] = {}
        self._lanes: dict[Lane, Any] = {}

    # ---- groups ----------------------------------------------------------------------------------
    def create_groups(self, groups: Iterable[Sequence[int]], *, channel: str = "") -> None:
        for ranks in groups:
            key = tuple(sorted(ranks))
            if (key, channel) in self._groups:
                continue
            if len(key) == self.world_size and not channel:
                self._groups[(key, channel)] = None  # the default group; a copy would only cost a new gloo context
            else:
                kw = {"timeout": self._timeout} if self._timeout else {}
                self._groups[(key, channel)] = dist.new_group(ranks=list(key), **kw)

    def create_p2p_lanes(self, lanes: Iterable[Lane]) -> None:
        """A communicator (a process group of the two ranks) for each lane. Call on every rank with the
        same list in the same order, like :meth:`create_groups`."""
        for lane in lanes:
            if lane not in self._lanes:
                self._lanes[lane] = self._new_lane(lane)

    def _new_lane(self, lane: Lane) -> Any:
        """A lane is its two ranks' group on a channel of its own (``create_groups``)."""
        self.create_groups([lane[:2]], channel=lane_name(*lane))
        return self._pg(lane[:2], channel=lane_name(*lane))

    def _lane_pg(self, src: int, dst: int, lane: str | None) -> Any:
        """The process group of a lane; None (the default group) when ``lane`` is None."""
        if lane is None:
            return None
        try:
            return self._lanes[(src, dst, lane)]
        except KeyError:
            raise RuntimeError(f"p2p lane {src}->{dst} {lane!r} was not created. Fix: list it in create_p2p_lanes "
                               "on every rank (layout.Topology.p2p_lanes).") from None

    def _pg(self, group: Sequence[int] | None, channel: str = "") -> Any:
        if group is None:
            return None
        key = tuple(sorted(group))
        if len(key) == self.world_size and not channel:
            return None
        try:
            return self._groups[(key, channel)]
        except KeyError:
            raise RuntimeError(f"group {key} (channel {channel!r}) was not created; list it in create_groups on "
                               "every rank") from None

    # ---- point to point --------------------------------------------------------------------------
    def isend(self, tensor: torch.Tensor, *, dst: int, tag: int, lane: str | None = None) -> Any:
        """Non-blocking send; the caller keeps ``tensor`` alive and waits on the returned work.
        ``lane``: the message kind whose lane to ``dst`` carries it (None: the default group)."""
        return dist.isend(tensor.contiguous(), dst=dst, tag=tag, group=self._lane_pg(self.rank, dst, lane))

    def recv(self, tensor: torch.Tensor, *, src: int, tag: int) -> torch.Tensor:
        dist.recv(tensor, src=src, tag=tag)
        return tensor

    def p2p_channel(self, src: int, dst: int, *, device: torch.device, lane: str | None = None) -> Channel:
        """The communicator a message from ``src`` to ``dst`` runs on, and its ordering rule (what a
        recording of this rank's posts carries: ``comm/recording.py``)."""
        del device
        name = group_name(tuple(range(self.world_size)), world_size=self.world_size) if lane is None else \
            lane_name(src, dst, lane)
        return Channel(name, ordered=str(dist.get_backend()) not in HOST_BACKENDS)

    def send_completes_alone(self, dst: int, *, device: torch.device, lane: str | None = None) -> bool:
        """Whether a send to ``dst`` reports its completion by itself: ``Work.is_completed`` turns
        true once the transfer is over, as under a device's collective library (NCCL queries the
        send's event), rather than only once waited on (gloo marks its send works complete in
        ``wait``). The same split as the channel's ordering rule: a native device group, or gloo."""
        return self.p2p_channel(self.rank, dst, device=device, lane=lane).ordered

    def group_channel(self, group: Sequence[int]) -> Channel:
        """The communicator collectives over ``group`` run on. Every backend runs one group's
        collectives in the order they were issued, each needing every member."""
        return Channel(group_name(tuple(sorted(group)), world_size=self.world_size), ordered=True)

    def irecv(self, tensor: torch.Tensor, *, src: int, tag: int, lane: str | None = None) -> Any:
        """Non-blocking receive into ``tensor``: posted early, the transfer overlaps the caller's work
        (a late blocking recv waits for a handshake with a sender that may be busy computing)."""
        return dist.irecv(tensor, src=src, tag=tag, group=self._lane_pg(src, self.rank, lane))

    # ---- collectives -----------------------------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor, *, group: Sequence[int] | None = None,
                   op: str = "sum") -> torch.Tensor:
        """In-place all-reduce over ``group`` (None: all ranks). ``op``: sum or max."""
        if group is not None and len(group) == 1:
            return tensor
        rop = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op]
        dist.all_reduce(tensor, op=rop, group=self._pg(group))
        return tensor

    def start_all_reduce(self, tensor: torch.Tensor, *, group: Sequence[int]) -> Any:
        """Start an in-place sum over ``group`` without waiting; returns an object whose ``wait()``
        completes it (on a GPU backend: makes the current stream wait, no host sync). Used by the
        gradient sync to reduce buckets while the backward runs; a rank waits on what it started in
        the order it started it."""
        if len(group) == 1:
            return DONE
        return dist.all_reduce(tensor, group=self._pg(group), async_op=True)

    def start_reduce(self, tensor: torch.Tensor, *, group: Sequence[int], dst: int, eager: bool = False) -> Any:
        """Start a sum of a contiguous ``tensor`` over ``group`` onto rank ``dst`` (in place there; the
        others' tensors may be used as scratch), as :meth:`start_all_reduce`: ZeRO-1's reduction of a
        bucket's piece to the piece's owner. ``eager``: every step of it posted now, so that members
        may wait for it at different points (ZeRO-2's rounds; a bridge's concern, one collective here)."""
        del eager
        if len(group) == 1:
            return DONE
        return dist.reduce(tensor, dst=dst, group=self._pg(group), async_op=True)

    def start_broadcast(self, tensor: torch.Tensor, *, group: Sequence[int], src: int, channel: str = "") -> Any:
        """Start copying member ``src``'s contiguous ``tensor`` into every member's, as
        :meth:`start_all_reduce`: ZeRO-3's gather of a layer's parameters, one broadcast per owner of
        a part of them (unequal parts need no padding)."""
        if len(group) == 1:
            return DONE
        return dist.broadcast(tensor, src=src, group=self._pg(group, channel), async_op=True)

    def reduce_scatter(self, tensor: torch.Tensor, *, group: Sequence[int],
                       sizes: Sequence[int] | None = None) -> torch.Tensor:
        """Sum ``tensor`` (1-D, ``len(group)`` equal chunks) over ``group``; return this member's chunk
        (the i-th in ascending rank order), a new tensor. Uneven shards pad their chunks (the caller);
        ``sizes`` (each member's real chunk length) lets a bridge leave the padding out of its
        messages; a native collective moves the padded chunks."""
        del sizes
        key = sorted(group)
        if len(key) == 1:
            return tensor
        out = torch.empty(tensor.numel() // len(key), dtype=tensor.dtype, device=tensor.device)
        reduce_scatter_into(out, tensor.contiguous(), group=self._pg(group))
        return out

    def all_gather(self, tensor: torch.Tensor, *, group: Sequence[int], dim: int = 0,
                   sizes: Sequence[int] | None = None) -> torch.Tensor:
        """Concatenate every member's ``tensor`` along ``dim``, in ascending rank order. ``sizes``: as
        for :meth:`reduce_scatter`, for 1-D padded chunks (what lies past a member's size may then
        come back as zeros)."""
        del sizes
        if len(group) == 1:
            return tensor
        parts = [torch.empty_like(tensor) for _ in group]
        dist.all_gather(parts, tensor.contiguous(), group=self._pg(group))
        return torch.cat(parts, dim=dim)

    def gather_objects(self, obj: Any, *, dst: int) -> list[Any] | None:
        """Picklable objects from every rank, on ``dst`` only (rank order); None elsewhere."""
        out: list[Any] | None = [None] * self.world_size if self.rank == dst else None
        dist.gather_object(obj, out, dst=dst)
        return out

    def barrier(self) -> None:
        dist.barrier()
