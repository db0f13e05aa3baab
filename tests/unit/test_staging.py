"""The bridge's staging (comm/staging.py) under GPU rules, on CPU: a fake stream API logs which stream
each copy is issued on and every wait, and an in-process transport logs each chunk handed to it.
What would break on a GPU fails here: a copy on the compute stream, the host waiting for the
compute stream, a chunk sent before its copy landed, no overlap between copying chunk k+1 and
sending chunk k, the receive's buffer reused before its device copies read it, reassembly that is
not byte-exact."""

from __future__ import annotations

import itertools
from contextlib import contextmanager
from typing import Any

import pytest
import torch

from hethub.comm.staging import (
    MAX_CHUNKS,
    MIN_CHUNK_BYTES,
    STAGING,
    DeviceStaging,
    HostPool,
    chunk_bounds,
    staged_recv,
    staged_send,
)
from hethub.comm.transport import TransportCaps

GPU_LIKE = DeviceStaging(pin=False, streams=True)  # CPU tensors staged as a device with streams would be


class FakeStreams:
    """Streams and events as names; ``log`` keeps the order of everything issued."""

    def __init__(self, log: list) -> None:
        self.log, self.active, self.n = log, "compute", 0
        self.pending: set[str] = set()

    def current(self, device: torch.device) -> str:
        return "compute"

    def side(self, device: torch.device) -> str:
        return "side"

    @contextmanager
    def use(self, stream: str):
        before, self.active = self.active, stream
        self.log.append(("use", stream))
        yield
        self.log.append(("leave", stream))
        self.active = before

    def record(self, stream: str) -> str:
        self.n += 1
        event = f"{stream}#{self.n}"
        self.pending.add(event)
        self.log.append(("record", event))
        return event

    def wait_event(self, stream: str, event: str) -> None:
        self.log.append(("stream_waits", stream, event))

    def host_wait(self, event: str) -> None:
        self.log.append(("host_waits", event))
        self.pending.discard(event)

    def done(self, event: str) -> bool:
        return event not in self.pending

    def keep(self, tensor: torch.Tensor, stream: str) -> None:
        self.log.append(("keep", stream))


class LoopTransport:
    """In-process point-to-point: one FIFO per (src, dst, tag); sends log their chunk."""

    caps = TransportCaps(name="loop")

    def __init__(self, log: list) -> None:
        self.log, self.queues = log, {}

    def group(self, ranks, *, channel: str = "") -> None:
        return None

    def isend(self, buf: torch.Tensor, *, dst: int, tag: int, group: Any):
        self.log.append(("send", buf.numel()))
        self.queues.setdefault((0, dst, tag), []).append(buf.clone())
        return Done()

    def irecv(self, buf: torch.Tensor, *, src: int, tag: int, group: Any):
        return Recv(self, buf, (src, 1, tag))

    def all_reduce(self, buf, *, op, group):
        raise NotImplementedError


class Done:
    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


class Recv:
    def __init__(self, t: LoopTransport, buf: torch.Tensor, key: tuple) -> None:
        self.t, self.buf, self.key = t, buf, key

    def wait(self, timeout=None) -> bool:
        self.t.log.append(("recv_wait", self.buf.numel()))
        self.buf.copy_(self.t.queues[self.key].pop(0))
        return True

    def is_completed(self) -> bool:
        return bool(self.t.queues.get(self.key))


