"""The point-to-point buffers a pipeline stage holds beside its activations.

The runtime (``runtime/p2p.py``) posts each op's receive one op ahead and leaves its sends in flight
until they are complete, at the latest the op from which the stage knows the peer posted the
matching receive (``schedules.messages.known_starts, send_releases``); a sent stage output keeps no values. The rule of
what that holds at once is ``schedules.messages.peak_buffer_bytes`` over the stage's order (the
runtime's traced bytes equal it on TP rank 0: ``tests/unit/test_nccl_replay.py``); here are the
bytes of each message, as one device of the stage holds them: its TP rank 0, which sends and
receives on both boundaries. A message is one CP rank's activation or gradient, moved as
``layout.hop`` says (whole, a flat 1/t, or sequence slices, one per receiver), in the dtype of the
stage that sends the activation (its gradient comes back in the same dtype).
"""

from __future__ import annotations

from dataclasses import dataclass

from hethub.layout import hop
from hethub.memo import Kept, kept_lru, reference
from hethub.plan import Plan, Stage
from hethub.predict.memory.model import act_bytes_for
from hethub.schedules import Op, get_schedule
from hethub.schedules.event_sim import code_kind, order_codes
from hethub.schedules.messages import (
    held_counts,
    known_starts,
    line_releases,
    peak_buffer_bytes,
    ring_releases,
    send_releases,
)


@dataclass(frozen=True)
class MessageBytes:
    """Bytes one device of a stage holds per message: what an F sends (its output) and receives (its
    input), what a B sends (its input's gradient) and receives (its output's gradient); ``wrap_*``:
    the same across the wrap between the last stage and the first (virtual stages)."""

    f_sent: float = 0.0
    f_received: float = 0.0
    b_sent: float = 0.0
    b_received: float = 0.0
    wrap_f_sent: float = 0.0
    wrap_f_received: float = 0.0
    wrap_b_sent: float = 0.0
    wrap_b_received: float = 0.0


# Reference path (hethub/memo.py): peaks by (schedule, message bytes, stage, stages,
# micro-batches, chunks), each a replay of the stage's order.
_PEAKS = Kept(100_000)
# Past the pipeline's depth, 1F1B and ZB-H1 (and the interleaved schedule at one chunk, whose
# order is 1F1B's) only repeat one steady window per added micro-batch, so a stage's peak is the same
# for every count from p on. The walk runs the smallest count of the same peak (`walked_micro_batches`,
# with margin); tests/unit/test_p2p_buffers.py checks it against the full walk.
STEADY_SCHEDULES = frozenset({"1f1b", "zb-h1"})


def walked_micro_batches(schedule: str, *, num_stages: int, num_micro_batches: int, chunks: int) -> int:
    """The micro-batch count whose walk gives the same buffer peak as ``num_micro_batches`` (above)."""
    p, m = num_stages, num_micro_batches
    if schedule in STEADY_SCHEDULES or (schedule == "interleaved" and chunks == 1):
        return min(m, p + 2)
    return m  # GPipe holds every forward's sends (its peak grows with the count); interleaved: below


def peak_micro_batches(schedule: str, *, num_stages: int, num_micro_batches: int, chunks: int) -> int:
    """The micro-batch count whose walk holds the same counts of messages at its peak as
    ``num_micro_batches`` (`held_terms`), for any message sizes: `walked_micro_batches`, and for
    interleaving with several chunks the count's class under its period. Its order takes the
    micro-batches in groups of p after a first group of p + m mod p; from m = 3p on, adding p
    micro-batches adds one steady group, which repeats what the stage holds, so the counts depend on
    m only through m mod p (tests/unit/test_p2p_buffers.py: every stage, p <= 6, v <= 4, m to 6p + 8)."""
    p, m = num_stages, num_micro_batches
    if schedule == "interleaved" and chunks > 1 and m >= 3 * p:
        return 3 * p + (m - 3 * p) % p
    return walked_micro_batches(schedule, num_stages=p, num_micro_batches=m, chunks=chunks)


