"""Host staging of the bridge's point-to-point messages: device-to-host copies on a side stream into
pinned buffers, sent in chunks so that copying chunk k+1 overlaps sending chunk k; the receiver
copies each chunk onto its device as it lands. The compute stream never waits on the host: the side
stream waits for the compute stream's work so far (a device-side wait), the host waits only for the
side stream's copies before handing a chunk to the transport, and the compute stream waits for the
receive's last copy device-side. On a device type without streams (the CPU) the same code runs with
the copies as plain memory copies.

The per-device-type capabilities live in :data:`STAGING` (one small table); a device type not in it
is staged through pageable memory with blocking copies, which is always correct.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Protocol

import torch

from hethub.comm.transport import Transport

KIB = 1024
# Chunks of at least this size (smaller ones pay the transport's per-message cost more than the
# overlap saves) and at most this many per message (each is a message of its own on the transport).
MIN_CHUNK_BYTES = 256 * KIB
MAX_CHUNKS = 8
WHOLE = 1 << 62  # a min_chunk_bytes that never cuts a message


@dataclass(frozen=True)
class DeviceStaging:
    """How to stage a device type's tensors: ``pin``: host buffers are pinned (page-locked), which the
    device's copy engine reads and writes asynchronously; ``streams``: copies run on a side stream
    (``torch.get_device_module(type)`` has ``Stream``, ``Event``, ``current_stream``, ``stream``)."""

    pin: bool
    streams: bool


# Device types whose torch extension supports pinned host memory and streams: CUDA (and ROCm, which
# torch calls cuda), Ascend's torch_npu, Intel's xpu, Moore Threads' torch_musa all implement
# pin_memory for their device and a CUDA-like stream module. The CPU needs neither.
STAGING: dict[str, DeviceStaging] = {
    "cpu": DeviceStaging(pin=False, streams=False),
    "cuda": DeviceStaging(pin=True, streams=True),
    "npu": DeviceStaging(pin=True, streams=True),
    "xpu": DeviceStaging(pin=True, streams=True),
    "musa": DeviceStaging(pin=True, streams=True),
}
UNKNOWN = DeviceStaging(pin=False, streams=False)


def staging_of(device: torch.device | str) -> DeviceStaging:
    return STAGING.get(device if isinstance(device, str) else device.type, UNKNOWN)


def pair_chunk_bytes(a: str, b: str) -> int:
    """The smallest chunk between ranks on device types ``a`` and ``b`` (both ends compute the same):
    chunks where either end copies on a side stream, whose copy engine then runs while the host
    sends; between two host ranks the copies and the sends share the same cores, so messages go
    whole."""
    return MIN_CHUNK_BYTES if staging_of(a).streams or staging_of(b).streams else WHOLE


def chunk_bounds(numel: int, element_size: int, *, min_chunk_bytes: int = MIN_CHUNK_BYTES) -> list[tuple[int, int]]:
    """The (start, end) element ranges a message of ``numel`` elements is sent in: the same on both
    ends, from the message's size (and the communicator's ``min_chunk_bytes``) alone."""
    nbytes = numel * element_size
    chunks = max(1, min(MAX_CHUNKS, nbytes // max(1, min_chunk_bytes)))
    step = -(-numel // chunks)
    return [(s, min(numel, s + step)) for s in range(0, numel, step)] or [(0, 0)]


class Streams(Protocol):
    """What staging needs of a device's stream API (a fake in the tests records what runs where)."""

    def current(self, device: torch.device) -> Any: ...

    def side(self, device: torch.device) -> Any: ...

    def use(self, stream: Any) -> Any: ...  # context manager: kernels issued inside run on ``stream``

    def record(self, stream: Any) -> Any: ...  # an event recorded on ``stream`` now

    def wait_event(self, stream: Any, event: Any) -> None: ...  # device-side: ``stream`` waits for ``event``

    def host_wait(self, event: Any) -> None: ...  # the host thread waits for ``event``

    def done(self, event: Any) -> bool: ...

    def keep(self, tensor: torch.Tensor, stream: Any) -> None: ...  # allocator: ``stream`` still uses it


