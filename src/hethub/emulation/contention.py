"""Ranks sharing a host's CPU cores: the whole step simulated with processor sharing.

Only for local emulation, where every device is a process on one host (``host_cores``). When
more ranks compute at once than there are cores, each computing rank runs at ``cores / computing``
of its full speed (the OS shares cores fairly between single-threaded processes). What does not
use a core does not slow anyone:

* an emulated kind's extra time is a sleep: after each forward or backward chunk of CPU work c, the
  rank sleeps (k - 1) x c (hethub.runtime.slowdown), during which the others have the cores;
* waiting for a transfer, and the gradient all-reduces (loopback, tiny next to compute here), are
  timed waits.

Work that starts after its rank sat idle (waiting or sleeping) runs slower than back-to-back work
(cold caches, core power states): where the profile measured it (``HostEffects.wake_penalty``) each
chunk of CPU work gets the extra CPU time of the idle gap before it.

So every stage's program is replayed as phases: CPU work (shared), sleep and waits (not shared),
in the schedule's op order (1F1B, GPipe, ZB-H1, interleaved: a chunk's op runs its share of the
stage's work, and chunk c of the first stage follows chunk c - 1 of the last), with the same dependencies as
:mod:`hethub.schedules.simulate` (a forward needs the previous stage's forward plus the transfer, a
backward the next stage's backward plus the transfer), then the world barrier of the loss
all-reduce, its gradient-sync groups in layer order (each starts once all its holders arrive), the
world barrier of the gradient-norm all-reduce and its optimizer update (CPU work). A TP stage counts as
``tp`` computing processes. With no more computing ranks than cores this reduces to the
uncontended simulation. On request it records what each stage did when (``record``): the
predicted timeline of such a host, which the plain schedule (no sharing, no barriers) would not
match.

Cores do not run at one steady speed: on a shared host each core's speed wanders (other tenants,
power states) independently of the others'. Where the profile measured that spread, the predictor
replays the step several times with drawn speeds (:mod:`hethub.emulation.stragglers`): replicas and TP
ranks that meet at a collective wait for the slowest, so the typical step is slower than one at
mean speed, while a pipeline's hand-offs mostly average the stages' speeds out.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from hethub.emulation.stragglers import SpeedDraws
from hethub.predict.host import ReplayEvent, StageId
from hethub.predict.sync_records import SyncGroup
from hethub.schedules import get_schedule
from hethub.schedules.simulate import link_arrival_s
from hethub.schedules.zero_bubble import DEFAULT_WEIGHT_GRAD_SHARE
from hethub.spec.cluster import Link

_EPS = 1e-12


@dataclass(frozen=True)
class StageWork:
    """One stage's per-micro-batch costs split into what needs a core and what does not."""

    fwd_cpu_s: float
    fwd_idle_s: float  # emulation sleep (+ nothing else)
    bwd_cpu_s: float
    bwd_idle_s: float
    p2p_s: float  # transfer to the next stage (and of gradients back from it)
    update_cpu_s: float
    ranks: int  # processes computing together (the TP degree)
    # Extra CPU seconds of a chunk after an idle gap (HostEffects.wake_extra_s); None: no such effect.
    wake_extra_s: Callable[[float], float] | None = None
    slowdown: float = 1.0  # emulated kinds sleep (k-1) x a chunk's CPU time, wake penalty included
    # Virtual stages (interleaved): each model chunk's share of the forward / backward above, and on
    # the last stage the hop back to the first stage (chunk c to c + 1, and its gradient).
    chunk_fwd_shares: tuple[float, ...] = (1.0,)
    chunk_bwd_shares: tuple[float, ...] = (1.0,)
    wrap_p2p_s: float = 0.0
    # Under a split-backward schedule (ZB-H1): B's and W's work, each as a fraction of the backward
    # above (HostEffects.split_backward where measured; they may sum to more than 1).
    split_b_share: float = 1.0 - DEFAULT_WEIGHT_GRAD_SHARE
    split_w_share: float = DEFAULT_WEIGHT_GRAD_SHARE
    # Thread CPU time of this stage's work while every core computes, over the same work alone
    # (HostEffects.corun at its micro-batch size; 1: none).
    corun: float = 1.0