@kept_lru(maxsize=256)
def _orders(schedule: str, *, num_stages: int, num_micro_batches: int, chunks: int) -> tuple[tuple[Op, ...], ...]:
    sched = get_schedule(schedule, chunks=chunks)
    return tuple(tuple(sched.ops(stage=s, num_stages=num_stages, num_micro_batches=num_micro_batches))
                 for s in range(num_stages))


@kept_lru(maxsize=1024)
def _releases(schedule: str, *, num_stages: int, num_micro_batches: int, chunks: int, stage: int,
              ) -> tuple[tuple[Op, ...], dict[Op, Op | None]]:
    orders = _orders(schedule, num_stages=num_stages, num_micro_batches=num_micro_batches, chunks=chunks)
    known = _known(schedule, num_stages=num_stages, num_micro_batches=num_micro_batches, chunks=chunks)
    return orders[stage], send_releases(orders, stage, chunks=chunks, known=known)


@kept_lru(maxsize=256)
def _known(schedule: str, *, num_stages: int, num_micro_batches: int, chunks: int,
           ) -> list[list[tuple[int, ...]]]:
    """`known_starts` of a pipeline shape's orders, once for all its stages."""
    orders = _orders(schedule, num_stages=num_stages, num_micro_batches=num_micro_batches, chunks=chunks)
    return known_starts(orders, chunks=chunks)


@kept_lru(maxsize=256)
def _ring(schedule: str, *, num_stages: int, num_micro_batches: int, chunks: int) -> list[dict[Op, Op | None]]:
    """Every stage's ``send_releases`` of a pipeline with virtual stages, column by column (``ring_releases``)."""
    orders = _orders(schedule, num_stages=num_stages, num_micro_batches=num_micro_batches, chunks=chunks)
    return ring_releases(orders, chunks=chunks)


def _line_orders(schedule: str, *, stage: int, num_stages: int, num_micro_batches: int,
                 ) -> tuple[tuple[int, ...], list[str], dict[int, int | None]]:
    """A stage's order without virtual stages, its ops' kinds and its ``send_releases``, on a line of stages
    from its own and its neighbours' orders alone (``line_releases``), as the event simulation's integer
    codes (``order_codes``: the predictor walks every stage of pipelines 80 stages deep)."""
    p, m = num_stages, num_micro_batches
    orders: list[tuple[int, ...]] = [()] * p  # line_releases reads the stage and its neighbours only
    for b in range(max(0, stage - 1), min(p, stage + 2)):
        orders[b] = order_codes(p, b, m, schedule)
    kinds = [code_kind(c, m=m) for c in orders[stage]]
    return orders[stage], kinds, line_releases(orders, stage, kinds=kinds)


@dataclass(frozen=True)
class HeldTerms:
    """What a stage's point-to-point buffers hold at each candidate for their peak, as counts:
    (forward sends, backward sends, the next op's receive: 0 none, 1 a forward's, 2 a backward's),
    only those no other row covers (sizes are never negative)."""

    rows: tuple[tuple[int, int, int], ...]

    def peak_bytes(self, msgs: MessageBytes, *, first: bool, last: bool) -> float:
        f_sent = msgs.wrap_f_sent if last else msgs.f_sent
        b_sent = msgs.wrap_b_sent if first else msgs.b_sent
        received = (0.0, msgs.wrap_f_received if first else msgs.f_received,
                    msgs.wrap_b_received if last else msgs.b_received)
        return max((f * f_sent + b * b_sent + received[r] for f, b, r in self.rows), default=0.0)