def test_chunks_cover_the_message_in_order():
    for numel, size in [(1, 4), (1000, 2), (MIN_CHUNK_BYTES, 1), (3 * MIN_CHUNK_BYTES + 7, 4), (10**8, 2)]:
        b = chunk_bounds(numel, size)
        assert b[0][0] == 0 and b[-1][1] == numel and all(x[1] == y[0] for x, y in itertools.pairwise(b))
        assert 1 <= len(b) <= MAX_CHUNKS
        assert len(b) == 1 or all((e - s) * size >= MIN_CHUNK_BYTES * 0.5 for s, e in b)
    assert len(chunk_bounds(MIN_CHUNK_BYTES, 1)) == 1 and len(chunk_bounds(10**8, 4)) == MAX_CHUNKS


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
@pytest.mark.parametrize("numel", [1, 5000, 2 * MIN_CHUNK_BYTES // 4 + 3, 3_000_017])
@pytest.mark.parametrize("staging", [STAGING["cpu"], GPU_LIKE])
def test_chunked_message_arrives_byte_exact(dtype, numel, staging):
    log: list = []
    t, streams = LoopTransport(log), FakeStreams(log)
    g = torch.Generator().manual_seed(numel)
    x = torch.randint(-1000, 1000, (numel,), generator=g).to(dtype)
    send = staged_send(x, dst=1, tag=3, group=None, transport=t, pool=HostPool(streams), streams=streams,
                       staging=staging)
    got = torch.empty_like(x)
    recv = staged_recv(got, src=0, tag=3, group=None, transport=t, pool=HostPool(streams), streams=streams,
                       staging=staging)
    recv.wait()
    send.wait()
    assert torch.equal(got.view(torch.uint8) if dtype != torch.bfloat16 else got.view(torch.int16),
                       x.view(torch.uint8) if dtype != torch.bfloat16 else x.view(torch.int16))
    assert [n for op, n, *_ in log if op == "send"] == [e - s for s, e in chunk_bounds(numel, x.element_size())]


def test_send_copies_on_the_side_stream_and_overlaps_chunks():
    log: list = []
    t, streams = LoopTransport(log), FakeStreams(log)
    x = torch.arange(4 * MIN_CHUNK_BYTES // 4, dtype=torch.float32)  # 4 chunks
    staged_send(x, dst=1, tag=0, group=None, transport=t, pool=HostPool(streams), streams=streams, staging=GPU_LIKE)
    # The side stream first waits, device-side, for the compute stream's work so far.
    assert log[0] == ("record", "compute#1") and log[1] == ("stream_waits", "side", "compute#1")
    # Every copy is issued inside the side stream's context, then each chunk's event.
    inside = log[log.index(("use", "side")):log.index(("leave", "side"))]
    assert [op for op, *_ in inside[1:]] == ["record"] * 4
    assert log[log.index(("leave", "side")) + 1] == ("keep", "side")  # the allocator keeps x for the side stream
    # The host waits only for the side stream's copy events, never the compute stream's.
    waited = [e for op, e, *_ in log if op == "host_waits"]
    assert waited and all(e.startswith("side#") for e in waited)
    # Chunk k is handed over after its copy landed and before chunk k+1's wait: copying k+1 overlaps it.
    after = log[log.index(("leave", "side")) + 2:]
    assert [op for op, *_ in after] == ["host_waits", "send"] * 4


def test_receive_never_makes_the_compute_stream_wait_for_the_host():
    log: list = []
    t, streams = LoopTransport(log), FakeStreams(log)
    x = torch.arange(3 * MIN_CHUNK_BYTES // 4, dtype=torch.float32)
    staged_send(x, dst=1, tag=0, group=None, transport=t, pool=HostPool(streams), streams=streams, staging=GPU_LIKE)
    log.clear()
    pool = HostPool(streams)
    got = torch.empty_like(x)
    work = staged_recv(got, src=0, tag=0, group=None, transport=t, pool=pool, streams=streams, staging=GPU_LIKE)
    host = work.host
    work.wait()
    assert torch.equal(got, x)
    # Each chunk's copy onto the device is issued on the side stream right after that chunk landed.
    ops = [op for op, *_ in log]
    assert ops[:4] == ["recv_wait", "use", "leave", "recv_wait"]
    # The compute stream waits device-side for the side stream's last event; the host never waits.
    assert "host_waits" not in ops
    last = [e for op, e, *_ in log if op == "record"][-1]
    assert log[-1] == ("stream_waits", "compute", last)
    # The host buffer is not reused while that copy may still read it, and is once it has completed.
    assert pool.take(x) is not host
    streams.pending.discard(last)
    assert pool.take(x) is host
