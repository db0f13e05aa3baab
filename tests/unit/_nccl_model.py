"""A model of NCCL's ordering rules, pure Python: replays the operations each rank posted (recorded
through the communicator: ``hethub.comm.recording``) and says whether every rank finishes.

The rules, as torch's ProcessGroupNCCL drives NCCL:

- Each communicator has one stream per rank; a rank's operations on it run in the order it issued
  them, one *unit* after the other. A unit is a lone isend or irecv, the operations of one batch
  (``batch_isend_irecv``: one ncclGroupStart/End) on that communicator, or a collective.
- A lone isend/irecv runs on the communicator of its rank pair (torch creates one per pair); a
  batch runs on the communicator of its group, which the group's collectives share.
- Sends and receives between two ranks on one communicator match in issue order; tags are ignored.
  Matched operations whose tags or sizes differ fail the replay (NCCL would deliver the wrong tensor).
- A send of at most ``eager_bytes`` completes once it runs (the receiver's buffer takes it); a larger
  one only when its receive runs too. A receive completes when it runs and its send has run.
- A unit completes when all its operations have; then the stream's next unit runs. The operations
  of a batch therefore progress together, whatever their order inside it.
- A collective runs once it heads its stream on every member of its group, and completes then.
  Members must post a group's collectives in the same order (names and sizes are checked).
- A wait blocks the rank until every operation posted under its handle has completed (a
  synchronous collective is recorded as the collective, then a wait). A GPU wait only makes the
  compute stream wait, but every later NCCL operation waits for the compute stream, so blocking
  the rank is equivalent for completion.
- Unordered channels (gloo, the bridge's host path): each operation progresses alone; sends and
  receives match by peer and tag in posting order; a send above ``eager_bytes`` completes once its
  receive is posted, a receive once its send is posted.

The replay succeeds when every rank has run all its events and every posted operation completed.

What a rank knows (:func:`known_complete`): vector clocks over the replay. A completion carries the
clocks of the posts it needed (its own and its match's, or every member's, and whatever completed
ahead of them on their streams); a wait merges them into the rank's clock. A rank knows a send of
its own complete once its clock covers the other ranks' part of the send's completion (its own
part, its posts, it knows already): from the first *observation* (a wait on anything but sends
alone) that brings that knowledge, or from the post itself when it already had it. That is the
earliest a completion query can answer yes in every timing where transfers take no time.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from hethub.comm.recording import Collective, Event, Note, OpRecord, Post, Wait


class Deadlock(AssertionError):
    """Some rank can never finish: the message says where each rank stands."""


class Mismatch(AssertionError):
    """Two operations NCCL would pair do not belong together (different tags, sizes or collectives)."""


@dataclass(eq=False)
class _Op:
    rank: int
    rec: OpRecord | None  # None: a collective
    coll: Collective | None
    unit: _Unit | None  # None on an unordered channel
    posted: tuple[int, ...] = ()  # the rank's vector clock at the post
    clock: tuple[int, ...] = ()  # the clock of its completion (what it needed)
    done: bool = False
    match: _Op | None = None
    peers: list[_Op] = field(default_factory=list)  # a collective's instance on every member

    @property
    def nbytes(self) -> int:
        return self.rec.nbytes if self.rec else self.coll.nbytes  # type: ignore[union-attr]

    def describe(self) -> str:
        if self.coll is not None:
            return f"{self.coll.name}{self.coll.group}"
        r = self.rec
        arrow = "->" if r.op == "send" else "<-"  # type: ignore[union-attr]
        return f"{r.op} {arrow} {r.peer} tag {r.tag} ({r.nbytes} B on {r.channel.name})"  # type: ignore[union-attr]


@dataclass(eq=False)
class _Unit:
    stream: tuple[Any, ...]
    ops: list[_Op]


def _join(*clocks: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(map(max, *clocks)) if len(clocks) > 1 else clocks[0]


class _Replay:
    def __init__(self, events: dict[int, list[Event]], *, eager_bytes: int) -> None:
        self.events, self.eager = events, eager_bytes
        self.pc = dict.fromkeys(events, 0)
        self.handles: dict[tuple[int, int], list[_Op]] = {}
        self.streams: dict[tuple[Any, ...], deque[_Unit]] = {}
        self.unordered: list[_Op] = []
        self.ordered: list[_Op] = []
        # Operations waiting for their partner, by matching key: ordered p2p per (communicator,
        # src, dst), unordered per (channel, src, dst, tag), collectives per (communicator, group).
        self.sends: dict[tuple[Any, ...], deque[_Op]] = {}
        self.recvs: dict[tuple[Any, ...], deque[_Op]] = {}
        self.colls: dict[tuple[Any, ...], dict[int, deque[_Op]]] = {}
        # (rank, event index) of every wait on sends alone that found them not yet complete.
        self.blocked_sends: set[tuple[int, int]] = set()
        # Vector clocks (module doc): a rank's own entry is the index of its event being run.
        self.ranks = sorted(events)
        self.slot = {r: i for i, r in enumerate(self.ranks)}
        self.clock = {r: (-1,) * len(self.ranks) for r in self.ranks}
        self.done_clock: dict[tuple[Any, ...], tuple[int, ...]] = {}  # per stream: its last completed unit's
        self.observed: dict[int, list[tuple[int, ...]]] = {r: [] for r in self.ranks}  # the clock at each observation

    # ---- posting ---------------------------------------------------------------------------------
    def _enqueue(self, rank: int, stream: tuple[Any, ...], ops: list[_Op]) -> None:
        unit = _Unit(stream=(rank, *stream), ops=ops)
        for op in ops:
            op.unit = unit
        self.streams.setdefault(unit.stream, deque()).append(unit)

    def _pair(self, op: _Op, key: tuple[Any, ...], *, ordered: bool) -> None:
        r = op.rec
        assert r is not None
        src, dst = (op.rank, r.peer) if r.op == "send" else (r.peer, op.rank)
        k = (*key, src, dst) if ordered else (*key, src, dst, r.tag)
        mine, theirs = (self.sends, self.recvs) if r.op == "send" else (self.recvs, self.sends)
        waiting = theirs.get(k)
        if waiting:
            other = waiting.popleft()
            if ordered and (other.rec.tag != r.tag or other.rec.nbytes != r.nbytes):  # type: ignore[union-attr]
                raise Mismatch(f"on {key}, rank {op.rank}'s {op.describe()} pairs with rank {other.rank}'s "
                               f"{other.describe()}: NCCL matches in issue order, not by tag")
            op.match, other.match = other, op
        else:
            mine.setdefault(k, deque()).append(op)

    def _stamp(self, rank: int) -> tuple[int, ...]:
        i = self.slot[rank]
        c = self.clock[rank]
        self.clock[rank] = (*c[:i], self.pc[rank], *c[i + 1:])
        return self.clock[rank]

    def _post(self, rank: int, ev: Post) -> None:
        ops: list[_Op] = []
        by_stream: dict[tuple[Any, ...], list[_Op]] = {}
        stamp = self._stamp(rank)
        for rec in ev.ops:
            op = _Op(rank=rank, rec=rec, coll=None, unit=None, posted=stamp)
            ops.append(op)
            if not rec.channel.ordered:
                self.unordered.append(op)
                self._pair(op, (rec.channel.name,), ordered=False)
                continue
            # A lone operation runs on its rank pair's communicator, a batch on its group's.
            key = (rec.channel.name,) if ev.batched else (rec.channel.name, *sorted((rank, rec.peer)))
            by_stream.setdefault(key, []).append(op)
            self.ordered.append(op)
            self._pair(op, key, ordered=True)
        for key, unit_ops in by_stream.items():
            self._enqueue(rank, key, unit_ops)
        self.handles[(rank, ev.handle)] = ops

    def _collective(self, rank: int, ev: Collective) -> None:
        if rank not in ev.group:
            raise Mismatch(f"rank {rank} posted {ev.name} over {ev.group}, which it is not a member of")
        op = _Op(rank=rank, rec=None, coll=ev, unit=None, posted=self._stamp(rank))
        self._enqueue(rank, (ev.channel.name,), [op])
        self.ordered.append(op)
        self.handles[(rank, ev.handle)] = [op]
        per_rank = self.colls.setdefault((ev.channel.name, ev.group), {})
        per_rank.setdefault(rank, deque()).append(op)
        if all(per_rank.get(m) for m in ev.group):
            instance = [per_rank[m].popleft() for m in ev.group]
            kinds = {(o.coll.name, o.coll.nbytes) for o in instance}  # type: ignore[union-attr]
            if len(kinds) > 1:
                raise Mismatch(f"the members of {ev.group} on {ev.channel.name} run different collectives "
                               f"at the same position: {sorted(kinds)}")
            for o in instance:
                o.peers = instance

    def _advance(self, rank: int) -> bool:
        moved, evs = False, self.events[rank]
        while self.pc[rank] < len(evs):
            ev = evs[self.pc[rank]]
            if isinstance(ev, Post):
                self._post(rank, ev)
            elif isinstance(ev, Collective):
                self._collective(rank, ev)
            elif isinstance(ev, Wait):
                ops = self.handles[(rank, ev.handle)]
                sends_only = all(op.rec is not None and op.rec.op == "send" for op in ops)
                if not all(op.done for op in ops) and not (self._progress() and all(op.done for op in ops)):
                    # (completions are instantaneous: what another rank's posts allow counts first)
                    if sends_only:
                        self.blocked_sends.add((rank, self.pc[rank]))
                    break
                self.clock[rank] = _join(self._stamp(rank), *(op.clock for op in ops))
                if not sends_only:
                    self.observed[rank].append(self.clock[rank])
            elif isinstance(ev, Note):
                pass
            else:
                raise TypeError(f"unknown event {ev!r}")
            self.pc[rank] += 1
            moved = True
        return moved

    # ---- progress --------------------------------------------------------------------------------
    def _running(self, op: _Op) -> bool:
        if op.done or op.unit is None:
            return True
        queue = self.streams[op.unit.stream]
        return bool(queue) and queue[0] is op.unit

    def _can_complete(self, op: _Op) -> bool:
        if op.coll is not None:
            return bool(op.peers) and all(self._running(o) for o in op.peers)
        rec = op.rec
        assert rec is not None
        if not self._running(op):
            return False
        if rec.op == "send" and rec.nbytes <= self.eager:
            return True
        if op.match is None:
            return False
        return True if op.unit is None else self._running(op.match)

    def _start(self, op: _Op) -> tuple[int, ...]:
        """The clock at which ``op``'s unit started running: its post, after what completed ahead of it."""
        if op.unit is None:
            return op.posted
        before = self.done_clock.get(op.unit.stream)
        return op.posted if before is None else _join(op.posted, before)

    def _completion(self, op: _Op) -> tuple[int, ...]:
        if op.coll is not None:
            return _join(*(self._start(o) for o in op.peers))
        if op.match is None or (op.rec.op == "send" and op.rec.nbytes <= self.eager):  # type: ignore[union-attr]
            return self._start(op)
        return _join(self._start(op), self._start(op.match))

    def _progress(self) -> bool:
        moved, again = False, True
        while again:  # to a fixpoint: completions are instantaneous
            again = False
            for queue in self.streams.values():
                while queue:
                    unit = queue[0]
                    ready = [op for op in unit.ops if not op.done and self._can_complete(op)]
                    for op in ready:
                        op.clock = self._completion(op)
                    for op in ready:
                        op.done = True
                        again = True
                    if not all(op.done for op in unit.ops):
                        break
                    self.done_clock[unit.stream] = _join(*(op.clock for op in unit.ops))
                    queue.popleft()
            for op in self.unordered:
                if not op.done and self._can_complete(op):
                    op.clock = self._completion(op)
                    op.done = again = True
            moved = moved or again
        return moved

    def run(self) -> None:
        moved = True
        while moved:
            moved = any([self._advance(r) for r in self.events])
            moved = self._progress() or moved
        stuck = [r for r in self.events if self.pc[r] < len(self.events[r])]
        pending = [op for op in self.ordered + self.unordered if not op.done]
        if stuck or pending:
            raise Deadlock(self._report(stuck, pending))

    def _report(self, stuck: list[int], pending: list[_Op]) -> str:
        lines = [f"{len(stuck)} rank(s) cannot finish, {len(pending)} operation(s) never complete "
                 f"(eager limit {self.eager} B):"]
        for r in self.events:
            heads = [f"{'/'.join(map(str, q[0].stream[1:]))}: {', '.join(o.describe() for o in q[0].ops)}"
                     for q in self.streams.values() if q and q[0].stream[0] == r]
            where = (f"blocked at event {self.pc[r]} of {len(self.events[r])}" if r in stuck else "finished")
            lines.append(f"  rank {r}: {where}; stream heads: {'; '.join(heads) or 'none'}")
        return "\n".join(lines)


