"""Link and collective costs: an algorithm term and the link's achievable bandwidth.

A transfer moves some bytes through each link in some latency-bound steps, at the share of the
link's line rate its fabric achieves for that size (predict/fabrics.py: cited nccl-tests curves;
links without a fabric, such as measured ones, at their own numbers). The algorithm says how many
bytes and steps: a send n bytes in one step; a ring all-reduce 2(p-1)/p of the data through the
ring's slowest link in 2(p-1) steps, a reduce-scatter or all-gather half of that; NVLink SHARP
(H100/H200 nodes, 5 ranks and more) the payload once each way, when faster (fabrics.nvls_allreduce_time_s).
A few bytes among many ranks (the step's loss and gradient-norm all-reduces) take the faster of the
ring and a tree, whose 2 log2(p) latency hops NCCL's double binary trees use for small messages.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from hethub.layout import WHOLE, Hop, split_hop
from hethub.predict.fabrics import nvls_allreduce_time_s, transfer_time_s
from hethub.spec.cluster import Cluster, Link


def allreduce_floor_s(*, nbytes: float, participants: int, link: Link) -> float:
    """A floor under ``allreduce_time_s`` of these bytes, alone or fused with more (a fused transfer
    achieves more of the line rate): the ring at the line rate, or NVLink SHARP at its plateau where
    NCCL would take it. For bounds that price per layer what runs fused."""
    if participants <= 1 or nbytes <= 0:
        return 0.0
    p = participants
    ring = 2 * (p - 1) * link.latency_s + 2 * (p - 1) / p * nbytes / link.bw_bytes_per_s
    nvls = nvls_allreduce_time_s(link, nbytes=nbytes, participants=p, plateau=True)
    return ring if nvls is None else min(ring, nvls)


def p2p_time_s(link: Link, nbytes: float) -> float:
    """One message of ``nbytes`` over ``link`` at its fabric's achievable rate."""
    return transfer_time_s(link, link_bytes=nbytes, steps=1)


def allreduce_time_s(*, nbytes: float, participants: int, link: Link) -> float:
    """A ring all-reduce (or NVLink SHARP's where NCCL would pick it and it is faster)."""
    if participants <= 1 or nbytes <= 0:
        return 0.0
    p = participants
    ring = transfer_time_s(link, link_bytes=2 * (p - 1) / p * nbytes, steps=2 * (p - 1))
    nvls = nvls_allreduce_time_s(link, nbytes=nbytes, participants=p)
    return ring if nvls is None else min(ring, nvls)


def ring_pass_time_s(*, chunk_bytes: float, participants: int, link: Link) -> float:
    """One ring reduce-scatter or all-gather of ``participants`` chunks of ``chunk_bytes`` each (uneven
    shards are padded to the largest): p-1 steps, each a chunk over the ring's slowest link. A ring
    all-reduce is a reduce-scatter then an all-gather of n/p chunks."""
    if participants <= 1 or chunk_bytes <= 0:
        return 0.0
    return transfer_time_s(link, link_bytes=(participants - 1) * chunk_bytes, steps=participants - 1)


def small_allreduce_time_s(*, nbytes: float, participants: int, link: Link) -> float:
    """An all-reduce of a few bytes: the faster of the ring and a tree (up the tree and back down,
    2 ceil(log2 p) latencies, all bytes twice through the link). NCCL picks between ring and tree by
    message size and rank count; its double binary trees give "logarithmic latency" for small
    messages (NVIDIA, "Massively Scale Your Deep Learning Training with NCCL 2.4", 2019). Without
    it a ring over 4,096 ranks would charge 8,190 latencies for 8 bytes."""
    if participants <= 1:
        return 0.0
    ring = allreduce_time_s(nbytes=nbytes, participants=participants, link=link)
    tree = transfer_time_s(link, link_bytes=2 * nbytes, steps=2 * math.ceil(math.log2(participants)))
    return min(ring, tree)


def group_allreduce_time_s(cluster: Cluster, *, nbytes: float, devices: list[int] | tuple[int, ...]) -> float:
    """All-reduce of `nbytes` among `devices`: the ring over the slowest link of the ring. (A local
    emulation host prices it with its measured all-reduce instead: hethub.emulation.host.)"""
    p = len(devices)
    if p <= 1 or nbytes <= 0:
        return 0.0
    return allreduce_time_s(nbytes=nbytes, participants=p, link=slowest_link(cluster, devices))


