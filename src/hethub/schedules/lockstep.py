"""DeepSpeed's pipeline engine, simulated: ``training.p2p`` "lockstep".

DeepSpeed's ``PipelineEngine`` (``deepspeed/runtime/pipe/engine.py``; Sailor trains with a fork of it)
trains a batch by running, on every stage, the instructions that its ``TrainSchedule.steps()``
(``deepspeed/runtime/pipe/schedule.py``) yields, one after another. This module states that order
(:func:`train_instructions`, written from the schedule's rules, below) and simulates it
(:func:`simulate_lockstep`); :mod:`hethub.schedules.simulate` hands ``p2p="lockstep"`` over to it.

**The order.** A batch of m micro-batches on p stages takes 2(m + p - 1) steps. At step t, stage s
runs a forward step when t - s is even, of micro-batch (t - s) / 2, and a backward step otherwise,
of micro-batch (t - 2p + 1 + s) / 2; so F(i) runs at step 2i + s and B(i) at step 2i + 2p - 1 - s,
and the compute order is exactly hethub's 1F1B order (p - s forwards before the first backward).
A step whose micro-batch is outside 0..m-1 computes nothing but still exchanges. Each step first
exchanges, then computes; a result goes out in the stage's next step, paired with that step's
receive:

* forward step of micro-batch i: receive i's activations from s - 1 (``RecvActivation``), send
  s - 1 the gradients of the previous step's backward (``SendGrad``), then the forward;
* backward step of micro-batch i: send s + 1 the activations of the previous step's forward
  (``SendActivation``), receive i's gradients from s + 1 (``RecvGrad``), then the backward.

The first stage has no previous stage and the last no next one; their exchanges with it drop out.
After the last step come ``ReduceTiedGrads``, ``ReduceGrads`` (the data-parallel all-reduce, which
does not overlap the backward) and ``OptimizerStep``: the predictor prices those after the pipeline
(``hethub.predict.sync``), as for every mode, so they are not simulated here.

**The rendezvous.** ``deepspeed/runtime/pipe/p2p.py`` sends and receives with blocking
``torch.distributed`` ``send``/``recv``; under NCCL a point-to-point transfer runs only once both ranks
have posted it, and the stage's compute waits for it. So a send and its matching receive are one
event here: the transfer starts when the later of its two ends reaches it and takes the hop's
``p2p_s``, and both ends are held until it is delivered. No link-free term is needed: both ends
being held, a directed link never carries two messages at once (its previous message held its
sender, which posts the next one only afterwards). Assumed, not measured: NCCL may finish a small
send into the receiver's buffer before the receive is posted (eager protocol), which would release
the sender early; the activations of a micro-batch of a billion-scale model are megabytes, beyond that.

**No deadlock.** In a step the stages that exchange pair up (s - 1 in a backward step with s in a
forward step) and both ends list the pair's two messages in the same order (activations, then
gradients), which is why DeepSpeed can say that a barrier between steps would not deadlock. The
simulation still checks, and raises if no stage can move.

**Result.** Per stage a :class:`StageSchedule` of its forward and backward ops (start and end of
the compute); an op that sends has ``send_done_s``, the delivery of its message (for a backward,
that span also holds the receive its next step runs first); ``transfer_s`` is the time of every
transfer the stage was an end of (waiting for the other end to arrive is bubble, not transfer);
``finish_s`` is the end of its last instruction (every stage but the first: the send of its last
gradients; the first: its last backward). Uniform stages, forward F, backward B, transfer T, steady state:
F + B + 2T per micro-batch on 2 stages (two transfers between the two computes of each stage, one
each way, one after the other), F + B + 4T from 3 stages (an inner stage is an end of four transfers
per micro-batch). ``tests/unit/test_lockstep.py`` checks these and a hand-computed step.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import NamedTuple

from hethub.schedules.records import StageSchedule, TimedOp, check_inputs

# The one pipeline schedule DeepSpeed's engine trains with (TrainSchedule is 1F1B, one model chunk per stage).
LOCKSTEP_SCHEDULE = "1f1b"

# Instruction kinds, named after DeepSpeed's (ForwardPass, BackwardPass, RecvActivation, SendGrad,
# SendActivation, RecvGrad).
FORWARD, BACKWARD = "F", "B"
RECV_ACT, SEND_GRAD, SEND_ACT, RECV_GRAD = "recv_act", "send_grad", "send_act", "recv_grad"
_CODES = {FORWARD: 0, BACKWARD: 1, RECV_ACT: 2, SEND_GRAD: 3, SEND_ACT: 4, RECV_GRAD: 5}


class Instruction(NamedTuple):
    """One instruction of a stage: a compute (F, B) or one end of a transfer, for one micro-batch."""

    kind: str  # FORWARD, BACKWARD, RECV_ACT, SEND_GRAD, SEND_ACT or RECV_GRAD
    micro_batch: int


# How to get a plan that lockstep refuses (below) simulated.
LOCKSTEP_FIX = (f"set training.schedule to {LOCKSTEP_SCHEDULE!r} with one layer range per stage (DeepSpeed's "
                "TrainSchedule), or training.p2p to 'blocking' (eager blocking sends, any schedule)")


def lockstep_unsupported(*, schedule: str, chunks: int = 1) -> str | None:
    """What keeps a pipeline with this schedule and ``chunks`` model chunks per stage from being
    simulated in lock-step (:data:`LOCKSTEP_FIX` says what to do); None when nothing does."""
    if schedule == LOCKSTEP_SCHEDULE and chunks == 1:
        return None
    what = f"training.schedule {schedule!r}" + (f" with {chunks} chunks per stage" if chunks != 1 else "")
    return (f"is 'lockstep', which simulates DeepSpeed's pipeline engine, whose TrainSchedule is 1F1B on one model "
            f"chunk per stage, not {what}")


@functools.lru_cache(maxsize=256)
def train_instructions(*, stage: int, num_stages: int, num_micro_batches: int) -> tuple[Instruction, ...]:
    """The instructions stage ``stage`` of ``num_stages`` runs for ``num_micro_batches``, in DeepSpeed's
    TrainSchedule order (module docstring), less the loads and the after-batch reductions."""
    s, p, m = stage, num_stages, num_micro_batches
    if not 0 <= s < p or m < 1:
        raise ValueError(f"need 0 <= stage < num_stages and num_micro_batches >= 1; got {s}, {p}, {m}")
    out: list[Instruction] = []
    prev = -1  # the previous step's micro-batch (none before the first step)
    for t in range(2 * (m + p - 1)):
        forward = (t - s) % 2 == 0
        i = (t - s) // 2 if forward else (t - 2 * p + 1 + s) // 2
        now, before = 0 <= i < m, 0 <= prev < m
        if forward:
            if s > 0 and now:
                out.append(Instruction(RECV_ACT, i))
            if s > 0 and before:
                out.append(Instruction(SEND_GRAD, prev))
            if now:
                out.append(Instruction(FORWARD, i))
        else:
            if s < p - 1 and before:
                out.append(Instruction(SEND_ACT, prev))
            if s < p - 1 and now:
                out.append(Instruction(RECV_GRAD, i))
            if now:
                out.append(Instruction(BACKWARD, i))
        prev = i
    return tuple(out)


def simulate_lockstep(
    *, fwd_s: Sequence[float], bwd_s: Sequence[float], p2p_s: Sequence[float], num_micro_batches: int,
    schedule: str = LOCKSTEP_SCHEDULE, chunks: int = 1,
) -> list[StageSchedule]:
    """Every stage's ops, transfer time and finish under DeepSpeed's lock-step engine (module
    docstring); inputs as for :func:`hethub.schedules.simulate.simulate_pipeline`. ValueError, naming
    the plan fields and the fix, for a schedule other than 1F1B or more than one chunk per stage."""
    why = lockstep_unsupported(schedule=schedule, chunks=chunks)
    if why is not None:
        raise ValueError(f"training.p2p {why}. Fix: {LOCKSTEP_FIX}")
    m = num_micro_batches
    p = check_inputs(fwd_s, bwd_s, p2p_s, m)
    progs = [tuple((_CODES[ins.kind], ins.micro_batch)
                   for ins in train_instructions(stage=s, num_stages=p, num_micro_batches=m)) for s in range(p)]
    # A message is (hop h between stages h and h + 1, micro-batch, 0 activations / 1 gradients).
    posted: dict[tuple[int, int, int], tuple[int, float]] = {}  # the end that arrived first, and when
    done: dict[tuple[int, int, int], float] = {}  # delivery, once both ends have arrived
    ptr, clock, transfer = [0] * p, [0.0] * p, [0.0] * p
    # Ops as [kind, micro-batch, start, end, send done]; a send patches the stage's latest op, which
    # is the one whose result it sends (the previous step's compute: see the module docstring).
    recs: list[list[list]] = [[] for _ in range(p)]
    remaining = sum(len(g) for g in progs)
    down = list(range(p))
    up = down[::-1]
    sweep = 0
    while remaining:
        progressed = 0
        for s in down if sweep % 2 == 0 else up:
            prog, k, t = progs[s], ptr[s], clock[s]
            rec = recs[s]
            while k < len(prog):
                code, i = prog[k]
                if code == 0:
                    rec.append([FORWARD, i, t, t + fwd_s[s], None])
                    t += fwd_s[s]
                elif code == 1:
                    rec.append([BACKWARD, i, t, t + bwd_s[s], None])
                    t += bwd_s[s]
                else:
                    # recv_act / send_grad talk to s - 1 over hop s - 1; send_act / recv_grad to s + 1 over hop s.
                    hop = s - 1 if code in (2, 3) else s
                    key = (hop, i, 1 if code in (3, 5) else 0)
                    arrived = done.get(key)
                    if arrived is None:
                        other = posted.get(key)
                        if other is None or other[0] == s:  # first here: wait for the other end
                            posted[key] = (s, t)
                            break
                        begin = t if t > other[1] else other[1]
                        arrived = done[key] = begin + p2p_s[hop]
                        del posted[key]
                        transfer[s] += p2p_s[hop]
                        transfer[other[0]] += p2p_s[hop]
                    t = arrived
                    if code in (3, 4):  # a send: the stage's latest op is the one whose result it was
                        rec[-1][4] = arrived
                k += 1
            progressed += k - ptr[s]
            ptr[s], clock[s] = k, t
        if not progressed:
            raise RuntimeError("lock-step pipeline deadlocked; this is a bug in the instruction order")
        remaining -= progressed
        sweep += 1
    return [StageSchedule(ops=tuple(TimedOp(kind, i, a, b, send_done_s=d) for kind, i, a, b, d in rec),
                          finish_s=clock[s], transfer_s=transfer[s]) for s, rec in enumerate(recs)]
