"""Each device's timeline of a prediction (``predict(plan, timeline=...)``): its compute, transfers,
all-reduces and optimizer update as intervals, from the simulated schedules and the sync, or from a
local emulation host's replay."""

from __future__ import annotations

from hethub.plan import Pipeline, Plan
from hethub.predict.host import ReplayEvent
from hethub.predict.result import Event, StagePrediction
from hethub.predict.sync_records import SyncResult
from hethub.schedules.simulate import StageSchedule


def timeline_events(plan: Plan, schedules: list[list[StageSchedule]], stages: tuple[StagePrediction, ...],
              sync: SyncResult, *, only: frozenset[int] | None = None) -> tuple[Event, ...]:
    """Compute, transfer, all-reduce and optimizer intervals on every device, sorted by start time."""
    events: list[Event] = []
    by_id = {(sp.pipeline, sp.stage): sp for sp in stages}
    for pi, (p, sched) in enumerate(zip(plan.pipelines, schedules, strict=True)):
        for si, st in enumerate(sched):
            sp = by_id[(pi, si)]
            back = by_id[(pi, si - 1)].p2p_s if si > 0 else 0.0
            for d in sp.devices if only is None else [d for d in sp.devices if d in only]:
                events.extend(_stage_events(p, pi, si, d, st, send_fwd=sp.p2p_s, send_bwd=back))
                for name, a, b in sync.intervals[(pi, si)]:  # world all-reduces included
                    events.append(Event(d, "allreduce", f"allreduce {name}", a, b, pi, si))
                end = sync.stage_end_s[(pi, si)]
                if sp.update_s > 0:
                    events.append(Event(d, "optimizer", "optimizer", end - sp.update_s, end, pi, si))
    events.sort(key=lambda e: (e.start_s, e.device))
    return tuple(events)


def replay_timeline_events(plan: Plan, recorded: tuple[ReplayEvent, ...], stages: tuple[StagePrediction, ...], *,
                     only: frozenset[int] | None = None) -> tuple[Event, ...]:
    """A host's replayed intervals on every device of their stage, with the transfers after
    each forward (to the next stage) and backward (to the previous one)."""
    by_id = {(sp.pipeline, sp.stage): sp for sp in stages}
    events: list[Event] = []
    for r in recorded:
        (pi, si), sp = r.stage, by_id[r.stage]
        if r.end_s <= r.start_s and r.category == "optimizer":
            continue
        for d in sp.devices if only is None else [d for d in sp.devices if d in only]:
            if r.name.startswith("W"):
                events.append(Event(d, r.category, r.name, r.start_s, r.end_s, pi, si, r.micro_batch))
            elif r.category in ("forward", "backward"):
                events.extend(_chunk_events(plan.pipelines[pi], forward=r.category == "forward", mb=r.micro_batch,
                                            start_s=r.start_s, end_s=r.end_s, pi=pi, si=si, device=d,
                                            send_fwd=sp.p2p_s, send_bwd=by_id[(pi, si - 1)].p2p_s if si > 0 else 0.0))
            else:
                name = f"allreduce {r.name}" if r.category == "allreduce" else r.name
                events.append(Event(d, r.category, name, r.start_s, r.end_s, pi, si, r.micro_batch))
    events.sort(key=lambda e: (e.start_s, e.device))
    return tuple(events)


def _stage_events(p: Pipeline, pi: int, si: int, device: int, st: StageSchedule, *, send_fwd: float,
                  send_bwd: float) -> list[Event]:
    out: list[Event] = []
    for op in st.ops:
        if op.kind == "W":  # a split backward's weight gradients: nothing to send
            out.append(Event(device, "backward", f"W{op.micro_batch}", op.start_s, op.end_s, pi, si, op.micro_batch))
        else:
            out += _chunk_events(p, forward=op.kind == "F", mb=op.micro_batch, start_s=op.start_s, end_s=op.end_s,
                                 pi=pi, si=si, device=device, send_fwd=send_fwd, send_bwd=send_bwd,
                                 send_done_s=op.send_done_s)
    return out


def _chunk_events(p: Pipeline, *, forward: bool, mb: int, start_s: float, end_s: float, pi: int, si: int,
                  device: int, send_fwd: float, send_bwd: float, send_done_s: float | None = None) -> list[Event]:
    """A forward or backward of micro-batch `mb` on stage `si` of pipeline `p` and the transfer after
    it (activations to the next stage, gradients to the previous one), where there is one. A blocking
    send (``send_done_s``) spans until delivery, its wait for the link included: the stage is held
    (under lockstep a gradient send's span also holds the receive the runtime runs before it)."""
    i = mb
    if forward:
        out = [Event(device, "forward", f"F{i}", start_s, end_s, pi, si, i)]
        if si < len(p.stages) - 1 or send_done_s is not None:  # blocking: an interleaved wrap's send too
            done = end_s + send_fwd if send_done_s is None else send_done_s
            out.append(Event(device, "p2p", f"send act {i}", end_s, done, pi, si, i))
        return out
    out = [Event(device, "backward", f"B{i}", start_s, end_s, pi, si, i)]
    if si > 0 or send_done_s is not None:
        done = end_s + send_bwd if send_done_s is None else send_done_s
        out.append(Event(device, "p2p", f"send grad {i}", end_s, done, pi, si, i))
    return out