_CATEGORY = {"F": "forward", "B": "backward", "W": "backward", "U": "optimizer"}


@dataclass
class _Stage:
    sid: StageId
    work: StageWork
    tasks: list[tuple[str, int, int]]  # (kind, micro-batch or group, model chunk)
    weight: int
    ptr: int = 0
    # ("until", absolute time) | ("cpu", work left at full speed) | ("sleep", seconds, once CPU work is done)
    phases: list[tuple[str, float]] = field(default_factory=list)
    done_s: float | None = None
    cpu_end_s: float = 0.0  # when its last chunk of CPU work ended (the step starts warm)
    op_start_s: float = 0.0  # when the current task's work began (its inputs had arrived)
    b_share: float = 1.0  # the backward's share the B op runs (below 1 under a split-backward schedule)
    w_share: float = 0.0  # the backward's share a split-backward schedule's W op runs
    n_stages: int = 0  # the pipeline's stages where the stage holds several model chunks (else 0)
    # Arrival of the last message on its incoming links (activations, gradients): one link carries one
    # message at a time (schedules.simulate.link_arrival_s).
    fwd_link_s: float = 0.0
    bwd_link_s: float = 0.0
    # CPU time the current chunk spent beyond its work, co-running (an emulated kind sleeps on it too).
    corun_extra_s: float = 0.0


def simulate_shared_cores(
    *, stages: dict[StageId, StageWork], num_micro_batches: Sequence[int], schedule: str, cores: int,
    groups: Sequence[SyncGroup], world: Sequence[SyncGroup] = (), background_procs: float = 0.0,
    speeds: SpeedDraws | None = None, record: list[ReplayEvent] | None = None,
) -> tuple[float, list[float]]:
    """(step time, each pipeline's last-backward time) with `cores` shared by every rank of the plan
    and by `background_procs` always-busy processes of other users (0 on a machine of one's own).

    ``world``: the world all-reduces of the loss (after the schedule) and of the gradient norm
    (before the update), barriers of every stage (see sync.world_collectives); none given: barriers
    that take no time.

    ``speeds``: one draw of the cores' varying speeds (stragglers.py); None: every core at its mean.
    ``record``: if given, every stage's forwards, backwards, all-reduces and update are appended."""
    everyone = tuple(stages)
    free = Link(float("inf"), 0.0)
    loss, norm = world or [SyncGroup(name, everyone, 8.0, free, 0.0) for name in ("loss", "grad norm")]
    n_stages = {pi: 1 + max(si for p, si in stages if p == pi) for pi, _ in stages}
    st: dict[StageId, _Stage] = {}
    my_groups: dict[StageId, list[int]] = {sid: [] for sid in stages}
    for gi, g in enumerate(groups):  # the gradient syncs only: the world barriers come once each, below
        if g.time_s > 0:
            for h in g.holders:
                my_groups[h].append(gi)
    loss_g, norm_g = len(groups), len(groups) + 1
    groups = [*groups, loss, norm]
    for sid, w in stages.items():
        pi, si = sid
        sched = get_schedule(schedule, chunks=len(w.chunk_fwd_shares))
        ops = sched.ops(stage=si, num_stages=n_stages[pi], num_micro_batches=num_micro_batches[pi])
        tasks = ([(o.kind, o.micro_batch, o.chunk) for o in ops] + [("S", loss_g, 0)]
                 + [("S", gi, 0) for gi in my_groups[sid]] + [("S", norm_g, 0)] + [("U", 0, 0)])
        split = sched.split_backward
        st[sid] = _Stage(sid, w, tasks, max(1, w.ranks), b_share=w.split_b_share if split else 1.0,
                         w_share=w.split_w_share if split else 0.0,
                         n_stages=n_stages[pi] if len(w.chunk_fwd_shares) > 1 else 0)
    f_end: dict[tuple[int, int, int], float] = {}
    b_end: dict[tuple[int, int, int], float] = {}
    arrived: dict[int, set[StageId]] = {}
    bwd_done: dict[int, float] = {}
    now = 0.0
    while True:
        moved = True
        while moved:  # instantaneous transitions at `now`
            moved = False
            for s in st.values():
                moved |= _step(s, st, now=now, f_end=f_end, b_end=b_end, arrived=arrived, groups=groups,
                               bwd_done=bwd_done, record=record)
        if all(s.done_s is not None for s in st.values()):
            break
        busy = [s for s in st.values() if s.phases and s.phases[0][0] == "cpu"]
        n = sum(s.weight for s in busy)
        share = min(1.0, cores / (n + background_procs)) if n else 1.0
        rates = {s.sid: share for s in busy}
        nxt = []
        if speeds is not None and busy:
            k = speeds.window(now)
            if share < 1.0:  # the OS spreads every busy rank over every core: all get the cores' mean speed
                mean = sum(speeds.speed(("core", c), k) for c in range(cores)) / cores
                rates = dict.fromkeys(rates, share * mean)
            else:  # a rank per core; a TP stage waits for its slowest rank at every collective
                rates = {s.sid: min(speeds.speed((s.sid, r), k) for r in range(s.weight)) for s in busy}
            nxt.append(speeds.window_end(k))
        # Co-running: with other processes computing beside it a rank's work takes more CPU time, up to
        # its measured factor when every core is busy (in between, in proportion to the other busy
        # cores). A TP stage's own ranks co-ran in its profile already, so they do not count.
        slow = {s.sid: _corun(s.work.corun, busy_procs=n + background_procs, own=s.weight, cores=cores)
                for s in busy}
        held = dict(rates)  # before co-running: its extra CPU time is what the division below takes
        rates = {sid: r / slow[sid] for sid, r in rates.items()}
        nxt += [now + s.phases[0][1] / rates[s.sid] for s in busy]
        nxt += [s.phases[0][1] for s in st.values() if s.phases and s.phases[0][0] == "until"]
        if not nxt:
            raise RuntimeError("shared-core simulation deadlocked; this is a bug in the op order")
        t = min(nxt)
        for s in busy:
            s.phases[0] = ("cpu", max(0.0, s.phases[0][1] - (t - now) * rates[s.sid]))
            s.corun_extra_s += (t - now) * (held[s.sid] - rates[s.sid])
        now = t
    step = max(s.done_s or 0.0 for s in st.values())
    pipes = [bwd_done.get(pi, 0.0) for pi in sorted(n_stages)]
    return step, pipes


