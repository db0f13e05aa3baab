"""Event-by-event simulation of one pipeline running a registered schedule's op order.

Inputs, per stage s of a pipeline of p stages: ``fwd_s[s]`` and ``bwd_s[s]``, the time of one
micro-batch's forward / backward on that stage (compute plus tensor-parallel collectives), and
``p2p_s[s]``, the time to send one micro-batch's activations from stage s to s+1 (the gradients sent
back from s+1 to s take the same time). ``p2p_s`` may have p-1 or p entries; an entry for the last
stage is ignored.

Each stage runs the ops :meth:`hethub.schedules.Schedule.ops` gives it, in that order (the same
order the runtime's executor runs). Timing rules (every op runs as soon as its inputs and its stage
are free):

* F(s, i) starts at max(end of the previous op on s, end of F(s-1, i) + p2p_s[s-1]).
* B(s, i) starts at max(end of the previous op on s, end of B(s+1, i) + p2p_s[s], end of F(s, i));
  the last stage's B(p-1, i) needs only its own F(p-1, i).
* Transfers are asynchronous: they delay the receiver but never occupy a stage's compute. This is
  what hethub's executor does (``runtime/pipeline.py``): it posts each send with ``isend`` and goes
  on to its next op, receives are posted ahead, and it waits for its sends only at the step's end.
* One link carries one message at a time in each direction (:func:`link_arrival_s`): micro-batch
  i's transfer starts when its op has ended *and* the link has delivered micro-batch i-1's. On a
  slow link (transfer longer than a stage's forward plus backward) the link, not compute, sets the
  pipeline's pace; without this rule transfers would overlap each other on one wire.

``p2p`` (:data:`hethub.schedules.P2P_MODES`) says how the runtime sends. ``"async"`` (the default) is
the rule above. ``"lockstep"`` (DeepSpeed's pipeline engine, with its own send/receive order) is
simulated apart, by :mod:`hethub.schedules.lockstep`; the two functions below hand it over.
``"blocking"`` models runtimes whose stage cannot start its next op before its send has completed:
Megatron-LM's 1F1B (``p2p_communication.py`` batches a stage's isend with its irecv and waits on both
before the next op) and, as a floor, DeepSpeed's pipeline engine (``deepspeed/runtime/pipe/p2p.py``
sends with a blocking ``dist.send``; ``"lockstep"`` adds its rendezvous and order). There a stage that
sends (activations after F, gradients after B; with ZB-H1 after B, never after W) stays busy until its
message is delivered, at the same link arrival as above: max(op end, link free) + transfer. The op
itself still ends when its compute does (:attr:`TimedOp.send_done_s` says when the stage was
released). The send is taken as eager: it does not wait for the receiver to post its receive.
Waiting for that (a rendezvous) needs the runtime's own send/receive order, which no schedule here
defines (``"lockstep"`` takes DeepSpeed's), and on a slow link the transfer, which the model does
count, dominates the wait; so blocking predictions are a floor for such runtimes, not their exact
step. Blocking never delays a transfer, only the sender's next op: a stage's busy time per
micro-batch grows by one transfer per message it sends (uniform stages, steady state: F + B + T on
either stage of a 2-stage pipeline, as its two messages of a micro-batch cross the link in opposite
directions at once; F + B + 2 T on an inner stage, which sends both ways).

A stage's finish time is the end of its last backward. Because each stage's op times are used
as given, unequal stages are modelled exactly, not by a bottleneck formula.

Split-backward schedules (ZB-H1) run B and W ops: ``bwd_s`` is then the whole backward, of which
B takes (1 - ``wgrad_share``) and W ``wgrad_share``; W(s, i) needs only B(s, i), which the stage's
own order already puts first, and nobody waits for it. A stage's finish is the end of its last op.

The finish-only path (:func:`simulate_pipeline_time`) skips the steady phase once it repeats: with
fixed op and transfer times, the times the rest of the simulation reads advance, every few
micro-batches, by one step for every stage and link, and from then on by the same step until the
cool-down, which is then simulated from the shifted state (:func:`_skip_steady` proves the bound; it
agrees with the full simulation to ~1e-14 relative, and ``tests/unit/test_steady_skip.py`` checks
1e-12 on random pipelines). The records (:func:`simulate_pipeline`) are always simulated op by op.

Schedules with virtual stages (interleaved 1F1B, ``chunks`` = v > 1) are simulated over the p x v
virtual stages: ``fwd_s``, ``bwd_s`` then hold one entry per virtual stage k = c x p + s (chunk c of
device s), ``p2p_s`` one per hop from virtual stage k to k + 1 (p v - 1 entries, or p v with a
trailing one ignored; the hop from the last device's chunk c to the first device's chunk c + 1 is
entry c p + p - 1). The same rules hold per virtual stage: F(k, i) waits for F(k - 1, i) and the
hop, B(k, i) for B(k + 1, i) and the hop; each device runs its ops (of all its chunks) in the
registry's order; the result is per device. Every chunk's messages between two devices share their
link, one at a time in the order the receiver takes them.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

from hethub.schedules import DEFAULT_P2P, DEFAULT_SCHEDULE, LOCKSTEP, P2P_MODES, Op, Schedule, get_schedule
from hethub.schedules.lockstep import simulate_lockstep
from hethub.schedules.records import StageSchedule, TimedOp, check_inputs
from hethub.schedules.zero_bubble import DEFAULT_WEIGHT_GRAD_SHARE

# The records live in hethub.schedules.records (shared with the lockstep simulation); importers
# take them from here as well.
__all__ = ["StageSchedule", "TimedOp", "link_arrival_s", "simulate_pipeline", "simulate_pipeline_time"]


def simulate_pipeline_time(
    *, fwd_s: Sequence[float], bwd_s: Sequence[float], p2p_s: Sequence[float], num_micro_batches: int,
    schedule: str = DEFAULT_SCHEDULE, wgrad_share: float = DEFAULT_WEIGHT_GRAD_SHARE, chunks: int = 1,
    p2p: str = DEFAULT_P2P,
) -> list[float]:
    """Finish time (end of the last op, or of its blocking send) of every stage (device); the fast
    path, no op records. ``chunks``: model chunks per device (see the module docstring for the
    inputs' layout then); ``p2p``: how sends behave, one of P2P_MODES ("lockstep" is simulated by
    :mod:`hethub.schedules.lockstep`)."""
    if p2p == LOCKSTEP:
        return [st.finish_s for st in simulate_lockstep(fwd_s=fwd_s, bwd_s=bwd_s, p2p_s=p2p_s, num_micro_batches=
                                                        num_micro_batches, schedule=schedule, chunks=chunks)]
    blocking = _blocking(p2p)
    if chunks != 1:
        return _chunked_finish(fwd_s, bwd_s, p2p_s, num_micro_batches, schedule, chunks, blocking=blocking)
    finish, _ = _simulate(fwd_s, bwd_s, p2p_s, num_micro_batches, schedule, wgrad_share, record=False,
                          blocking=blocking)
    return finish


def simulate_pipeline(
    *, fwd_s: Sequence[float], bwd_s: Sequence[float], p2p_s: Sequence[float], num_micro_batches: int,
    schedule: str = DEFAULT_SCHEDULE, wgrad_share: float = DEFAULT_WEIGHT_GRAD_SHARE, chunks: int = 1,
    p2p: str = DEFAULT_P2P,
) -> list[StageSchedule]:
    """Every stage's (device's) ops with their start/end times, and its finish time."""
    if p2p == LOCKSTEP:
        return simulate_lockstep(fwd_s=fwd_s, bwd_s=bwd_s, p2p_s=p2p_s, num_micro_batches=num_micro_batches,
                                 schedule=schedule, chunks=chunks)
    m = num_micro_batches
    blocking = _blocking(p2p)
    if chunks != 1:
        return _simulate_chunked(fwd_s, bwd_s, p2p_s, m, schedule, chunks, blocking=blocking)
    finish, recs = _simulate(fwd_s, bwd_s, p2p_s, m, schedule, wgrad_share, record=True, blocking=blocking)
    if not blocking:
        return [StageSchedule(ops=tuple(TimedOp(*_decode(c, m), a, b) for c, a, b in rec), finish_s=f)
                for f, rec in zip(finish, recs, strict=True)]
    # A blocking send keeps the stage's clock, which the records hold, until delivery; the op's own
    # end is its start plus its duration, computed as the simulation computed it (bit for bit).
    p, share = len(fwd_s), wgrad_share if get_schedule(schedule).split_backward else 0.0
    out = []
    for s, (f, rec) in enumerate(zip(finish, recs, strict=True)):
        ops = []
        for c, a, b in rec:
            kind, i = _decode(c, m)
            end = a + (fwd_s[s] if kind == "F" else bwd_s[s] * (1.0 - share) if kind == "B" else bwd_s[s] * share)
            sends = (kind == "F" and s < p - 1) or (kind == "B" and s > 0)
            ops.append(TimedOp(kind, i, a, end, send_done_s=b) if sends else TimedOp(kind, i, a, b))
        out.append(StageSchedule(ops=tuple(ops), finish_s=f))
    return out


def _blocking(p2p: str) -> bool:
    if p2p not in P2P_MODES:
        raise ValueError(f"unknown p2p mode {p2p!r}; use one of {', '.join(P2P_MODES)}")
    return p2p == "blocking"


def _decode(code: int, m: int) -> tuple[str, int]:
    if code >= 0:
        return "F", code
    i = ~code
    return ("B", i) if i < m else ("W", i - m)


@functools.lru_cache(maxsize=1024)
def _codes(p: int, s: int, m: int, schedule: str) -> tuple[int, ...]:
    """The registry's op order for stage s as codes: i >= 0 is the forward of micro-batch i, ~i its
    backward (B) and ~(m + i) its weight-gradient pass W (ints keep the inner loop cheap)."""
    sched = get_schedule(schedule)
    if sched.chunks_per_stage != 1:
        raise ValueError(f"schedule {schedule!r} has virtual stages, which the event simulation does not model yet")
    return tuple(map(_code_of(m).__getitem__, sched.ops(stage=s, num_stages=p, num_micro_batches=m)))


@functools.lru_cache(maxsize=64)
def _code_of(m: int) -> dict[Op, int]:
    """Each single-chunk op of m micro-batches and its code (``_codes``)."""
    return {Op(kind, i): code for i in range(m)
            for kind, code in (("F", i), ("B", ~i), ("W", ~(m + i)))}


def link_arrival_s(*, sent_s: float, link_free_s: float, transfer_s: float) -> float:
    """When a message handed to the link at ``sent_s`` arrives, the link having delivered the previous
    message (same direction) at ``link_free_s``: the link serialises messages, it does not hold back
    the sender (the op rule of asynchronous sends above)."""
    return max(sent_s, link_free_s) + transfer_s


def _simulate(
    fwd_s: Sequence[float], bwd_s: Sequence[float], p2p_s: Sequence[float], m: int, schedule: str,
    wgrad_share: float, *, record: bool, blocking: bool = False, extrapolate: bool = True,
) -> tuple[list[float], list[list[tuple[int, float, float]]]]:
    """Every stage's finish and, with ``record``, its ops as (code, start, end). Without ``record``,
    ``extrapolate`` lets the steady phase be skipped once it repeats (:func:`_skip_steady`)."""
    check_inputs(fwd_s, bwd_s, p2p_s, m)
    share = wgrad_share if get_schedule(schedule).split_backward else 0.0
    sim = _EventSim(fwd_s, bwd_s, p2p_s, m, schedule, share, record=record, blocking=blocking)
    if extrapolate and not record:
        _skip_steady(sim)
    if not sim.run([len(o) for o in sim.orders]):
        raise RuntimeError("pipeline schedule deadlocked; this is a bug in the op order")
    return sim.clock, sim.recs


class _EventSim:
    """The event simulation's state, run up to any prefix of each stage's op order that is closed
    under the ops' dependencies (the whole order, or a cut of :func:`_skip_steady`)."""

    def __init__(self, fwd_s: Sequence[float], bwd_s: Sequence[float], p2p_s: Sequence[float], m: int,
                 schedule: str, share: float, *, record: bool, blocking: bool) -> None:
        p = len(fwd_s)
        self.p, self.m, self.record, self.blocking = p, m, record, blocking
        self.orders = orders = [_codes(p, s, m, schedule) for s in range(p)]
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


