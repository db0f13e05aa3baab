"""Pipeline messages between virtual stages, and the op at which a stage knows a send has arrived.

An F op of chunk c sends its output to the next virtual stage, a B op its input's gradient to the
previous one; W sends nothing (virtual stage c x p + s is stage s's chunk c, p stages).

The runtime (``runtime/p2p.py``) never waits for a send before running its next op: a send stays
in flight while later ops compute, and its buffer is released at a point where it has certainly
arrived, so that waiting there never blocks. That point is read off the orders alone: a send from
stage a consumed by op x of stage b has arrived once a has received anything b sent after x (b
posts that message only after x has taken ours, and a collective inside x ties b's TP and CP ranks
together). ``send_releases`` gives, for each sending op, the op of the same stage whose receive
proves it (None: none does before the step ends, where every send is waited). Waiting there is
free, so the runtime's sends never hold a stage up: the simulation's ``async`` mode.

``peak_buffer_bytes`` is the one rule of what that costs in memory, used by the runtime's test and
by the memory model (``predict/memory``): counted after each op's sends are posted, the sends not
yet released plus the receive the next op posted before this op ran.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from hethub.schedules.base import Op


def consumer(op: Op, *, stage: int, num_stages: int, chunks: int) -> tuple[int, Op] | None:
    """(stage, op) that takes what ``op`` of ``stage`` sends, or None (W; the first virtual stage's
    B; the last's F)."""
    if op.kind == "W":
        return None
    v = op.chunk * num_stages + stage + (1 if op.kind == "F" else -1)
    if not 0 <= v < num_stages * chunks:
        return None
    return v % num_stages, Op(op.kind, op.micro_batch, v // num_stages)


def op_posts(op: Op, *, stage: int, num_stages: int, chunks: int) -> int:
    """Point-to-point operations ``op`` of ``stage`` posts, one per direction it talks in: its receive
    (an F of every virtual stage but the first, a B of every one but the last) and its send
    (``consumer``); W none. An F and a B of one virtual stage post as many."""
    if op.kind == "W":
        return 0
    v = op.chunk * num_stages + stage
    receives = v > 0 if op.kind == "F" else v < num_stages * chunks - 1
    return int(receives) + (consumer(op, stage=stage, num_stages=num_stages, chunks=chunks) is not None)


def send_releases(orders: Sequence[Sequence[Op]], stage: int, *, chunks: int = 1) -> dict[Op, Op | None]:
    """For every op of ``orders[stage]`` that sends, the op of the same stage after whose receive the
    send has certainly arrived (module doc), or None. ``orders``: every stage's op order, as run."""
    p = len(orders)
    # Positions of ops in the stages asked (this one and its neighbours), not in every stage's order.
    positions: dict[int, dict[Op, int]] = {}

    def index(b: int) -> dict[Op, int]:
        got = positions.get(b)
        if got is None:
            got = positions[b] = {op: i for i, op in enumerate(orders[b])}
        return got

    # next_to[b][i]: what the first op of stage b at or after index i sends to ``stage``, as the op of
    # ``stage`` that takes it (None: nothing more).
    next_to: dict[int, list[Op | None]] = {}
    out: dict[Op, Op | None] = {}
    for op in orders[stage]:
        dest = consumer(op, stage=stage, num_stages=p, chunks=chunks)
        if dest is None:
            continue
        b, taken_by = dest
        x = index(b).get(taken_by)
        if b not in next_to:
            nxt: list[Op | None] = [None] * (len(orders[b]) + 1)
            for i in range(len(orders[b]) - 1, -1, -1):
                back = consumer(orders[b][i], stage=b, num_stages=p, chunks=chunks)
                nxt[i] = back[1] if back is not None and back[0] == stage else nxt[i + 1]
            next_to[b] = nxt
        proof = None if x is None else next_to[b][x + 1]
        out[op] = proof if proof is not None and index(stage).get(proof, -1) > index(stage)[op] else None
    return out


def peak_buffer_bytes(order: Sequence[Op], releases: dict[Op, Op | None], *, sent: Callable[[Op], float],
                      received: Callable[[Op], float]) -> float:
    """Most bytes of point-to-point buffers one rank holds, counted after each op's sends are posted
    (module doc). ``sent(op)``: bytes of the buffers op's sends hold (one per distinct payload);
    ``received(op)``: bytes of the buffer op receives into."""
    pos = {op: i for i, op in enumerate(order)}
    freed_at: dict[int, float] = {}
    live = peak = 0.0
    for i, op in enumerate(order):
        live -= freed_at.pop(i, 0.0)
        if op in releases:
            live += sent(op)
            rel = releases[op]
            if rel is not None:
                freed_at[pos[rel]] = freed_at.get(pos[rel], 0.0) + sent(op)
        peak = max(peak, live + (received(order[i + 1]) if i + 1 < len(order) else 0.0))
    return peak