class TorchStreams:
    """:class:`Streams` over ``torch.get_device_module(device.type)``; one side stream per device."""

    def __init__(self) -> None:
        self._side: dict[torch.device, Any] = {}

    def _mod(self, device: torch.device) -> Any:
        return torch.get_device_module(device.type)

    def current(self, device: torch.device) -> Any:
        return self._mod(device).current_stream(device)

    def side(self, device: torch.device) -> Any:
        if device not in self._side:
            self._side[device] = self._mod(device).Stream(device)
        return self._side[device]

    @contextmanager
    def use(self, stream: Any) -> Iterator[None]:
        with torch.get_device_module(stream.device.type).stream(stream):
            yield

    def record(self, stream: Any) -> Any:
        return stream.record_event()

    def wait_event(self, stream: Any, event: Any) -> None:
        stream.wait_event(event)

    def host_wait(self, event: Any) -> None:
        event.synchronize()

    def done(self, event: Any) -> bool:
        return bool(event.query())

    def keep(self, tensor: torch.Tensor, stream: Any) -> None:
        tensor.record_stream(stream)


class HostPool:
    """Reusable host staging buffers, taken for one transfer and given back when it is done.

    Fresh host allocations are slow (pinned ones very slow; even pageable ones pay a page fault per
    4 KiB on first touch, which on a small VM costs more than the copy itself), and the same sizes
    recur every step (activations, gradient buckets). Memory held: one buffer per size per transfer
    in flight at once. A buffer given back with an event (a device copy still reading or writing
    it) is reused only once the event has completed.
    """

    def __init__(self, streams: Streams | None = None) -> None:
        self._free: dict[tuple[torch.dtype, int, bool], list[torch.Tensor]] = {}
        self._pending: list[tuple[tuple[torch.dtype, int, bool], torch.Tensor, Any]] = []
        self.streams = streams

    @staticmethod
    def _key(like: torch.Tensor) -> tuple[torch.dtype, int, bool]:
        return (like.dtype, like.numel(), staging_of(like.device).pin)

    def take(self, like: torch.Tensor) -> torch.Tensor:
        """A 1-D host buffer with ``like``'s dtype and number of elements (pinned where ``like``'s
        device type supports it, :data:`STAGING`)."""
        if self._pending and self.streams is not None:
            still = []
            for key, buf, event in self._pending:
                if self.streams.done(event):
                    self._free.setdefault(key, []).append(buf)
                else:
                    still.append((key, buf, event))
            self._pending = still
        key = self._key(like)
        free = self._free.get(key)
        if free:
            return free.pop()
        return torch.empty(like.numel(), dtype=like.dtype, device="cpu", pin_memory=key[2])

    def give(self, buf: torch.Tensor, *, like: torch.Tensor, event: Any = None) -> None:
        """Return ``buf``, taken for ``like``, once nothing reads or writes it any more (or once
        ``event`` completes)."""
        if event is None:
            self._free.setdefault(self._key(like), []).append(buf)
        else:
            self._pending.append((self._key(like), buf, event))


@dataclass
class Works:
    """The chunks of an unstaged message: done when all are."""

    works: list[Any]

    def wait(self, timeout: timedelta | None = None) -> bool:
        for w in self.works:
            w.wait(timeout) if timeout is not None else w.wait()
        return True

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self.works)


def direct_send(data: torch.Tensor, *, dst: int, tag: int, group: Any, transport: Transport,
                min_chunk_bytes: int = MIN_CHUNK_BYTES) -> Any:
    """Send contiguous ``data`` the transport reads in place, in the same chunks a staged message
    of its size has (the receiver may stage)."""
    flat = data.view(-1)
    bounds = chunk_bounds(flat.numel(), flat.element_size(), min_chunk_bytes=min_chunk_bytes)
    if len(bounds) == 1:  # a whole message (host pairs): the transport's own work, nothing around it
        return transport.isend(flat, dst=dst, tag=tag, group=group)
    return Works([transport.isend(flat[s:e], dst=dst, tag=tag, group=group) for s, e in bounds])


def direct_recv(tensor: torch.Tensor, *, src: int, tag: int, group: Any, transport: Transport,
                min_chunk_bytes: int = MIN_CHUNK_BYTES) -> Any:
    """Receive into contiguous ``tensor`` in place, chunk by chunk (:func:`direct_send`)."""
    flat = tensor.view(-1)
    bounds = chunk_bounds(flat.numel(), flat.element_size(), min_chunk_bytes=min_chunk_bytes)
    if len(bounds) == 1:
        return transport.irecv(flat, src=src, tag=tag, group=group)
    return Works([transport.irecv(flat[s:e], src=src, tag=tag, group=group) for s, e in bounds])


