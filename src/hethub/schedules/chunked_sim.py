"""The event simulation over virtual stages (interleaved schedules, ``chunks`` = v > 1; the rules and
the inputs' layout: :mod:`hethub.schedules.simulate`): with records (``simulate_chunked``) and its
finish-only twin (``chunked_finish``), the same float operations in the same order. Pure Python."""

from __future__ import annotations

import functools
from collections.abc import Sequence

from hethub.schedules import Schedule, get_schedule
from hethub.schedules.event_sim import link_arrival_s
from hethub.schedules.records import StageSchedule, TimedOp, check_inputs


def _virtual_stages(fwd_s: Sequence[float], bwd_s: Sequence[float], p2p_s: Sequence[float], m: int,
                    sched: Schedule) -> int:
    """The number of virtual stages, after checking the inputs fit the chunked schedule ``sched``."""
    v = sched.chunks_per_stage
    if sched.split_backward:
        raise ValueError(f"schedule {sched.name!r} splits the backward and has virtual stages; not simulated")
    n = check_inputs(fwd_s, bwd_s, p2p_s, m)
    if n % v:
        raise ValueError(f"{n} virtual-stage times for {v} chunks per device: need a multiple of {v}")
    return n


def simulate_chunked(fwd_s: Sequence[float], bwd_s: Sequence[float], p2p_s: Sequence[float], m: int,
                      schedule: str, v: int, *, blocking: bool = False) -> list[StageSchedule]:
    """The event simulation over virtual stages (:mod:`hethub.schedules.simulate`); plain dicts, as interleaved
    pipelines are short next to the fast path's 64-stage x 512 micro-batch ones. With blocking
    sends the sender computes each arrival, in the order it sends (its stage is held until then),
    and the receiver takes it from ``arrival``."""
    sched = get_schedule(schedule, chunks=v)
    n = _virtual_stages(fwd_s, bwd_s, p2p_s, m, sched)
    p = n // v
    orders = [sched.ops(stage=s, num_stages=p, num_micro_batches=m) for s in range(p)]
    f_end: dict[tuple[int, int], float] = {}
    b_end: dict[tuple[int, int], float] = {}
    # One message at a time per directed link between devices (link_arrival_s), whichever chunk's:
    # forwards into device s come over link s (from s - 1, or the wrap from the last device into 0),
    # gradients into device s over link s (from s + 1, or the wrap from device 0 into the last).
    fwd_link, bwd_link = [0.0] * p, [0.0] * p
    ptr, clock = [0] * p, [0.0] * p
    # Blocking: the arrival of (kind, virtual stage sent to, micro-batch)'s message.
    arrival: dict[tuple[str, int, int], float] = {}
    recs: list[list[TimedOp]] = [[] for _ in range(p)]
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = 0
        for s in range(p):
            order, k, t = orders[s], ptr[s], clock[s]
            while k < len(order):
                kind, i, c = order[k]
                vs = c * p + s
                done = None
                if kind == "F":
                    if vs > 0:
                        if blocking:
                            if ("F", vs, i) not in arrival:
                                break
                            t = max(t, arrival[("F", vs, i)])
                        else:
                            if (vs - 1, i) not in f_end:
                                break
                            fwd_link[s] = link_arrival_s(sent_s=f_end[(vs - 1, i)], link_free_s=fwd_link[s],
                                                         transfer_s=p2p_s[vs - 1])
                            t = max(t, fwd_link[s])
                    start, t = t, t + fwd_s[vs]
                    f_end[(vs, i)] = t
                    if blocking and vs < n - 1:
                        to = (s + 1) % p
                        done = fwd_link[to] = arrival[("F", vs + 1, i)] = link_arrival_s(
                            sent_s=t, link_free_s=fwd_link[to], transfer_s=p2p_s[vs])
                else:
                    if vs < n - 1:
                        if blocking:
                            if ("B", vs, i) not in arrival:
                                break
                            t = max(t, arrival[("B", vs, i)])
                        else:
                            if (vs + 1, i) not in b_end:
                                break
                            bwd_link[s] = link_arrival_s(sent_s=b_end[(vs + 1, i)], link_free_s=bwd_link[s],
                                                         transfer_s=p2p_s[vs])
                            t = max(t, bwd_link[s])
                    start, t = t, t + bwd_s[vs]
                    b_end[(vs, i)] = t
                    if blocking and vs > 0:
                        to = (s - 1) % p
                        done = bwd_link[to] = arrival[("B", vs - 1, i)] = link_arrival_s(
                            sent_s=t, link_free_s=bwd_link[to], transfer_s=p2p_s[vs - 1])
                recs[s].append(TimedOp(kind, i, start, t, c, send_done_s=done))
                if done is not None:
                    t = done
                k += 1
            progressed += k - ptr[s]
            ptr[s], clock[s] = k, t
        if not progressed:
            raise RuntimeError("pipeline schedule deadlocked; this is a bug in the op order")
        remaining -= progressed
    return [StageSchedule(ops=tuple(r), finish_s=c) for r, c in zip(recs, clock, strict=True)]


