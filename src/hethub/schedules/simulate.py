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
cool-down, which is then simulated from the shifted state
(:func:`hethub.schedules.event_sim.skip_steady` proves the bound; it agrees with the full simulation
to ~1e-14 relative, and ``tests/unit/test_steady_skip.py`` checks 1e-12 on random pipelines). The
records (:func:`simulate_pipeline`) are always simulated op by op.

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

from collections.abc import Sequence

from hethub.schedules import DEFAULT_P2P, DEFAULT_SCHEDULE, LOCKSTEP, P2P_MODES, get_schedule
from hethub.schedules.chunked_sim import chunked_finish, simulate_chunked
from hethub.schedules.event_sim import EventSim, decode_op, link_arrival_s, skip_steady
from hethub.schedules.lockstep import simulate_lockstep
from hethub.schedules.records import StageSchedule, TimedOp, check_inputs
from hethub.schedules.zero_bubble import DEFAULT_WEIGHT_GRAD_SHARE

# The records live in hethub.schedules.records (shared with the lockstep simulation) and the link
# rule in hethub.schedules.event_sim; importers take them from here as well.
__all__ = ["StageSchedule", "TimedOp", "finish_floor_s", "link_arrival_s", "simulate_pipeline",
           "simulate_pipeline_time"]


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
        return chunked_finish(fwd_s, bwd_s, p2p_s, num_micro_batches, schedule, chunks, blocking=blocking)
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
        return simulate_chunked(fwd_s, bwd_s, p2p_s, m, schedule, chunks, blocking=blocking)
    finish, recs = _simulate(fwd_s, bwd_s, p2p_s, m, schedule, wgrad_share, record=True, blocking=blocking)
    if not blocking:
        return [StageSchedule(ops=tuple(TimedOp(*decode_op(c, m), a, b) for c, a, b in rec), finish_s=f)
                for f, rec in zip(finish, recs, strict=True)]
    # A blocking send keeps the stage's clock, which the records hold, until delivery; the op's own
    # end is its start plus its duration, computed as the simulation computed it (bit for bit).
    p, share = len(fwd_s), wgrad_share if get_schedule(schedule).split_backward else 0.0
    out = []
    for s, (f, rec) in enumerate(zip(finish, recs, strict=True)):
        ops = []
        for c, a, b in rec:
            kind, i = decode_op(c, m)
            end = a + (fwd_s[s] if kind == "F" else bwd_s[s] * (1.0 - share) if kind == "B" else bwd_s[s] * share)
            sends = (kind == "F" and s < p - 1) or (kind == "B" and s > 0)
            ops.append(TimedOp(kind, i, a, end, send_done_s=b) if sends else TimedOp(kind, i, a, b))
        out.append(StageSchedule(ops=tuple(ops), finish_s=f))
    return out


def finish_floor_s(*, fwd_s: Sequence[float], bwd_s: Sequence[float], p2p_s: Sequence[float], num_micro_batches: int,
                   schedule: str = DEFAULT_SCHEDULE, wgrad_share: float = DEFAULT_WEIGHT_GRAD_SHARE) -> float:
    """A floor under the last finish of ``simulate_pipeline_time`` (async or blocking sends, no chunks),
    from the timing rules alone. Stage k's first forward waits for every earlier stage's first forward
    and hop (the fill); it then runs all its m forwards and m backwards; its first backward waits for
    its first forward and that micro-batch's round trip through the later stages (their forwards, their
    backwards' B part, each hop both ways), and before it the stage ran at most its peak in-flight
    forwards (each is held until its backward), so at least m minus those run after; where the backward
    is not split, the stage's last op is a backward that every earlier stage's backward of the same
    micro-batch waits for, hop by hop (the drain). Transfers held by a busy link only add."""
    check_inputs(fwd_s, bwd_s, p2p_s, num_micro_batches)
    sch, m, n = get_schedule(schedule), num_micro_batches, len(fwd_s)
    share = wgrad_share if sch.split_backward else 0.0
    trips = [0.0] * n  # the round trip past stage k: later stages' forwards and B parts, hops both ways
    for k in range(n - 2, -1, -1):
        trips[k] = trips[k + 1] + fwd_s[k + 1] + bwd_s[k + 1] * (1.0 - share) + 2 * p2p_s[k]
    best, fill, back = 0.0, 0.0, 0.0
    for k, (f, b) in enumerate(zip(fwd_s, bwd_s, strict=True)):
        ahead = min(m, sch.in_flight(stage=k, num_stages=n, num_micro_batches=m))
        best = max(best, fill + max(m * (f + b), f + trips[k] + (m - ahead) * f + m * b) + back)
        hop = p2p_s[k] if k < n - 1 else 0.0
        fill += f + hop
        if not sch.split_backward:
            back += b + hop
    return best * (1 - 1e-12)  # the simulation adds the same times in another order (rounding)


def _blocking(p2p: str) -> bool:
    if p2p not in P2P_MODES:
        raise ValueError(f"unknown p2p mode {p2p!r}; use one of {', '.join(P2P_MODES)}")
    return p2p == "blocking"


def _simulate(
    fwd_s: Sequence[float], bwd_s: Sequence[float], p2p_s: Sequence[float], m: int, schedule: str,
    wgrad_share: float, *, record: bool, blocking: bool = False, extrapolate: bool = True,
) -> tuple[list[float], list[list[tuple[int, float, float]]]]:
    """Every stage's finish and, with ``record``, its ops as (code, start, end). Without ``record``,
    ``extrapolate`` lets the steady phase be skipped once it repeats (:func:`skip_steady`)."""
    check_inputs(fwd_s, bwd_s, p2p_s, m)
    share = wgrad_share if get_schedule(schedule).split_backward else 0.0
    sim = EventSim(fwd_s, bwd_s, p2p_s, m, schedule, share, record=record, blocking=blocking)
    if extrapolate and not record:
        skip_steady(sim)
    if not sim.run([len(o) for o in sim.orders]):
        raise RuntimeError("pipeline schedule deadlocked; this is a bug in the op order")
    return sim.clock, sim.recs