def _step(s: _Stage, st: dict[StageId, _Stage], *, now: float, f_end: dict, b_end: dict,
          arrived: dict[int, set[StageId]], groups: Sequence[SyncGroup], bwd_done: dict[int, float],
          record: list[ReplayEvent] | None) -> bool:
    """Advance stage `s` through whatever completes or starts at `now`; True if anything did."""
    if s.done_s is not None:
        return False
    if s.phases:
        kind, v = s.phases[0]
        if not ((kind == "cpu" and v <= _EPS) or (kind == "until" and v <= now + _EPS)):
            return False
        s.phases.pop(0)
        if kind == "cpu":
            s.cpu_end_s = now
        elif kind == "until" and s.phases:  # its inputs are here: the op's work starts
            s.op_start_s = now
        if s.phases and s.phases[0][0] == "sleep":  # a sleep starts when the CPU work before it ends
            # The runtime sleeps (k-1) x the chunk's thread CPU time, co-running's extra included.
            s.phases[0] = ("until", now + s.phases[0][1] + (s.work.slowdown - 1.0) * s.corun_extra_s)
        elif s.phases and s.phases[0][0] == "cpu":
            _wake(s, now=now)
        if kind == "cpu":
            s.corun_extra_s = 0.0
        if not s.phases:
            _finish_task(s, now=now, f_end=f_end, b_end=b_end, bwd_done=bwd_done, record=record)
        return True
    if s.ptr >= len(s.tasks):
        s.done_s = now
        return True
    kind, i, c = s.tasks[s.ptr]
    pi, si = s.sid
    w = s.work
    # Dependencies are keyed by virtual stage vs = c n + si (si without chunks): chunk c of the
    # first stage follows chunk c - 1 of the last over the last stage's wrap hop, on the same link.
    vs, n, v = s.n_stages * c + si, s.n_stages, len(w.chunk_fwd_shares)
    if kind == "F":
        ready = now
        if vs > 0:
            dep = f_end.get((pi, vs - 1, i))
            if dep is None:
                return False
            sender = st[(pi, si - 1 if si > 0 else n - 1)].work
            ready = s.fwd_link_s = link_arrival_s(sent_s=dep, link_free_s=s.fwd_link_s,
                                                  transfer_s=sender.p2p_s if si > 0 else sender.wrap_p2p_s)
        f = w.chunk_fwd_shares[c]
        s.phases = [("until", ready), ("cpu", w.fwd_cpu_s * f), ("sleep", w.fwd_idle_s * f)]
    elif kind == "B":
        ready = now
        last = (pi, si + 1) not in st
        if not last or c < v - 1:
            dep = b_end.get((pi, vs + 1, i))
            if dep is None:
                return False
            ready = s.bwd_link_s = link_arrival_s(sent_s=dep, link_free_s=s.bwd_link_s,
                                                  transfer_s=w.wrap_p2p_s if last else w.p2p_s)
        b = s.b_share * w.chunk_bwd_shares[c]
        s.phases = [("until", ready), ("cpu", w.bwd_cpu_s * b), ("sleep", w.bwd_idle_s * b)]
    elif kind == "W":  # needs only its own B, which the stage ran before
        s.phases = [("until", now), ("cpu", w.bwd_cpu_s * s.w_share), ("sleep", w.bwd_idle_s * s.w_share)]
    elif kind == "S":
        holders = arrived.setdefault(i, set())
        holders.add(s.sid)
        if len(holders) < len(groups[i].holders):
            return False
        # The last holder arrived: the all-reduce runs for all of them from now.
        for h in groups[i].holders:
            st[h].phases = [("until", now + groups[i].time_s)]
            if record is not None and groups[i].time_s > 0:
                record.append(ReplayEvent(h, "allreduce", groups[i].name, now, now + groups[i].time_s))
        arrived[i] = set()
    else:
        s.phases = [("cpu", w.update_cpu_s)]
        s.op_start_s = now
        _wake(s, now=now)
    return True