# Steady-phase skipping (_skip_steady). A segment of a stage's order is its ops after B(j - 1) up to
# and including B(j); the state is compared every _PERIOD segments, which catches any steady state
# whose period divides it (1, 2, 4 and 8 segments are all seen on planner-sized pipelines).
_PERIOD = 8
# How far the skipped-to state may be from the simulated one, relative to the largest time at the
# cut (the bound is proved in _skip_steady): a few hundred roundings of the times themselves.
_SKIP_TOLERANCE = 2.0 ** -44


def _skip_steady(sim: _EventSim) -> None:
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


def _repeats(sim: _EventSim, before: list[int], after: list[int], *, first: int, last: int,
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


def _simulate_chunked(fwd_s: Sequence[float], bwd_s: Sequence[float], p2p_s: Sequence[float], m: int,
                      schedule: str, v: int, *, blocking: bool = False) -> list[StageSchedule]:
    """The event simulation over virtual stages (module docstring); plain dicts, as interleaved
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


def _chunked_finish(fwd_s: Sequence[float], bwd_s: Sequence[float], p2p_s: Sequence[float], m: int,
                    schedule: str, v: int, *, blocking: bool) -> list[float]:
    """Each device's finish under :func:`_simulate_chunked`'s rules, without its records: the same
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
