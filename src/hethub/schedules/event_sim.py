"""The engine of the single-chunk event simulation (its rules: :mod:`hethub.schedules.simulate`): the
link rule, each stage's op order as integer codes, the simulation's state run to any closed prefix of
the orders (``EventSim``) and the steady-phase skip of the finish-only path (``skip_steady``, with
its proof). Pure Python."""

from __future__ import annotations

import functools
from collections.abc import Sequence

from hethub.schedules import get_schedule


def link_arrival_s(*, sent_s: float, link_free_s: float, transfer_s: float) -> float:
    """When a message handed to the link at ``sent_s`` arrives, the link having delivered the previous
    message (same direction) at ``link_free_s``: the link serialises messages, it does not hold back
    the sender (the op rule of asynchronous sends: :mod:`hethub.schedules.simulate`)."""
    return max(sent_s, link_free_s) + transfer_s


@functools.lru_cache(maxsize=1024)
def stage_codes(p: int, s: int, m: int, schedule: str) -> tuple[int, ...]:
    """`order_codes`, kept for the simulations (a stage's order of a pipeline shape is simulated again
    and again)."""
    return order_codes(p, s, m, schedule)


def order_codes(p: int, s: int, m: int, schedule: str) -> tuple[int, ...]:
    """The registry's op order for stage s as codes: i >= 0 is the forward of micro-batch i, ~i its
    backward (B) and ~(m + i) its weight-gradient pass W (ints keep the inner loop cheap): the
    schedule's own `Schedule.order` written over the codes."""
    sched = get_schedule(schedule)
    if sched.chunks_per_stage != 1:
        raise ValueError(f"schedule {schedule!r} has virtual stages, which the event simulation does not model yet")
    return tuple(sched.order(stage=s, num_stages=p, alphabet=_codes(m)))


def decode_op(code: int, m: int) -> tuple[str, int]:
    """An op's (kind, micro-batch) from its code (``stage_codes``)."""
    kind = code_kind(code, m=m)
    return kind, code if kind == "F" else ~code if kind == "B" else ~code - m


def code_kind(code: int, *, m: int) -> str:
    """An op's kind, "F", "B" or "W", from its code (``stage_codes``)."""
    return "F" if code >= 0 else "B" if ~code < m else "W"


@functools.lru_cache(maxsize=64)
def _codes(m: int) -> tuple[list[int], list[int], list[int]]:
    """The codes of the forwards, backwards and W's of micro-batches 0..m-1 (``stage_codes``): an
    alphabet `Schedule.order` reads and never changes, so one serves every stage."""
    return list(range(m)), [~i for i in range(m)], [~(m + i) for i in range(m)]