@functools.lru_cache(maxsize=1024)
def _chunk_order(p: int, s: int, m: int, schedule: str, v: int) -> tuple[tuple[bool, int, int], ...]:
    """Device s's op order over virtual stages as (forward?, micro-batch, virtual stage k = c p + s)."""
    sched = get_schedule(schedule, chunks=v)
    return tuple((kind == "F", i, c * p + s) for kind, i, c in sched.ops(stage=s, num_stages=p, num_micro_batches=m))


def chunked_finish(fwd_s: Sequence[float], bwd_s: Sequence[float], p2p_s: Sequence[float], m: int,
                    schedule: str, v: int, *, blocking: bool) -> list[float]:
    """Each device's finish under :func:`simulate_chunked`'s rules, without its records: the same
    float operations in the same order (each link's messages in its one writer's op order, so the
    sweep order does not matter), kept in lists by virtual stage and micro-batch instead of dicts
    by tuple. None marks a message not yet sent (the records' path asks the dicts the same)."""
    n = _virtual_stages(fwd_s, bwd_s, p2p_s, m, get_schedule(schedule, chunks=v))
    p, last = n // v, n - 1
    orders = [_chunk_order(p, s, m, schedule, v) for s in range(p)]
    # Async: the end of F(k, i) / B(k, i), which the receiver reads. Blocking: the arrival of the
    # message into virtual stage k of micro-batch i, which the sender computes.
    fwd_at: list[list[float | None]] = [[None] * m for _ in range(n)]
    bwd_at: list[list[float | None]] = [[None] * m for _ in range(n)]
    fwd_link, bwd_link = [0.0] * p, [0.0] * p
    ptr, clock = [0] * p, [0.0] * p
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = 0
        for s in range(p):
            order, k, t = orders[s], ptr[s], clock[s]
            stop = len(order)
            while k < stop:
                # max(a, b) written as "b if b > a else a", which is what max returns (the hot loop).
                fw, i, vs = order[k]
                if fw:
                    if vs > 0:
                        got = fwd_at[vs if blocking else vs - 1][i]
                        if got is None:
                            break
                        if not blocking:  # link_arrival_s
                            if fwd_link[s] > got:
                                got = fwd_link[s]
                            got += p2p_s[vs - 1]
                            fwd_link[s] = got
                        if got > t:
                            t = got
                    t += fwd_s[vs]
                    if not blocking:
                        fwd_at[vs][i] = t
                    elif vs < last:  # the stage is held until delivery
                        to = (s + 1) % p
                        if fwd_link[to] > t:
                            t = fwd_link[to]
                        t += p2p_s[vs]
                        fwd_link[to] = fwd_at[vs + 1][i] = t
                else:
                    if vs < last:
                        got = bwd_at[vs if blocking else vs + 1][i]
                        if got is None:
                            break
                        if not blocking:
                            if bwd_link[s] > got:
                                got = bwd_link[s]
                            got += p2p_s[vs]
                            bwd_link[s] = got
                        if got > t:
                            t = got
                    t += bwd_s[vs]
                    if not blocking:
                        bwd_at[vs][i] = t
                    elif vs > 0:
                        to = (s - 1) % p
                        if bwd_link[to] > t:
                            t = bwd_link[to]
                        t += p2p_s[vs - 1]
                        bwd_link[to] = bwd_at[vs - 1][i] = t
                k += 1
            progressed += k - ptr[s]
            ptr[s], clock[s] = k, t
        if not progressed:
            raise RuntimeError("pipeline schedule deadlocked; this is a bug in the op order")
        remaining -= progressed
    return clock
