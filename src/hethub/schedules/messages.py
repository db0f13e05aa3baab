"""Pipeline messages between virtual stages, and when a stage knows a send it posted is complete.

An F op of chunk c sends its output to the next virtual stage, a B op its input's gradient to the
previous one; W sends nothing (virtual stage c x p + s is stage s's chunk c, p stages).

The runtime (``runtime/p2p.py``) waits on a send only once it is complete: it posts each op's
sends and goes on, and before and after every op hands back the sends it observes complete (a
completion query, which never blocks; on gloo, whose sends report completion only once waited on,
it waits at the op this module names instead). When a send is complete follows from NCCL's rule
that a send larger than its buffering completes when the matching receive runs: every stage posts
op x's receive right after taking op x - 1's (at the step's start for x = 0), so a send consumed by
op x of stage b completes once b has started op x - 1 and the transfer is over, and the stage that
sent it knows so once it has received a message b (or a stage that heard from b) sent after that
(``known_starts``). ``send_releases`` gives, for each sending op, the first op of the same stage at
whose receive that is known (None: only at the step's end): the release when each transfer
finishes before the sender's next completion query, which is the moment the tests' model of NCCL
takes (no wire time). On a link slower than the sender's compute a send is handed back at a later
query.

``peak_buffer_bytes`` is the one rule of what that costs in memory, used by the runtime's test and
by the memory model (``predict/memory``): counted after each op's sends are posted, the sends not
yet released plus the receive posted for the next op; ``max_live_messages`` bounds its count.
``held_counts`` gives the same walk as counts of messages by kind, which the memory model keeps per
pipeline shape and prices for any message sizes.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar

from hethub.schedules.base import Op

T = TypeVar("T")
H = TypeVar("H")


def consumer(op: Op, *, stage: int, num_stages: int, chunks: int) -> tuple[int, Op] | None:
    """(stage, op) that takes what ``op`` of ``stage`` sends, or None (W; the first virtual stage's
    B; the last's F)."""
    return _neighbour(op, stage=stage, num_stages=num_stages, chunks=chunks, towards=1)


def producer(op: Op, *, stage: int, num_stages: int, chunks: int) -> tuple[int, Op] | None:
    """(stage, op) whose message ``op`` of ``stage`` receives, or None (W; the first virtual stage's
    F; the last's B)."""
    return _neighbour(op, stage=stage, num_stages=num_stages, chunks=chunks, towards=-1)


def _neighbour(op: Op, *, stage: int, num_stages: int, chunks: int, towards: int) -> tuple[int, Op] | None:
    """The op of the next (``towards`` = 1) or previous (-1) virtual stage in ``op``'s direction of
    travel that shares its message, or None."""
    if op.kind == "W":
        return None
    v = op.chunk * num_stages + stage + (towards if op.kind == "F" else -towards)
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


def known_starts(orders: Sequence[Sequence[Op]], *, chunks: int = 1) -> list[list[tuple[int, ...]]]:
    """``out[s][i][b]``: the last op index of stage b that stage s knows b has started once it has
    taken op i's receive (-1: none), learnt through the messages it received, directly or through
    other stages (vector clocks over stages). A stage's TP and CP ranks count as one: every op of
    a stage with several ranks runs collectives among them."""
    p = len(orders)
    sent_with: dict[tuple[int, Op], tuple[int, ...]] = {}  # what a message carries: its sender's knowledge
    out: list[list[tuple[int, ...]]] = [[] for _ in range(p)]
    known = [(-1,) * p for _ in range(p)]
    moved = True
    while moved:
        moved = False
        for s in range(p):
            while len(out[s]) < len(orders[s]):
                i = len(out[s])
                op = orders[s][i]
                src = producer(op, stage=s, num_stages=p, chunks=chunks)
                k = known[s]
                if src is not None:
                    if src not in sent_with:
                        break  # not sent yet
                    k = tuple(max(a, b) for a, b in zip(k, sent_with[src], strict=True))
                k = (*k[:s], i, *k[s + 1:])
                known[s] = k
                out[s].append(k)
                sent_with[(s, op)] = k
                moved = True
    stuck = [s for s in range(p) if len(out[s]) < len(orders[s])]
    if stuck:
        raise ValueError(f"the op orders deadlock: stages {stuck} wait for messages never sent")
    return out


def send_releases(orders: Sequence[Sequence[Op]], stage: int, *, chunks: int = 1,
                  known: Sequence[Sequence[tuple[int, ...]]] | None = None) -> dict[Op, Op | None]:
    """For every op of ``orders[stage]`` that sends, the first op of the same stage at whose receive
    the stage knows the send complete (module doc), or None. ``orders``: every stage's op order, as run;
    ``known``: ``known_starts(orders)`` where the caller has it (it serves every stage)."""
    p = len(orders)
    known = (known if known is not None else known_starts(orders, chunks=chunks))[stage]
    index = {b: {op: i for i, op in enumerate(o)} for b, o in enumerate(orders)}
    heard = {b: [k[b] for k in known] for b in range(p)}  # vector clocks never decrease
    return _first_known(orders[stage], [consumer(op, stage=stage, num_stages=p, chunks=chunks) for op in orders[stage]],
                        index=index, heard=heard)


def line_releases(orders: Sequence[Sequence[T]], stage: int, *,
                  kinds: Sequence[str] | None = None) -> dict[T, T | None]:
    """``send_releases`` of a pipeline without virtual stages, in O(ops) instead of ``known_starts``'
    O(ops x stages): on a line of stages every path from a neighbour to this stage ends with that
    neighbour's own message (a path through the far side passes this stage, which knew as much
    then), so what the stage knows of a neighbour is the last op of it whose message it took.
    An op and the neighbour's op that shares its message are equal (one chunk), so the orders may be
    of any values naming ops: `Op`s, or the event simulation's integer codes with ``kinds``, the kind
    ("F", "B" or "W") of each op of the stage's order (default: each `Op`'s). ``tests/unit/test_messages_line.py``
    checks it against ``send_releases`` exhaustively."""
    p, order = len(orders), orders[stage]
    up, down = stage - 1 if stage > 0 else None, stage + 1 if stage + 1 < p else None
    index = {b: {op: i for i, op in enumerate(orders[b])} for b in (up, down) if b is not None}
    kinds = [op.kind for op in order] if kinds is None else kinds
    # Per op, the neighbour it receives from and the one it sends to (None: none).
    srcs = [up if k == "F" else down if k == "B" else None for k in kinds]
    dests = [down if k == "F" else up if k == "B" else None for k in kinds]
    heard: dict[int, list[int]] = {}  # per neighbour, per op: its last op known
    for b, at in index.items():
        last, col = -1, []
        for op, src in zip(order, srcs, strict=True):
            if src == b and (x := at[op]) > last:
                last = x
            col.append(last)
        heard[b] = col
    return _first_known(order, [None if b is None else (b, op) for op, b in zip(order, dests, strict=True)],
                        index=index, heard=heard)


def _first_known(order: Sequence[T], dests: Sequence[tuple[int, T] | None], *, index: Mapping[int, dict[T, int]],
                 heard: Mapping[int, list[int]]) -> dict[T, T | None]:
    """``send_releases``' answer from ``heard[b][i]``, the last op of stage b the stage knows of after
    its op i (never decreasing in i), and ``dests[i]``, the stage and op that take op i's message (None:
    it sends none): for each sending op, the first later op where that reaches the op before the
    consumer's (its receive is posted then), or None."""
    out: dict[T, T | None] = {}
    n = len(order)
    for i, (op, dest) in enumerate(zip(order, dests, strict=True)):
        if dest is None:
            continue
        b, taken_by = dest
        x = index[b].get(taken_by)
        j = n if x is None else bisect.bisect_left(heard[b], max(x - 1, 0), lo=i + 1)
        out[op] = order[j] if j < n else None
    return out


def ring_releases(orders: Sequence[Sequence[Op]], *, chunks: int) -> list[dict[Op, Op | None]]:
    """``send_releases`` of every stage at once, in O(ops x stages) plain integer steps: what stage s
    knows of stage b after op i is propagated column by column (one stage b at a time) instead of as
    ``known_starts``' vectors of every stage per op, which the stages' order of messages allows with
    virtual stages too (the wrap makes the stages a ring, so knowledge of a neighbour may come round
    it). ``tests/unit/test_messages_line.py`` checks it against ``send_releases`` exhaustively."""
    p = len(orders)
    gid = [{op: k for k, op in enumerate(o)} for o in orders]
    base = [0]
    for o in orders:
        base.append(base[-1] + len(o))
    n = base[-1]
    # One topological order of all ops (each stage's in order, a receive after its send), and each
    # op's previous op on its stage and producer as global indices (n: none, whose column value is -1).
    prev, src, topo = [n] * n, [n] * n, []
    done, ptr, moved = [False] * (n + 1), [0] * p, True
    done[n] = True
    while moved:
        moved = False
        for s in range(p):
            while ptr[s] < len(orders[s]):
                i = ptr[s]
                g = base[s] + i
                pr = producer(orders[s][i], stage=s, num_stages=p, chunks=chunks)
                if pr is not None:
                    src[g] = base[pr[0]] + gid[pr[0]][pr[1]]
                    if not done[src[g]]:
                        break
                prev[g] = g - 1 if i > 0 else n
                done[g] = True
                topo.append(g)
                ptr[s] += 1
                moved = True
    if len(topo) < n:
        raise ValueError("the op orders deadlock: some stages wait for messages never sent")
    heard: list[dict[int, list[int]]] = [{} for _ in range(p)]  # heard[s][b][i]: b's last op s knows of
    wanted = [set() for _ in range(p)]  # per b, the stages that send to it
    for s in range(p):
        for op in orders[s]:
            dest = consumer(op, stage=s, num_stages=p, chunks=chunks)
            if dest is not None:
                wanted[dest[0]].add(s)
    for b in range(p):
        if not wanted[b]:
            continue
        col = [-1] * (n + 1)
        lo, hi = base[b], base[b + 1]
        for g in topo:
            if lo <= g < hi:
                col[g] = g - lo
            else:
                x, y = col[prev[g]], col[src[g]]
                col[g] = x if x > y else y
        for s in wanted[b]:
            heard[s][b] = col[base[s]:base[s + 1]]
    index = dict(enumerate(gid))
    return [_first_known(orders[s], [consumer(op, stage=s, num_stages=p, chunks=chunks) for op in orders[s]],
                         index=index, heard=heard[s]) for s in range(p)]


def max_live_messages(in_flight: float) -> float:
    """Most messages' buffers (per receiver of a sliced hop) a rank holds at once, counted as
    ``peak_buffer_bytes`` counts, for a stage that holds ``in_flight`` activations (micro-batches;
    (micro-batch, chunk) pairs with virtual stages): the in-flight count plus one, for every
    registered order, when sends are handed back where ``send_releases`` says (the receive posted
    for the next op, or the op's own send, above one message per activation held).
    ``tests/unit/test_nccl_replay.py`` checks it on the executor's trace."""
    return in_flight + 1


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


def held_counts(order: Sequence[T], releases: Mapping[T, T | None], *, forward: Sequence[bool],
                receives: Sequence[H]) -> set[tuple[int, int, H | None]]:
    """``peak_buffer_bytes``' walk as counts: after each op's sends are posted, (forward sends not yet
    released, backward sends not yet released, what the next op receives: ``receives`` of it, None after
    the last). ``forward[i]``: op i's send is an activation (an F's), not a gradient. With the bytes of
    a kind's sends and of each receive, the peak is the largest total of these (``held_terms``, checked
    against ``peak_buffer_bytes`` in ``tests/unit/test_p2p_buffers.py``). Ops of any values
    (`line_releases`)."""
    pos = {op: i for i, op in enumerate(order)}
    freed_at: dict[int, list[bool]] = {}
    fwd = bwd = 0
    out: set[tuple[int, int, H | None]] = set()
    for i, (op, nxt) in enumerate(zip(order, [*receives[1:], None], strict=True)):
        if i in freed_at:
            for f in freed_at.pop(i):
                if f:
                    fwd -= 1
                else:
                    bwd -= 1
        if op in releases:
            f = forward[i]
            if f:
                fwd += 1
            else:
                bwd += 1
            if (rel := releases[op]) is not None:
                freed_at.setdefault(pos[rel], []).append(f)
        out.add((fwd, bwd, nxt))
    return out