class EventSim:
    """The event simulation's state, run up to any prefix of each stage's op order that is closed
    under the ops' dependencies (the whole order, or a cut of :func:`skip_steady`)."""

    def __init__(self, fwd_s: Sequence[float], bwd_s: Sequence[float], p2p_s: Sequence[float], m: int,
                 schedule: str, share: float, *, record: bool, blocking: bool) -> None:
        p = len(fwd_s)
        self.p, self.m, self.record, self.blocking = p, m, record, blocking
        self.orders = orders = [stage_codes(p, s, m, schedule) for s in range(p)]
        self.f_end = f_end = [[0.0] * m for _ in range(p)]
        self.b_end = b_end = [[0.0] * m for _ in range(p)]
        # Forwards and backwards each complete in micro-batch order on every stage, so "is F(s-1, i)
        # done" is just "has stage s-1 finished more than i forwards": no per-op flags needed.
        self.nf = [0] * p
        self.nb = [0] * p
        self.ptr = [0] * p
        self.clock = [0.0] * p
        # Arrival of the last message on each stage's incoming links: activations from s-1, gradients
        # from s+1. Messages on a link arrive in micro-batch order, which is the order they are consumed.
        self.fwd_link = [0.0] * p
        self.bwd_link = [0.0] * p
        # With blocking sends the sender needs the arrival too: its own copies of its outgoing links
        # (activations to s+1, gradients to s-1), fed the same messages in the same order, so they give
        # the very floats the receivers compute.
        self.out_fwd_link = [0.0] * p
        self.out_bwd_link = [0.0] * p
        self.recs: list[list[tuple[int, float, float]]] = [[] for _ in range(p)]
        # What a stage's ops read, gathered once: a stage is visited ~m times (a 1F1B stage runs about
        # two ops per visit, as each waits on a neighbour), so per-visit setup is a large part of the loop.
        self.consts = [(orders[s], f_end[s], b_end[s], fwd_s[s], bwd_s[s] * (1.0 - share), bwd_s[s] * share,
                        f_end[s - 1] if s > 0 else None, b_end[s + 1] if s < p - 1 else None,
                        p2p_s[s - 1] if s > 0 else 0.0, p2p_s[s] if s < p - 1 else 0.0,
                        blocking and s < p - 1, blocking and s > 0, self.recs[s]) for s in range(p)]

    def run(self, stop: Sequence[int]) -> bool:
        """Run each stage s up to (not including) op ``stop[s]`` of its order; False if stuck before."""
        m, record, consts = self.m, self.record, self.consts
        nf, nb, ptr, clock = self.nf, self.nb, self.ptr, self.clock
        fwd_link, bwd_link, out_fwd_link, out_bwd_link = (self.fwd_link, self.bwd_link, self.out_fwd_link,
                                                          self.out_bwd_link)
        remaining = sum(stop) - sum(ptr)
        down = range(self.p)
        up = down[::-1]
        sweep = 0
        while remaining:
            # Forwards flow down the stages and backwards up, so alternate the sweep direction.
            progressed = 0
            for s in down if sweep % 2 == 0 else up:
                k, t, n = ptr[s], clock[s], stop[s]
                (order, fe, be, fs, bs, ws, prev_fe, next_be, in_p2p, out_p2p, hold_fwd, hold_bwd,
                 rec) = consts[s]
                while k < n:
                    c = order[k]
                    if c >= 0:
                        if prev_fe is not None:
                            if nf[s - 1] <= c:
                                break
                            # link_arrival_s, inlined (the hot loop of planner-sized searches)
                            ready = prev_fe[c]
                            if fwd_link[s] > ready:
                                ready = fwd_link[s]
                            ready += in_p2p
                            fwd_link[s] = ready
                            if ready > t:
                                t = ready
                        start = t
                        t += fs
                        fe[c] = t
                        nf[s] += 1
                        if hold_fwd:  # the stage is free once the activations are delivered
                            if out_fwd_link[s] > t:
                                t = out_fwd_link[s]
                            t += out_p2p
                            out_fwd_link[s] = t
                    elif ~c >= m:  # W: after its own B, which the stage's order puts first
                        start = t
                        t += ws
                    else:
                        i = ~c
                        if next_be is not None:
                            if nb[s + 1] <= i:
                                break
                            ready = next_be[i]
                            if bwd_link[s] > ready:
                                ready = bwd_link[s]
                            ready += out_p2p
                            bwd_link[s] = ready
                            if ready > t:
                                t = ready
                        # F(s, i) precedes B(s, i) in the stage's own order, so it already ended by t.
                        start = t
                        t += bs
                        be[i] = t
                        nb[s] += 1
                        if hold_bwd:  # ... once the gradients are
                            if out_bwd_link[s] > t:
                                t = out_bwd_link[s]
                            t += in_p2p
                            out_bwd_link[s] = t
                    if record:
                        rec.append((c, start, t))
                    k += 1
                progressed += k - ptr[s]
                ptr[s], clock[s] = k, t
            if not progressed:
                return False
            remaining -= progressed
            sweep += 1
        return True

    def state_at_cut(self, j: int) -> tuple[list[float], bool] | None:
        """At cut ``j`` (every stage has run B(j) and nothing after it): every time the rest of the
        simulation reads, and whether forwards still flow; None unless that is all there is to read:
        every backward sent was taken, and each stage's next forward needs only the last forward of
        the stage before (or all forwards are done). The times: the stage clocks, the last arrival
        on each link and, while forwards flow, each stage's last forward end."""
        p, m, nf = self.p, self.m, self.nf
        if any(n != j + 1 for n in self.nb):
            return None
        forwards = any(n != m for n in nf)
        if forwards and any(nf[s - 1] - nf[s] != 1 for s in range(1, p)):
            return None
        x = self.clock + self.bwd_link[:p - 1]
        if self.blocking:
            x += self.out_bwd_link[1:]
        if forwards:
            f_end = self.f_end
            x += [f_end[s][nf[s] - 1] for s in range(p - 1)] + self.fwd_link[1:]
            if self.blocking:
                x += self.out_fwd_link[:p - 1]
        return x, forwards

    def set_state(self, x: list[float], forwards: bool) -> None:
        """The inverse of :meth:`state_at_cut`, at the cut ``ptr``, ``nf`` and ``nb`` already say."""
        p = self.p
        self.clock[:] = x[:p]
        self.bwd_link[:p - 1] = x[p:2 * p - 1]
        at = 2 * p - 1
        if self.blocking:
            self.out_bwd_link[1:] = x[at:at + p - 1]
            at += p - 1
        if forwards:
            f_end, nf = self.f_end, self.nf
            for s in range(p - 1):
                f_end[s][nf[s] - 1] = x[at + s]
            self.fwd_link[1:] = x[at + p - 1:at + 2 * p - 2]
            at += 2 * p - 2
            if self.blocking:
                self.out_fwd_link[:p - 1] = x[at:at + p - 1]