def held_terms(schedule: str, *, stage: int, num_stages: int, num_micro_batches: int, chunks: int) -> HeldTerms:
    """The stage's `HeldTerms` (``schedules.messages.held_counts`` over its order and releases), kept per
    pipeline shape and class of micro-batch count (`peak_micro_batches`): the planner prices thousands
    of stages of a few shapes with different sizes."""
    m = peak_micro_batches(schedule, num_stages=num_stages, num_micro_batches=num_micro_batches, chunks=chunks)
    if schedule == "1f1b" or (schedule == "interleaved" and chunks == 1):
        # A 1F1B stage's order, and its neighbours', depend only on the stages after it (its warm-up)
        # and m; its counts on d = p - s, whether it is first, and min(m, d + 1): the same stage of the
        # shortest pipeline with that tail (tests/unit/test_p2p_buffers.py, to 10 stages).
        d = num_stages - stage
        stage, num_stages, m = (0, d, min(m, d + 1)) if stage == 0 else (1, d + 1, min(m, d + 1))
    return _held_terms(schedule, stage=stage, num_stages=num_stages, num_micro_batches=m, chunks=chunks)


@kept_lru(maxsize=65536)
def _held_terms(schedule: str, *, stage: int, num_stages: int, num_micro_batches: int, chunks: int) -> HeldTerms:
    first, last = stage == 0, stage == num_stages - 1

    def receives(kind: str, chunk: int = 0) -> int:  # which receive an op posts, as `_peak` prices it
        if kind == "W":
            return 0
        if kind == "F":
            return 0 if first and chunk == 0 else 1
        return 0 if last and chunk == chunks - 1 else 2

    if chunks == 1:
        codes, kinds, releases = _line_orders(schedule, stage=stage, num_stages=num_stages,
                                              num_micro_batches=num_micro_batches)
        rows = held_counts(codes, releases, forward=[k == "F" for k in kinds], receives=[receives(k) for k in kinds])
    else:  # virtual stages: the ring's releases (``ring_releases``)
        shape = {"num_stages": num_stages, "num_micro_batches": num_micro_batches, "chunks": chunks}
        order, releases = _orders(schedule, **shape)[stage], _ring(schedule, **shape)[stage]
        rows = held_counts(order, releases, forward=[op.kind == "F" for op in order],
                           receives=[receives(op.kind, op.chunk) for op in order])
    rows = {(f, b, 0 if r is None else r) for f, b, r in rows}  # None: after the last op, nothing is received
    return HeldTerms(_uncovered(rows))


def _uncovered(rows: set[tuple[int, int, int]]) -> tuple[tuple[int, int, int], ...]:
    """The rows no other row covers: a row with a receive is covered only by one with the same receive
    and at least its counts; one without, by any other row with at least its counts."""
    def front(points: set[tuple[int, int]]) -> set[tuple[int, int]]:  # the maximal (f, b) pairs
        out, best_b = set(), -1
        for f, b in sorted(points, key=lambda x: (-x[0], -x[1])):
            if b > best_b:
                out.add((f, b))
                best_b = b
        return out

    keep = {(f, b, r) for r in (1, 2) for f, b in front({(f, b) for f, b, rr in rows if rr == r})}
    received = {(f, b) for f, b, r in rows if r}
    keep |= {(f, b, 0) for f, b in front({(f, b) for f, b, _ in rows}) if (f, b, 0) in rows and (f, b) not in received}
    return tuple(sorted(keep))


def p2p_buffer_bytes(schedule: str, msgs: MessageBytes, *, stage: int, num_stages: int, num_micro_batches: int,
                     chunks: int = 1) -> float:
    """Peak bytes of the point-to-point buffers one device of the stage holds at once (module doc)."""
    if not reference():
        terms = held_terms(schedule, stage=stage, num_stages=num_stages, num_micro_batches=num_micro_batches,
                           chunks=chunks)
        return terms.peak_bytes(msgs, first=stage == 0, last=stage == num_stages - 1)
    num_micro_batches = walked_micro_batches(schedule, num_stages=num_stages, num_micro_batches=num_micro_batches,
                                             chunks=chunks)
    return _PEAKS.get((schedule, msgs, stage, num_stages, num_micro_batches, chunks),
                      lambda: _peak(schedule, msgs, stage=stage, num_stages=num_stages,
                                    num_micro_batches=num_micro_batches, chunks=chunks))