def replay(events: dict[int, list[Event]], *, eager_bytes: int = 0) -> set[tuple[int, int]]:
    """Run every rank's recorded events under the rules above; raise :class:`Deadlock` (saying where
    each rank stands) unless every rank finishes and every operation completes, :class:`Mismatch`
    when NCCL would pair operations that do not belong together. Returns where a rank waited on
    sends that had not completed yet: (rank, index of the wait in its events)."""
    r = _Replay(events, eager_bytes=eager_bytes)
    r.run()
    return r.blocked_sends


def known_complete(events: dict[int, list[Event]], *, eager_bytes: int = 0) -> dict[int, dict[int, int]]:
    """Replay as :func:`replay` does; for each rank, each handle it posted sends under (alone) ->
    how many observations (waits on anything but sends alone, in its events' order) the rank has
    made when it knows them complete (module doc; 0: from their post on). Handles it never knows
    before waiting on them are left out."""
    r = _Replay(events, eager_bytes=eager_bytes)
    r.run()
    out: dict[int, dict[int, int]] = {}
    for (rank, handle), ops in r.handles.items():
        if not all(op.rec is not None and op.rec.op == "send" for op in ops):
            continue
        own = r.slot[rank]
        need = _join(*(op.clock for op in ops))
        need = (*need[:own], -1, *need[own + 1:])
        clocks = [(-1,) * len(need), *r.observed[rank]]
        seen = next((k for k, c in enumerate(clocks) if all(a >= b for a, b in zip(c, need, strict=True))), None)
        if seen is not None:
            out.setdefault(rank, {})[handle] = seen
    return out
