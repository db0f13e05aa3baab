"""Assemble the building blocks into one prediction of a plan's training step.

Per stage: compute time (measured profile for its kind when one matches, else the roofline of
:mod:`hethub.predict.compute`) plus Megatron TP all-reduces over the kind's intra-node link; the
send of one micro-batch's activations to the next stage over the link between the stage's last
device and the next stage's first; memory from :mod:`hethub.predict.memory` with the schedule's
in-flight micro-batches. Each pipeline's schedule is simulated event by event
(:mod:`hethub.schedules.simulate`), its sends asynchronous, blocking or in DeepSpeed's lock-step
(:mod:`hethub.schedules.lockstep`) as the plan's ``p2p`` says, then the world all-reduce of the loss,
the data-parallel gradient sync (:mod:`hethub.predict.sync`), the world all-reduce of the gradient
norm and the optimizer update give each stage's end; the step ends with the last one. Time a stage
spends held by blocking sends, or in lock-step transfers, counts as exposed communication.

One hook, ``host``: a host that runs every rank itself (local emulation, :mod:`hethub.emulation`)
prices the all-reduces and replays the step with the stage costs computed here
(:mod:`hethub.predict.host`). Without it (any real cluster) nothing of such a host is modelled.

Large plans are mostly identical replicas, so stage costs are cached by what determines them and
each distinct pipeline (same micro-batch count and per-stage times) is simulated once
(:mod:`hethub.predict.plan_costs`).

`predict` expects a valid plan (see :meth:`hethub.plan.Plan.validate`); it does not re-validate,
because the planner calls it in a loop.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import replace

from hethub.memo import reference
from hethub.plan import Plan, Recompute, ShardWeights
from hethub.predict import fabrics
from hethub.predict.compute import calibration_of
from hethub.predict.host import HostModel, StageStep
from hethub.predict.memory import (
    DEFAULT_MEM_HEADROOM,
    StageMemory,
    check_headroom,
    describe_peak,
    usable_bytes,
)
from hethub.predict.plan_costs import PlanCosts, StageStepCost
from hethub.predict.profiles import ProfileSet
from hethub.predict.result import Event, Prediction, StagePrediction
from hethub.predict.shard_memory import shard_weights, with_sharding
from hethub.predict.sharding import rank_weights
from hethub.predict.stage_fits import StageFits, memory_twins, stage_mem
from hethub.predict.sync import simulate_sync, sync_groups, world_collectives
from hethub.predict.sync_overlap import exposed_sync_groups, unoverlapped_sync_s
from hethub.predict.sync_records import SyncResult
from hethub.predict.timeline import replay_timeline_events, timeline_events
from hethub.predict.utilisation import mfu_by_kind
from hethub.runtimes import runtime_profile
from hethub.schedules import DEFAULT_P2P, LOCKSTEP, get_schedule
from hethub.schedules.simulate import finish_floor_s


def predict(plan: Plan, *, profiles: ProfileSet | None = None, timeline: bool | Collection[int] = False,
            host: HostModel | None = None, mem_headroom: float = DEFAULT_MEM_HEADROOM) -> Prediction:
    """Step time, throughput, per-device memory and (optionally) the per-device timeline of `plan`.

    ``timeline``: True for every device's events; a collection of device ids for those devices only
    (a report of a 768-device plan draws one device per distinct stage, and building ~10^6 events
    for the others would cost most of its time).

    ``host``: the local emulation host every rank runs on, if any (``hethub.emulation.host_model``);
    it prices the all-reduces and replays the step, and its timeline is the replay's.
    ``mem_headroom``: share of each device's memory a plan must leave free (predict/memory/capacity.py).
    """
    only = None if isinstance(timeline, bool) else frozenset(timeline)
    timeline = timeline is not False
    mem_headroom = check_headroom(mem_headroom)
    model = plan.model
    costs = PlanCosts(plan, profiles)
    partial: list[tuple[int, int, StageStepCost, StageMemory, float, int]] = []
    finish: list[list[float]] = []
    updates: list[list[float]] = []
    sigs: list[tuple] = []
    # Per virtual stage where v > 1: forward, backward, hop times, and the pipeline's stages.
    chunked: dict[int, tuple[list[float], list[float], list[float], int]] = {}
    posts: dict[int, list[float]] = {}  # per pipeline and virtual stage: one op's p2p posts (PlanCosts.op_times)
    # Blocking and lock-step sends: the records give each stage's time held by its transfers (exposed
    # communication, StageSchedule.exposed_p2p_s).
    held = plan.p2p != DEFAULT_P2P and host is None
    twins, mem_of = memory_twins(costs), {}  # replicas' stages share one memory
    for pi, p in enumerate(plan.pipelines):
        mbs, m, n = p.micro_batch_size, p.num_micro_batches, len(p.stages)
        schedule, v = get_schedule(plan.schedule, chunks=p.virtual_stages), p.virtual_stages
        upd = []
        fwd, bwd, p2p, posts[pi] = costs.op_times(p)  # hops to the next stage: p2p's first n - 1
        for si, s in enumerate(p.stages):
            cost = costs.of_stage(s, mbs=mbs)
            if (twins[pi], si) not in mem_of:
                mem_of[(pi, si)] = stage_mem(costs, schedule, pi, si)
            in_flight, mem = mem_of[(twins[pi], si)]
            send = p2p[si] if si < n - 1 else 0.0
            upd.append(cost.times.update_s)
            partial.append((pi, si, cost, mem, send, in_flight))
        if v > 1:
            chunked[pi] = (fwd, bwd, p2p, n)
        sig = (m, v, tuple(fwd), tuple(bwd), tuple(p2p))
        sigs.append(sig)
        finish.append(costs.simulate(sig, fwd=fwd, bwd=bwd, p2p=p2p, m=m, ops=(timeline or held) and host is None,
                                     chunks=v))
        updates.append(upd)

    mems, weights = with_sharding(plan, {(pi, si): mem for pi, si, _, mem, _, _ in partial}, headroom=mem_headroom)
    if weights is not None:
        for pi, si, _, mem, _, _ in partial:
            if mem.optimizer_bytes > 0:  # AdamW streams only the owned slice's state
                updates[pi][si] *= mems[(pi, si)].optimizer_bytes / mem.optimizer_bytes
        partial = [(pi, si, cost, mems[(pi, si)], send, f) for pi, si, cost, _, send, f in partial]
    groups = sync_groups(plan, shard_weights=weights)
    full_sync = unoverlapped_sync_s(plan, groups)
    world = list(world_collectives(plan))
    if host is not None:
        groups, world = host.price_collectives(groups), host.price_collectives(world)
    else:  # only what the buckets leave after the last backward (an emulation host replays the rest itself)
        backward = {(pi, si): cost.bwd_s for pi, si, cost, _, _, _ in partial}
        groups = exposed_sync_groups(plan, groups, backward_s=backward)
    sync = simulate_sync(plan, finish_s=finish, update_s=updates, record=timeline and host is None, groups=groups,
                         world=world)
    sends = {(pi, si): send for pi, si, _, _, send, _ in partial}
    stages = tuple(_stage_prediction(plan, pi, si, cost=cost, mem=mem, send=send, sync=sync,
                                     last_backward_s=finish[pi][si], in_flight=f, headroom=mem_headroom,
                                     blocked_s=costs.schedules[sigs[pi]][si].exposed_p2p_s if held else 0.0,
                                     back_send_s=sends.get((pi, si - 1), 0.0) if si > 0 else 0.0,
                                     full_sync_s=full_sync.get((pi, si), 0.0),
                                     posts_s=sum(posts[pi][si::len(plan.pipelines[pi].stages)]))
                   for pi, si, cost, mem, send, f in partial)
    step = sync.step_time_s
    pipeline_times = tuple(max(row) for row in finish)
    events: tuple[Event, ...] = ()
    if host is not None:
        steps = {(pi, si): StageStep(kind=s.kind, tp=s.tp, micro_batch_size=plan.pipelines[pi].micro_batch_size,
                                     fwd_s=cost.fwd_s, bwd_s=cost.bwd_s, compute_fwd_s=cost.times.fwd_s,
                                     compute_bwd_s=cost.times.bwd_s, update_s=cost.times.update_s, p2p_s=send,
                                     compute_source=cost.times.source, **_chunk_shares(chunked, pi, si))
                 for pi, si, cost, _, send, _ in partial for s in (plan.pipelines[pi].stages[si],)}
        replayed = host.replay_step(plan, profiles=profiles, stages=steps, groups=groups, world=world,
                                    record=timeline)
        step, pipeline_times = replayed.step_time_s, replayed.pipeline_times_s
        # The replay's step, not the sync's: the rest of it is bubble.
        stages = tuple(replace(sp, bubble_s=max(0.0, step - sp.compute_s - sp.exposed_comm_s - sp.update_s))
                       for sp in stages)
        if timeline:
            events = replay_timeline_events(plan, replayed.events, stages, only=only)
    elif timeline:
        events = timeline_events(plan, [costs.schedules[sig] for sig in sigs], stages, sync, only=only)
    tokens = plan.tokens_per_step
    return Prediction(
        step_time_s=step,
        tokens_per_s=tokens / step if step > 0 else float("inf"),
        pipeline_times_s=pipeline_times,
        stages=stages,
        timeline=events,
        model_flops_per_step=model.train_flops_per_token(seq_len=plan.seq_len) * tokens,
        mfu_by_kind=mfu_by_kind(plan, step),
        sources=_sources(plan, stages),
        warnings=_memory_warnings(stages, headroom=mem_headroom) + (
            (f"the plan's p2p is {plan.p2p!r}, but this local emulation replays hethub's runtime, which sends "
             "asynchronously: the prediction is for asynchronous sends",)
            if host is not None and plan.p2p != DEFAULT_P2P else ()),
    )


def step_floor_s(plan: Plan, *, profiles: ProfileSet | None = None, costs: PlanCosts | None = None,
                 tight: bool = False) -> float:
    """A floor under ``predict(plan).step_time_s`` (without a host) from the stage costs alone, with
    no event simulation and no sync, so a caller comparing many plans (the planner's local search,
    its scoring of finalists) can skip those that cannot beat a step. In the simulation a stage's
    first op is a forward that waits for every earlier stage's first forward, then it runs its
    micro-batches' forwards and backwards one after the other; where the backward is not split
    (1F1B, GPipe) its last op is a backward, which that micro-batch's backward on every earlier
    stage waits for; and the loss all-reduce waits for every stage's last op. Transfers are left
    out (they only add, and so do sends that hold their stage), and so are pipelines with virtual
    stages (chunks costed one by one). ``tight``: each op with its point-to-point posts, as the
    simulation runs it (``PlanCosts.op_times``), and, but under lock-step (simulated apart), the
    schedule's own floor with the hops and each stage's first backward's round trip
    (``schedules.simulate.finish_floor_s``): the scoring's floor; the polish keeps the looser one, as
    its budget counts predictions and a floor that screens more would change the moves it reaches.
    ``costs``: a PlanCosts to share stage costs through, of a plan with the same model, cluster,
    sequence length, per-kind settings and ``profiles`` (the local search's moves keep them)."""
    costs = PlanCosts(plan, profiles) if costs is None else costs
    drain = not get_schedule(plan.schedule).split_backward
    best = 0.0
    for p in plan.pipelines:
        if p.virtual_stages == 1:
            if tight:
                fwd, bwd, hops, _ = costs.op_times(p)
            else:
                fb = [costs.of_stage(s, mbs=p.micro_batch_size) for s in p.stages]
                fwd, bwd = [c.fwd_s for c in fb], [c.bwd_s for c in fb]
            if tight and plan.p2p != LOCKSTEP:
                best = max(best, finish_floor_s(fwd_s=fwd, bwd_s=bwd, p2p_s=hops, num_micro_batches=p.num_micro_batches,
                                                schedule=plan.schedule))
            else:
                best = max(best, pipeline_floor_s(fwd, bwd, num_micro_batches=p.num_micro_batches, drain=drain))
    return best


def pipeline_floor_s(fwd_s: Sequence[float], bwd_s: Sequence[float], *, num_micro_batches: int, drain: bool) -> float:
    """`step_floor_s` of one pipeline without chunks from its stages' forward and backward times
    (``drain``: the schedule does not split the backward)."""
    best, fill, back = 0.0, 0.0, 0.0
    for f, b in zip(fwd_s, bwd_s, strict=True):
        best = max(best, fill + num_micro_batches * (f + b) + back)
        fill += f
        if drain:
            back += b
    return best * (1 - 1e-12)  # the simulation adds the same times in another order (rounding)


def sync_tail_s(plan: Plan, *, profiles: ProfileSet | None = None, costs: PlanCosts | None = None,
                tight: bool = False) -> float:
    """What ``predict(plan).step_time_s`` (without a host) adds after its pipelines' last finish: the
    loss all-reduce is a barrier of every stage, so the gradient sync, the gradient-norm barrier and
    the updates that follow start from that one instant whatever each stage's own finish, and the
    step is exactly the last finish plus this. So ``step_floor_s + sync_tail_s`` is a floor under the
    step too, and a tighter one where syncs are slow (a 70B model across kinds: ~10 % of the step);
    it costs the plan's sync groups (~2 ms on 512 devices), so callers add it only where the cheaper
    floor alone has not settled the question. With a sharded optimizer the slices (from the stages'
    memory) would be needed: 0.0 there, still a floor; ``tight``: the sync at slices no split has
    smaller (``sync_groups``' floor) and no update (each stage's owned slice is not known), a floor
    below the step's tail (the sync only grows with its groups' times and the updates). ``costs``:
    as for ``step_floor_s``."""
    if plan.sharded_optimizer and not tight:
        return 0.0
    costs = PlanCosts(plan, profiles) if costs is None else costs
    sharded = plan.sharded_optimizer
    updates = [[0.0 if sharded else costs.of_stage(s, mbs=p.micro_batch_size).times.update_s for s in p.stages]
               for p in plan.pipelines]
    zeros = [[0.0] * len(p.stages) for p in plan.pipelines]
    backward = {(pi, si): costs.of_stage(s, mbs=p.micro_batch_size).bwd_s
                for pi, p in enumerate(plan.pipelines) for si, s in enumerate(p.stages)}
    tail = simulate_sync(plan, finish_s=zeros, update_s=updates,
                         groups=exposed_sync_groups(plan, sync_groups(plan, floor=True), backward_s=backward),
                         world=list(world_collectives(plan))).step_time_s
    return tail * (1 - 1e-12)  # the sync adds the same times to the finish in another order (rounding)


def last_finish_s(plan: Plan, *, costs: PlanCosts, enough: Callable[[float], bool] | None = None) -> float:
    """The last finish of ``predict(plan)``'s pipelines (without a host or timeline), simulated as it
    simulates them (`PlanCosts.op_times`; finish-only simulations are kept between predictions, so a
    prediction that follows does not simulate again): with ``sync_tail_s`` the step itself, where the
    optimizer is not sharded, without the prediction's memory, sharding and stage records. ``enough``:
    a monotone test ending the walk once the finish so far passes it (off the reference path)."""
    if (costs.plan.schedule, costs.plan.p2p) != (plan.schedule, plan.p2p):  # its simulations read them
        costs = PlanCosts(plan, costs.profiles)
    held = plan.p2p != DEFAULT_P2P  # blocking and lock-step: the records' simulation, as predict's
    last = 0.0
    for p in plan.pipelines:
        fwd, bwd, p2p, _ = costs.op_times(p)
        sig = (p.num_micro_batches, p.virtual_stages, tuple(fwd), tuple(bwd), tuple(p2p))
        last = max(last, *costs.simulate(sig, fwd=fwd, bwd=bwd, p2p=p2p, m=p.num_micro_batches, ops=held,
                                         chunks=p.virtual_stages))
        if enough is not None and not reference() and enough(last):
            return last
    return last


def floor_steps(plan: Plan, *, costs: PlanCosts, tight: bool = False, bar_s: float | None = None,
                ) -> Iterator[float]:
    """Floors under ``predict(plan).step_time_s`` (without a host), each dearer to find than the one
    before, found as they are asked: ``step_floor_s``; it plus ``sync_tail_s`` (which prices the plan's
    sync groups, ~1/5 of a prediction on 512 devices); and with ``tight`` (as there and for the tail),
    ``last_finish_s`` plus the tail (the pipelines simulated: about half a prediction, which reuses them),
    rounded down so that it stays below the step (the sum and product round monotonically). ``costs``:
    as for ``step_floor_s``; ``bar_s``: the simulation may stop once the last floor reaches it (its
    value is then at least ``bar_s``, not the whole floor)."""
    floor = step_floor_s(plan, costs=costs, tight=tight)
    yield floor
    tail = sync_tail_s(plan, costs=costs, tight=tight)
    yield floor + tail
    if tight:
        def with_tail(last_s: float) -> float:
            return (last_s + tail) * (1 - 1e-12)
        enough = None if bar_s is None else (lambda last_s: with_tail(last_s) >= bar_s)
        yield with_tail(last_finish_s(plan, costs=costs, enough=enough))


def floor_reaches(plan: Plan, bar_s: float, *, costs: PlanCosts, tight: bool = False) -> bool:
    """Whether a floor under ``predict(plan).step_time_s`` (without a host) is already >= ``bar_s``
    (`floor_steps`, the cheaper first), so a caller looking for a step below ``bar_s`` need not
    predict the plan."""
    return any(f >= bar_s for f in floor_steps(plan, costs=costs, tight=tight, bar_s=bar_s))


def may_fit_below(plan: Plan, *, mem_headroom: float, bar_s: float | None = None, costs: PlanCosts | None = None,
                  host: HostModel | None = None) -> bool:
    """False only where ``predict(plan, host=host, mem_headroom=mem_headroom)`` provably has a stage over
    its memory, or a step of at least ``bar_s`` where given (``floor_reaches``, without a host; ``costs``
    as there, required with ``bar_s``): a caller keeping only plans that fit with a step below ``bar_s``
    need not predict the others. The memory is ``StageFits``' (the prediction's own memory without its
    timing, which a stage's memory does not read: equal answers, ``tests/unit/test_predict_fastpath.py``)."""
    if bar_s is not None and host is None and costs is not None and floor_reaches(plan, bar_s, costs=costs):
        return False
    fits = StageFits(plan, mem_headroom=mem_headroom)
    everyone = [(pi, si) for pi, p in enumerate(plan.pipelines) for si in range(len(p.stages))]
    return not (not reference() and fits.over(asked=everyone)) and all(fits.under().values())


def optimizer_shard_weights(plan: Plan, *, mem_headroom: float = DEFAULT_MEM_HEADROOM) -> dict[int, float]:
    """Each rank's weight in the ZeRO-1 split at ``mem_headroom``, computed from the memory model (what
    the prediction uses when the plan carries none)."""
    costs = PlanCosts(plan, None)
    schedule = get_schedule(plan.schedule)
    mems = {(pi, si): stage_mem(costs, schedule, pi, si)[1]
            for pi, p in enumerate(plan.pipelines) for si in range(len(p.stages))}
    return rank_weights(plan, shard_weights(plan, mems, headroom=check_headroom(mem_headroom)))


def with_shard_weights(plan: Plan, *, mem_headroom: float = DEFAULT_MEM_HEADROOM) -> Plan:
    """``plan`` carrying its ZeRO-1 split computed at ``mem_headroom`` (training.optimizer_shard_weights),
    which the runtime then makes as predicted; an unsharded plan as it is."""
    if not plan.sharded_optimizer:
        return plan
    weights = optimizer_shard_weights(plan, mem_headroom=mem_headroom)
    return replace(plan, shard_weights=ShardWeights(mem_headroom=float(mem_headroom),
                                                    by_rank=tuple(weights[r] for r in range(plan.world_size))))


def _chunk_shares(chunked: dict[int, tuple[list[float], list[float], list[float], int]], pi: int,
                  si: int) -> dict[str, object]:
    """StageStep's virtual-stage fields: each chunk's share of the stage's forward and backward, and
    the last stage's hop back to the first; nothing without chunks."""
    if pi not in chunked:
        return {}
    fwd, bwd, hops, n = chunked[pi]
    cf, cb = fwd[si::n], bwd[si::n]
    return {"chunk_fwd_shares": tuple(x / sum(cf) if sum(cf) else 1.0 / len(cf) for x in cf),
            "chunk_bwd_shares": tuple(x / sum(cb) if sum(cb) else 1.0 / len(cb) for x in cb),
            "wrap_p2p_s": hops[n - 1]}


def _sources(plan: Plan, stages: tuple[StagePrediction, ...]) -> dict[str, object]:
    """What the prediction rests on, part by part: measured inputs or analytic models."""
    cluster = plan.cluster
    comm = ("analytic: links from the cluster file at their fabric's achievable bandwidth by message size "
            "(sources.fabrics), ring collectives (NVLink SHARP where NCCL would pick it), the runtime's overlap "
            "(sources.runtime); each op's point-to-point posts at the kind's kernel launch time (an estimate)")
    if cluster.host is not None and cluster.host.allreduce:
        comm += (f"; all-reduce among {sorted(p for p, _ in cluster.host.allreduce)} ranks measured on this host "
                 "(used through the emulation hook)")
    out: dict[str, object] = {}
    selective = [s for s in stages if plan.pipelines[s.pipeline].stages[s.stage].recompute is Recompute.SELECTIVE]
    profiled = sorted({s.kind for s in selective if s.compute_source == "profile"})
    if selective:
        out["recomputation"] = (
            "selective: the re-run attention core's forward, from the operator model's core operators (or the "
            "roofline's score and value FLOPs) where a stage is analytic"
            + (f"; estimated on profiled kinds {', '.join(profiled)} as the core's share of the layer's forward "
               "FLOPs times the measured forward (a profile times whole layers)" if profiled else ""))
    if len({d.kind for d in (cluster.devices[i] for i in plan.devices)}) > 1:
        out["cross_kind"] = {
            "bw_bytes_per_s": cluster.cross_kind.bw_bytes_per_s, "latency_s": cluster.cross_kind.latency_s,
            "source": cluster.cross_kind_source or "assumed: the cluster file cites no source "
                      "(network.cross_kind_source); measure it with 'hethub bench comm' and pass --links"}
    last = {s.kind: (s.precision, s.compute_source) for s in stages}  # per kind, as its last stage says
    return {"compute": {s.kind: s.compute_source for s in stages}, "calibration": {
                kind: calibration_of(cluster.kinds[kind], precision=precision, compute_source=source)
                for kind, (precision, source) in last.items()},
            "communication": comm, "fabrics": _fabric_sources(plan, stages),
            "runtime": runtime_profile(plan.runtime).describe(), **out,
            "memory": "analytic: named parts (predict/memory): state per precision, kept activations per layer, "
                      "working set, sync and optimizer buffers; framework context, collective buffers and "
                      "fragmentation from the catalog",
            "mfu": "model FLOPs (forward + backward, no recomputation) over each kind's dense peak for the "
                   f"plan's precision ({plan.precision})"}


def _fabric_sources(plan: Plan, stages: tuple[StagePrediction, ...]) -> dict[str, object]:
    """Each link class the plan's stages use, its fabric and where that fabric's curve comes from."""
    c = plan.cluster
    classes = {f"intra_node:{s.kind}": c.kinds[s.kind].intra_node_fabric for s in stages}
    if len({c.devices[d].node for s in stages for d in s.devices}) > 1:
        classes["inter_node"] = c.inter_node.fabric
        if len({s.kind for s in stages}) > 1:
            classes["cross_kind"] = c.cross_kind.fabric
    return {name: ({"fabric": f, **fabrics.describe(f)} if f and f != "measured" else
                   {"fabric": f or "none", "source": "the link's own numbers (measured, or given as an achieved rate)"})
            for name, f in sorted(classes.items())}


def _memory_warnings(stages: tuple[StagePrediction, ...], *, headroom: float) -> tuple[str, ...]:
    """One line per distinct (kind, peak) that is over the device's memory or inside its headroom."""
    out: dict[tuple[str, float], str] = {}
    for sp in stages:
        if sp.memory is None or sp.fits:
            continue
        where = f"pipelines[{sp.pipeline}].stages[{sp.stage}]"
        peak, gib = sp.peak_mem_bytes, 1024**3
        if sp.over_device_memory:
            text = (f"{where} on {sp.kind}: predicted peak {peak / gib:.2f} GiB ({describe_peak(sp.memory)}) is over "
                    f"the device's {sp.device_mem_bytes / gib:.2f} GiB: it will run out of memory")
        else:
            text = (f"{where} on {sp.kind}: predicted peak {peak / gib:.2f} GiB ({describe_peak(sp.memory)}) is "
                    f"within the {headroom:.0%} headroom (usable {sp.capacity_bytes / gib:.2f} of "
                    f"{sp.device_mem_bytes / gib:.2f} GiB): little margin for the model's error")
        out.setdefault((sp.kind, round(peak)), text)
    return tuple(out.values())


def _stage_prediction(plan: Plan, pi: int, si: int, *, cost: StageStepCost, mem: StageMemory, send: float,
                      sync: SyncResult, last_backward_s: float, in_flight: int, headroom: float,
                      blocked_s: float = 0.0, back_send_s: float = 0.0, full_sync_s: float = 0.0,
                      posts_s: float = 0.0) -> StagePrediction:
    """``blocked_s``: time the stage is held by its blocking or lock-step transfers
    (StageSchedule.exposed_p2p_s); ``back_send_s``: its gradient send to the previous stage (that
    boundary's hop); ``full_sync_s``: its gradient sync before the runtime's overlap; ``posts_s``: one
    F op's point-to-point posts summed over its chunks (``PlanCosts.posts_s``; a B op's are as many)."""
    s = plan.pipelines[pi].stages[si]
    kind = plan.cluster.kinds[s.kind]
    p = plan.pipelines[pi]
    m = p.num_micro_batches
    compute = m * (cost.times.fwd_s + cost.times.bwd_s)
    tp_comm = m * (cost.fwd_s - cost.times.fwd_s + cost.bwd_s - cost.times.bwd_s)
    sync_tail = max(0.0, sync.stage_end_s[(pi, si)] - cost.times.update_s - last_backward_s)
    posted = 2 * m * posts_s
    sends = m * p.virtual_stages * ((send if si < len(p.stages) - 1 or p.virtual_stages > 1 else 0.0) + back_send_s)
    comm = {"tp": {"exposed_s": tp_comm, "overlapped_s": m * cost.tp_overlapped_s},
            "p2p": {"exposed_s": blocked_s, "overlapped_s": max(0.0, sends - blocked_s), "posts_s": posted},
            "dp": {"exposed_s": sync.sync_s[(pi, si)], "overlapped_s": max(0.0, full_sync_s - sync.sync_s[(pi, si)])}}
    return StagePrediction(
        pipeline=pi, stage=si, kind=s.kind, devices=s.devices, layers=s.layers, tp=s.tp,
        fwd_s=cost.fwd_s, bwd_s=cost.bwd_s, update_s=cost.times.update_s, p2p_s=send,
        sync_s=sync.sync_s[(pi, si)], weights_bytes=mem.weights_bytes, grads_bytes=mem.grads_bytes,
        optimizer_bytes=mem.optimizer_bytes, activations_bytes=mem.activations_bytes,
        capacity_bytes=usable_bytes(kind, headroom=headroom), compute_source=cost.times.source,
        memory=mem, device_mem_bytes=float(kind.mem_bytes), precision=plan.precision_of(s.kind),
        attention=plan.attention_of(s.kind), in_flight=in_flight, comm_s=comm,
        compute_s=compute, exposed_comm_s=tp_comm + sync_tail + blocked_s + posted,
        bubble_s=max(0.0, sync.step_time_s - compute - tp_comm - sync_tail - cost.times.update_s - blocked_s - posted),
    )