def _peak(schedule: str, msgs: MessageBytes, *, stage: int, num_stages: int, num_micro_batches: int,
          chunks: int) -> float:
    """The rule itself: ``peak_buffer_bytes`` over the stage's order (the oracle of `held_terms`)."""
    order, releases = _releases(schedule, num_stages=num_stages, num_micro_batches=num_micro_batches,
                                chunks=chunks, stage=stage)
    first, last = stage == 0, stage == num_stages - 1

    def sent(op: Op) -> float:
        if op.kind == "F":
            return msgs.wrap_f_sent if last else msgs.f_sent
        return msgs.wrap_b_sent if first else msgs.b_sent

    def received(op: Op) -> float:
        if op.kind == "F":
            return (msgs.wrap_f_received if op.chunk > 0 else 0.0) if first else msgs.f_received
        if op.kind == "B":
            return (msgs.wrap_b_received if op.chunk < chunks - 1 else 0.0) if last else msgs.b_received
        return 0.0

    return peak_buffer_bytes(order, releases, sent=sent, received=received)


def _piece_bytes(src: Stage, dst: Stage, *, numel: int, elem: int, flat: bool, sending: bool) -> float:
    """Bytes TP rank 0 of ``src`` sends (``sending``), or TP rank 0 of ``dst`` receives, of one message
    from ``src`` to ``dst`` (``layout.hop``; runtime/stage_messages.py)."""
    h = hop(src_tp=src.tp, src_sp=src.sequence_parallel, dst_tp=dst.tp, dst_sp=dst.sequence_parallel, numel=numel,
            flat=flat)
    whole = numel * elem
    if h.piece == "whole":
        return whole
    if not sending:
        return whole / h.parts
    # Pieces: a sequence-parallel sender facing its own degree sends the slice it holds; any other
    # sender cuts one piece per receiver it serves (receivers q = 0, a, 2a, ... for TP rank 0).
    own = h.piece == "seq" and src.sequence_parallel and not h.source_gathers
    return whole / h.parts * (1 if own else -(-dst.tp // src.tp))


def message_bytes(plan: Plan, pi: int, si: int) -> MessageBytes:
    """The bytes of each message of stage ``si`` of pipeline ``pi`` on its TP rank 0 (module doc)."""
    p = plan.pipelines[pi]
    n, s = len(p.stages), p.stages[si]
    numel = p.micro_batch_size * plan.seq_len // s.cp * plan.model.hidden_size  # one CP rank's message

    def elem_of(stage: Stage) -> int:
        return act_bytes_for(plan.precision_of(stage.kind))

    out: dict[str, float] = {}
    if si < n - 1:  # activations to the next stage (its dtype: ours), gradients back
        nxt = p.stages[si + 1]
        e = elem_of(s)
        out["f_sent"] = _piece_bytes(s, nxt, numel=numel, elem=e, flat=True, sending=True)
        out["b_received"] = _piece_bytes(nxt, s, numel=numel, elem=e, flat=True, sending=False)
    if si > 0:  # activations from the previous stage (its dtype), gradients back
        prev = p.stages[si - 1]
        e = elem_of(prev)
        out["f_received"] = _piece_bytes(prev, s, numel=numel, elem=e, flat=True, sending=False)
        out["b_sent"] = _piece_bytes(s, prev, numel=numel, elem=e, flat=True, sending=True)
    if p.virtual_stages > 1:  # the wrap: the last stage's output into the first, whole-tensor rule
        first, last = p.stages[0], p.stages[-1]
        e = elem_of(last)
        if si == n - 1:
            out["wrap_f_sent"] = _piece_bytes(last, first, numel=numel, elem=e, flat=False, sending=True)
            out["wrap_b_received"] = _piece_bytes(first, last, numel=numel, elem=e, flat=False, sending=False)
        if si == 0:
            out["wrap_f_received"] = _piece_bytes(last, first, numel=numel, elem=e, flat=False, sending=False)
            out["wrap_b_sent"] = _piece_bytes(first, last, numel=numel, elem=e, flat=False, sending=True)
    return MessageBytes(**out)