def slowest_link(cluster: Cluster, devices: list[int] | tuple[int, ...]) -> Link:
    """The bottleneck link of a ring over `devices` in the given order."""
    if len(devices) < 2:
        return Link(float("inf"), 0.0)
    links = [cluster.link(a, b) for a, b in zip(devices, [*devices[1:], devices[0]], strict=True)]
    return Link(min(lk.bw_bytes_per_s for lk in links), max(lk.latency_s for lk in links),
                min(links, key=lambda lk: lk.bw_bytes_per_s).fabric)


def rings_link(cluster: Cluster, rings: Sequence[Sequence[int]]) -> Link:
    """The bottleneck link of rings that run at once (each a device list in ring order), such as the
    data-parallel all-reduces of a stage's TP ranks: rank q of every holder is in ring q.

    The ranks behind one NIC share it (:func:`shared_links`): a hop that crosses nodes gets its NIC's
    bandwidth divided by the number of the rings' hops leaving (or entering) through that NIC, so 8
    TP ranks of a node with one NIC, each all-reducing their 1/8 of a stage's gradients across nodes,
    move the whole gradient through that NIC, not an eighth of it. A collective spreads its rings'
    node crossings over every NIC its ranks in that node reach (NCCL's channels: each ring runs as
    several, each through another NIC), so a ring through 8 ranks of a node with a NIC per device
    crosses at 8 NICs' rate; a point-to-point send takes its own NIC (``shared_links``).
    """
    hops = [(a, b) for ring in rings if len(ring) > 1 for a, b in zip(ring, [*ring[1:], ring[0]], strict=True)]
    if not hops:
        return Link(float("inf"), 0.0)
    shared = _channel_shares(cluster, hops)
    return Link(min(lk.bw_bytes_per_s / share for lk, share in shared), max(lk.latency_s for lk, _ in shared),
                min(shared, key=lambda ls: ls[0].bw_bytes_per_s / ls[1])[0].fabric)


def tp_comm_time_s(*, act_bytes_per_layer: float, layers: int, tp: int, link: Link,
                   wgrad_s: tuple[float, ...] = ()) -> tuple[float, float]:
    """Megatron TP: two all-reduces of the layer's activations forward and two backward, per layer;
    the exposed part of each (forward, backward). ``wgrad_s``: the weight-gradient GEMMs each backward
    all-reduce runs beside, where the runtime overlaps them (hethub.runtimes: tp_wgrad_overlap;
    compute.column_wgrad_s): only the part of an all-reduce longer than its GEMM is exposed."""
    if tp <= 1:
        return 0.0, 0.0
    one = allreduce_time_s(nbytes=act_bytes_per_layer, participants=tp, link=link)
    hidden = list(wgrad_s[:2]) + [0.0] * (2 - len(wgrad_s[:2]))
    return 2 * layers * one, layers * sum(max(0.0, one - w) for w in hidden)


def hop_messages(senders: Sequence[int], receivers: Sequence[int], the_hop: Hop, *, nbytes: float,
                 ) -> list[tuple[int, int, float]]:
    """(sender, receiver, bytes) of each message of one micro-batch's hop from a stage's TP ranks
    ``senders`` to the next's ``receivers`` (device ids in TP order; one CP rank's, ``nbytes`` its
    whole message), as the runtime sends them (``layout.hop``; runtime/stage_messages.py): receiver q
    gets its piece from sender q mod len(senders) (``layout.fwd_source``)."""
    a, b = len(senders), len(receivers)
    piece = nbytes if the_hop.piece == "whole" else nbytes / the_hop.parts
    return [(senders[q % a], receivers[q], piece) for q in range(b)]


def hop_messages_time_s(cluster: Cluster, messages: Sequence[tuple[int, int, float]]) -> float:
    """The slowest of messages sent at once, each over its link with the NICs they cross shared."""
    pairs = [(s, r) for s, r, _ in messages]
    return max(shared_message_time_s(link, share=share, nbytes=n)
               for (link, share), (_, _, n) in zip(shared_links(cluster, pairs), messages, strict=True))


def stage_hop_time_s(cluster: Cluster, *, senders: tuple[int, ...] | list[int], receivers: tuple[int, ...] | list[int],
                     nbytes: float, split: bool = False) -> float:
    """One micro-batch's activations from a stage of TP ranks ``senders`` to the next stage's ``receivers``
    (device ids in TP order), as hethub's executor sends them (``hop_messages``): receiver q gets the
    whole tensor from sender q mod len(senders), or with ``split`` (``layout.split_hop``) only its
    1/len(receivers) slice, and the receivers then all-gather it over their TP group (a ring
    all-gather, half a ring all-reduce): one copy crosses the link whatever the two TP degrees.

    The ranks behind one NIC share it (:func:`shared_links`): the messages leaving (or entering) through
    one NIC at once each get that share of its bandwidth, so a TP-8 stage on a node with one NIC whose 8
    ranks each send the whole tensor to another node moves 8 copies through that NIC.
    """
    a, b = len(senders), len(receivers)
    if a < 1 or b < 1 or nbytes <= 0:
        return 0.0
    the_hop = Hop("flat", dest_gathers=True, parts=b) if split else WHOLE
    gather_s = (ring_pass_time_s(chunk_bytes=nbytes / b, participants=b, link=slowest_link(cluster, list(receivers)))
                if split else 0.0)
    return hop_messages_time_s(cluster, hop_messages(senders, receivers, the_hop, nbytes=nbytes)) + gather_s


