"""What a pipeline simulation returns, and the input check every simulation shares.

One home for the records of both event simulations, :mod:`hethub.schedules.simulate` (hethub's own
op order, asynchronous or blocking sends) and :mod:`hethub.schedules.lockstep` (DeepSpeed's pipeline
engine), so that the predictor reads either the same way; ``simulate`` re-exports them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class TimedOp:
    kind: str  # "F", "B" or "W"
    micro_batch: int
    start_s: float
    end_s: float
    chunk: int = 0  # model chunk (virtual stage) of the device; 0 without virtual stages
    # With blocking sends (p2p="blocking" or "lockstep"), when the message this op sends was delivered,
    # which is when the stage was free again (>= end_s); None where the op sends nothing or sends are
    # async. Under lockstep the span from end_s also holds the receive the runtime runs before that send.
    send_done_s: float | None = None


@dataclass(frozen=True)
class StageSchedule:
    ops: tuple[TimedOp, ...]
    finish_s: float  # end of the stage's last op (of its blocking send, if it sends one)
    # p2p="lockstep": the time the stage spent in transfers it took part in, sends and receives alike
    # (a rendezvous holds both ends for the whole transfer), summed by the simulation; None otherwise.
    transfer_s: float | None = None

    @property
    def send_blocked_s(self) -> float:
        """Time the stage spent held by its blocking sends (0 with asynchronous sends), from the end
        of each op that sends to the delivery of its message."""
        return sum(op.send_done_s - op.end_s for op in self.ops if op.send_done_s is not None)

    @property
    def exposed_p2p_s(self) -> float:
        """The stage's pipeline transfers that stand on its own timeline: exposed communication, not
        compute and not bubble. Blocking sends: the time held by them (:attr:`send_blocked_s`); lockstep:
        every transfer it is an end of (waiting for the other end to arrive is bubble); async: 0."""
        return self.send_blocked_s if self.transfer_s is None else self.transfer_s


def check_inputs(fwd_s: Sequence[float], bwd_s: Sequence[float], p2p_s: Sequence[float], m: int) -> int:
    """The number of stages, after checking the per-stage inputs agree (ValueError naming them if not)."""
    p = len(fwd_s)
    if p < 1 or len(bwd_s) != p:
        raise ValueError(f"need fwd_s and bwd_s of equal, non-zero length; got {len(fwd_s)} and {len(bwd_s)}")
    if len(p2p_s) not in (p - 1, p):
        raise ValueError(f"p2p_s needs {p - 1} or {p} entries for {p} stages, got {len(p2p_s)}")
    if m < 1:
        raise ValueError(f"num_micro_batches must be >= 1, got {m}")
    return p