@dataclass
class StagedWork:
    """A bridged isend or irecv staged through a pooled host buffer in chunks. A send's chunks are
    on the transport when it is created; a receive's are posted then, and ``wait()`` copies each
    onto the caller's tensor as it lands. Either way the host buffer goes back to the pool."""

    works: list[Any]
    host: torch.Tensor | None
    like: torch.Tensor
    pool: HostPool
    bounds: list[tuple[int, int]] = field(default_factory=list)
    recv_into: torch.Tensor | None = None
    streams: Streams | None = None  # set where the receive's copies run on a side stream

    def wait(self, timeout: timedelta | None = None) -> bool:
        if self.host is None:
            return True
        if self.recv_into is None:
            for w in self.works:
                w.wait(timeout) if timeout is not None else w.wait()
            self.pool.give(self.host, like=self.like)
            self.host = None
            return True
        host, device = self.host, self.recv_into.device
        if not self.recv_into.is_contiguous():  # rare (the runtime receives into fresh buffers): one copy
            for w in self.works:
                w.wait(timeout) if timeout is not None else w.wait()
            self.recv_into.copy_(host.view(self.recv_into.shape))
            self.pool.give(host, like=self.like)
            self.host = None
            return True
        dst = self.recv_into.view(-1)
        side = self.streams.side(device) if self.streams is not None else None
        for w, (s, e) in zip(self.works, self.bounds, strict=True):
            w.wait(timeout) if timeout is not None else w.wait()
            if side is None:
                dst[s:e].copy_(host[s:e])  # plain copy: done when it returns
            else:
                assert self.streams is not None
                with self.streams.use(side):
                    dst[s:e].copy_(host[s:e], non_blocking=True)  # lands while later chunks arrive
        event = None
        if side is not None:
            assert self.streams is not None
            event = self.streams.record(side)
            # Device-side: the compute stream's next kernels read the tensor after the copies; the
            # host does not wait.
            self.streams.wait_event(self.streams.current(device), event)
        self.pool.give(host, like=self.like, event=event)
        self.host = None
        return True

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self.works)


def _side_streams(device: torch.device, streams: Streams | None, staging: DeviceStaging | None) -> Streams | None:
    return streams if streams is not None and (staging or staging_of(device)).streams else None


def staged_send(data: torch.Tensor, *, dst: int, tag: int, group: Any, transport: Transport, pool: HostPool,
                streams: Streams | None, staging: DeviceStaging | None = None,
                min_chunk_bytes: int = MIN_CHUNK_BYTES) -> StagedWork:
    """Send contiguous ``data`` through a host buffer in chunks (:func:`chunk_bounds`). With streams,
    every chunk's device-to-host copy is issued on the side stream after the compute stream's work
    so far, and each chunk goes to the transport once its copy has landed, while later copies run;
    without, each chunk is copied and handed over in turn (the transport sends it meanwhile).
    ``staging``: the device type's row of :data:`STAGING` (looked up by default)."""
    flat = data.view(-1)
    host = pool.take(flat)
    bounds = chunk_bounds(flat.numel(), flat.element_size(), min_chunk_bytes=min_chunk_bytes)
    works = []
    streams = _side_streams(data.device, streams, staging)
    if streams is not None:
        side = streams.side(data.device)
        streams.wait_event(side, streams.record(streams.current(data.device)))  # device-side wait
        events = []
        with streams.use(side):
            for s, e in bounds:
                host[s:e].copy_(flat[s:e], non_blocking=True)
                events.append(streams.record(side))
        streams.keep(data, side)  # the allocator keeps ``data`` until the side stream is past it
        for (s, e), event in zip(bounds, events, strict=True):
            streams.host_wait(event)  # the host thread, not the compute stream
            works.append(transport.isend(host[s:e], dst=dst, tag=tag, group=group))
    else:
        for s, e in bounds:
            host[s:e].copy_(flat[s:e])
            works.append(transport.isend(host[s:e], dst=dst, tag=tag, group=group))
    return StagedWork(works, host, flat, pool, bounds)


def staged_recv(tensor: torch.Tensor, *, src: int, tag: int, group: Any, transport: Transport, pool: HostPool,
                streams: Streams | None, staging: DeviceStaging | None = None,
                min_chunk_bytes: int = MIN_CHUNK_BYTES) -> StagedWork:
    """Post the chunks' receives into a host buffer; ``wait()`` copies them onto ``tensor``."""
    host = pool.take(tensor)
    bounds = chunk_bounds(tensor.numel(), tensor.element_size(), min_chunk_bytes=min_chunk_bytes)
    works = [transport.irecv(host[s:e], src=src, tag=tag, group=group) for s, e in bounds]
    return StagedWork(works, host, tensor, pool, bounds, recv_into=tensor,
                      streams=_side_streams(tensor.device, streams, staging))