# Steady-phase skipping (skip_steady). A segment of a stage's order is its ops after B(j - 1) up to
# and including B(j); the state is compared every _PERIOD segments, which catches any steady state
# whose period divides it (1, 2, 4 and 8 segments are all seen on planner-sized pipelines).
_PERIOD = 8
# How far the skipped-to state may be from the simulated one, relative to the largest time at the
# cut (the bound is proved in skip_steady): a few hundred roundings of the times themselves.
_SKIP_TOLERANCE = 2.0 ** -44


def skip_steady(sim: EventSim) -> None:
    """Advance ``sim`` through the steady phase, skipping what repeats; leave it wherever it stops.

    A cut J: every stage has run its ops up to and including B(J). It is closed under the ops'
    dependencies when each stage's next forward needs only the previous stage's last one (the
    stages' forward counts differ by one, or all forwards are done) and every backward sent has
    been taken. Every time the rest of the simulation reads is then in ``state_at_cut``: x_J. Where
    segments J + 1 .. K are the same on every stage but for their micro-batch indices (each one up
    by one; checked on the op orders), x_(j+1) = M(x_j) for J <= j < K with one map M built of
    max and of adding op and transfer times: M is monotone and M(x + c) = M(x) + c. So with
    d = x_J - x_(J-P), P segments apart, M^P(x_J) - x_J = M^P(x_J) - M^P(x_(J-P)) lies entry by
    entry within [min d, max d], and so does every later P-segment step. Hence x_(J+qP) is
    x_J + q d but for at most q (max d - min d): once that is below _SKIP_TOLERANCE of the times,
    the state jumps there and the caller simulates the rest (the cool-down) as usual."""
    m, orders = sim.m, sim.orders
    last, last_stop, j = None, None, _PERIOD
    while j + 2 * _PERIOD < m:
        stop = [o.index(~j, k) + 1 for o, k in zip(orders, sim.ptr, strict=True)]
        if not sim.run(stop):
            return
        cut = sim.state_at_cut(j)
        if cut is not None and last is not None and cut[1] == last[1]:
            x, forwards = cut
            d = [a - b for a, b in zip(x, last[0], strict=True)]
            # The steady phase ends at the first stage's last forward (or at the last backward).
            end = min(m - 1 - (sim.nf[s] - 1 - j) for s in range(sim.p)) if forwards else m - 1
            jumps = (end - j) // _PERIOD
            if jumps < 1:
                return
            if ((max(d) - min(d)) * jumps <= _SKIP_TOLERANCE * max(x)
                    and _repeats(sim, last_stop, stop, first=j - _PERIOD + 1, last=j + jumps * _PERIOD,
                                 forwards=forwards)):
                for s, (a, b) in enumerate(zip(last_stop, stop, strict=True)):
                    sim.ptr[s] = b + (b - a) * jumps
                    sim.nb[s] += jumps * _PERIOD
                    if forwards:
                        sim.nf[s] += jumps * _PERIOD
                sim.set_state([a + jumps * b for a, b in zip(x, d, strict=True)], forwards)
                return
        last, last_stop, j = cut, stop, j + _PERIOD


def _repeats(sim: EventSim, before: list[int], after: list[int], *, first: int, last: int,
             forwards: bool) -> bool:
    """Whether segments ``first`` .. ``last`` of every stage's order are one segment with its
    micro-batch indices shifted (``before``/``after``: the cuts before segment ``first`` and after
    segment ``first`` + _PERIOD - 1), holding one forward each or, without ``forwards``, none."""
    count = last - first + 1
    for order, lo, hi in zip(sim.orders, before, after, strict=True):
        size, rest = divmod(hi - lo, _PERIOD)
        end = lo + count * size
        if rest or size < 1 or end > len(order):
            return False
        # Every segment ends with its own B, and each other op of the first is repeated, its
        # micro-batch one up per segment: a forward's code grows by one, a W's shrinks by one.
        if order[lo + size - 1:end:size] != tuple(range(~first, ~last - 1, -1)):
            return False
        fwd = 0
        for r in range(size - 1):
            c = order[lo + r]
            if c >= 0:
                fwd += 1
                want = tuple(range(c, c + count))
            elif ~c >= sim.m:
                want = tuple(range(c, c - count, -1))
            else:
                return False
            if order[lo + r:end:size] != want:
                return False
        if fwd != int(forwards):
            return False
    return True