def boundary_time_s(cluster: Cluster, *, senders: Sequence[int], receivers: Sequence[int], numel: int,
                    nbytes: float, flat: bool = True) -> float:
    """One micro-batch's boundary between adjacent stages, the slower of its two directions: the
    activation from ``senders`` to ``receivers`` and its gradient back, each as ``layout.hop`` sends
    it (``flat``: whether the boundary may send flat pieces; the wrap of virtual stages may not).
    Between unequal TP degrees the two directions use different pairs, pieces and gathers (2 -> 4
    forward sends quarters and gathers on the four, backward halves gathered on the two), so both
    are priced; the schedule simulation charges one time per boundary. The predictor
    (``PlanCosts.boundary_s``) and the planner (``LinkBook.hop_s``) both price hops here."""
    a, b = len(senders), len(receivers)
    fwd = stage_hop_time_s(cluster, senders=senders, receivers=receivers, nbytes=nbytes,
                           split=flat and split_hop(a=a, b=b, numel=numel))
    bwd = stage_hop_time_s(cluster, senders=receivers, receivers=senders, nbytes=nbytes,
                           split=flat and split_hop(a=b, b=a, numel=numel))
    return max(fwd, bwd)


def shared_message_time_s(link: Link, *, share: int, nbytes: float) -> float:
    """One of ``share`` messages of ``nbytes`` sent at once through ``link``'s NIC: the NIC streams
    them together, so all end as one message of their summed bytes would (at that size's achievable
    rate: splitting a message into concurrent pieces costs no efficiency)."""
    return p2p_time_s(link, share * nbytes)


def _channel_shares(cluster: Cluster, hops: list[tuple[int, int]]) -> list[tuple[Link, float]]:
    """Each ring hop's link and the share of a NIC it gets when the collective's crossings of a node
    spread evenly over the NICs its ranks there reach: the node's crossings out (or in) over those
    NICs, fractional where there are fewer crossings than NICs. An emulation host shares nothing."""
    dev = {d: cluster.devices[d] for hop in hops for d in hop}
    nics: dict[int, set[int]] = {}
    out: dict[int, int] = {}
    inn: dict[int, int] = {}
    for d in dev.values():
        nics.setdefault(d.node, set()).add(d.nic)
    for s, r in hops:
        if dev[s].node != dev[r].node:
            out[dev[s].node] = out.get(dev[s].node, 0) + 1
            inn[dev[r].node] = inn.get(dev[r].node, 0) + 1
    crossing = cluster.host is None
    return [(cluster.link(s, r), max(out[a.node] / len(nics[a.node]), inn[b.node] / len(nics[b.node]))
             if crossing and a.node != b.node else 1) for s, r in hops for a, b in ((dev[s], dev[r]),)]


def shared_links(cluster: Cluster, pairs: list[tuple[int, int]]) -> list[tuple[Link, int]]:
    """Each (sender, receiver) pair's link and how many of the pairs share its busiest NIC, when all
    the pairs send at once: a pair that crosses nodes leaves through its sender's NIC and enters
    through its receiver's (``NodeGroup.devices_per_nic`` devices behind each), whose bandwidth the
    pairs through it split. Pairs inside a node use no NIC (share 1). An emulation host has no NIC:
    every rank pair is its own loopback path there, so nothing is shared."""
    # Only the pairs' own devices: a list over the whole cluster cost O(devices) per hop (4,096-device
    # plans spent a fifth of their search here).
    dev = {d: cluster.devices[d] for pair in pairs for d in pair}
    out: dict[int, int] = {}
    inn: dict[int, int] = {}
    if cluster.host is None:
        for s, r in pairs:
            if dev[s].node != dev[r].node:
                out[dev[s].nic] = out.get(dev[s].nic, 0) + 1
                inn[dev[r].nic] = inn.get(dev[r].nic, 0) + 1
    return [(cluster.link(s, r), max(out.get(dev[s].nic, 1), inn.get(dev[r].nic, 1))
             if dev[s].node != dev[r].node else 1) for s, r in pairs]