def _corun(factor: float, *, busy_procs: float, own: int, cores: int) -> float:
    """The co-run slowdown of a stage's work with `busy_procs` processes computing (its `own` included)
    on `cores` cores: `factor` when the others fill every other core, none alone, linear in between."""
    others = min(busy_procs, cores) - min(own, cores)
    if factor == 1.0 or cores < 2 or others <= 0:
        return 1.0
    return 1.0 + (factor - 1.0) * min(1.0, others / (cores - 1))


def _wake(s: _Stage, *, now: float) -> None:
    """A chunk of CPU work starts at `now`: add the wake penalty of the idle time before it (and the
    emulation's sleep on that extra CPU time)."""
    w = s.work
    gap = now - s.cpu_end_s
    if w.wake_extra_s is None or gap <= _EPS:
        return
    extra = w.wake_extra_s(gap)
    s.phases[0] = ("cpu", s.phases[0][1] + extra)
    if len(s.phases) > 1 and s.phases[1][0] == "sleep":
        s.phases[1] = ("sleep", s.phases[1][1] + (w.slowdown - 1.0) * extra)


def _finish_task(s: _Stage, *, now: float, f_end: dict, b_end: dict, bwd_done: dict[int, float],
                 record: list[ReplayEvent] | None) -> None:
    kind, i, c = s.tasks[s.ptr]
    pi, si = s.sid
    si = s.n_stages * c + si  # the virtual stage dependencies are keyed by
    if record is not None and kind in _CATEGORY:
        name = "optimizer" if kind == "U" else f"{kind}{i}"
        record.append(ReplayEvent(s.sid, _CATEGORY[kind], name, s.op_start_s, now, None if kind == "U" else i))
    if kind == "F":
        f_end[(pi, si, i)] = now
    elif kind == "B":
        b_end[(pi, si, i)] = now
    if kind in ("B", "W"):
        bwd_done[pi] = max(bwd_done.get(pi, 0.0), now)
    s.ptr += 1
