"""Emulated slow links between the ranks of one host (labelled as emulation wherever reported).

On an emulation cluster with ``emulated_links`` set, every point-to-point message between ranks on
different (emulated) nodes arrives as it would over ``cluster.link(a, b)``: at
``max(sent, previous arrival from that peer) + latency + bytes / bandwidth``, the rule the predictor's
simulation uses (``hethub.schedules.simulate.link_arrival_s``: a link carries one message at a time).

How: the sender stamps each message with its wall-clock send time (a one-number message under a
tag of its own, posted with the payload, so the runtime's ``isend`` stays asynchronous and the
sender never waits for the link, as a real NIC's DMA does not hold it); the receiver, once the
payload is there, sleeps until the emulated arrival. All ranks are processes of one host, so they
share its clock. The loopback transfer itself overlaps the emulated time, so a message arrives at
the later of the two. Sleeping never touches tensors, so numerics are unchanged.

Tensor methods only, no torch import: the wrapped communicator's tensors carry what it needs.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from hethub.schedules.simulate import link_arrival_s
from hethub.spec.cluster import Link

STAMP_TAG_OFFSET = 1 << 24  # tags of the send-time stamps: far above any payload tag the executor uses


class EmulatedLinks:
    """A Communicator whose p2p messages between the pairs ``link_of`` names (a Link; None: not
    emulated) take the emulated link's time. Everything else is the wrapped communicator's."""

    def __init__(self, comm: Any, *, link_of: Callable[[int, int], Link | None]) -> None:
        self.comm, self.link_of = comm, link_of
        self.arrived_s: dict[int, float] = {}  # peer -> arrival of its last message to this rank
        self.delayed_s = 0.0  # total time receives were held back beyond the real transfer

    def __getattr__(self, name: str) -> Any:
        return getattr(self.comm, name)

    def isend(self, tensor: Any, *, dst: int, tag: int, lane: str | None = None) -> Any:
        if self.link_of(self.comm.rank, dst) is None:
            return self.comm.isend(tensor, dst=dst, tag=tag, lane=lane)
        # The stamp rides the payload's lane just ahead of it: both ends post the two in that order.
        stamp = tensor.new_zeros(1).double().fill_(time.time())
        return _Both(self.comm.isend(stamp, dst=dst, tag=tag + STAMP_TAG_OFFSET, lane=lane),
                     self.comm.isend(tensor, dst=dst, tag=tag, lane=lane), keep=stamp)

    def irecv(self, tensor: Any, *, src: int, tag: int, lane: str | None = None) -> Any:
        link = self.link_of(src, self.comm.rank)
        if link is None:
            return self.comm.irecv(tensor, src=src, tag=tag, lane=lane)
        stamp = tensor.new_zeros(1).double()
        return _Arrival(self, link=link, src=src, nbytes=tensor.numel() * tensor.element_size(), stamp=stamp,
                        works=(self.comm.irecv(stamp, src=src, tag=tag + STAMP_TAG_OFFSET, lane=lane),
                               self.comm.irecv(tensor, src=src, tag=tag, lane=lane)))


class _Both:
    def __init__(self, *works: Any, keep: Any) -> None:
        self.works, self.keep = works, keep

    def wait(self) -> bool:
        for w in self.works:
            w.wait()
        return True

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self.works)


class _Arrival:
    """A posted receive that, when waited on, also waits out the emulated link. Receives from one peer
    are waited on in the order that peer sent them (micro-batch order), which the link state needs."""

    def __init__(self, links: EmulatedLinks, *, link: Link, src: int, nbytes: int, stamp: Any,
                 works: tuple[Any, Any]) -> None:
        self.links, self.link, self.src, self.nbytes, self.stamp, self.works = links, link, src, nbytes, stamp, works

    def wait(self) -> bool:
        for w in self.works:
            w.wait()
        arrive = link_arrival_s(sent_s=float(self.stamp[0]), link_free_s=self.links.arrived_s.get(self.src, 0.0),
                                transfer_s=self.link.time_s(self.nbytes))
        self.links.arrived_s[self.src] = arrive
        pause = arrive - time.time()
        if pause > 0:
            time.sleep(pause)
            self.links.delayed_s += pause
        return True


def emulated_links_of(cluster: Any, devices: tuple[int, ...]) -> Callable[[int, int], Link | None]:
    """``link_of`` for a plan's ranks (rank i is ``devices[i]``): the cluster's link between ranks on
    different nodes, None within a node (its real loopback stands in for the intra-node link)."""
    nodes = [cluster.devices[d].node for d in devices]

    def link_of(a: int, b: int) -> Link | None:
        return cluster.link(devices[a], devices[b]) if nodes[a] != nodes[b] else None

    return link_of
