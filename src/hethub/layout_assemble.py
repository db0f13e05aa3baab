"""Turn a priced set of pipelines (the search's candidates) into a Plan: choose devices and write layer
ranges (each stage's mode is then the fastest that fits, `predict/stage_modes.choose_recompute`). Below
the search, which lays out its candidates with it, as it reads only their pipelines' shapes."""

from __future__ import annotations

from hethub.errors import InfeasibleError
from hethub.layout import kind_nodes
from hethub.memo import Kept
from hethub.plan import Pipeline, Plan, Stage
from hethub.predict.candidate_shapes import CandidateShape, PipeShape
from hethub.spec.cluster import Cluster
from hethub.spec.model import ModelSpec


def allocate_devices(cluster: Cluster, pipes: list[PipeShape]) -> list[list[tuple[int, ...]]]:
    """Device ids for every stage of every pipeline.

    Per kind, TP groups are placed largest first with a cursor over the kind's nodes. TP degrees are
    powers of two dividing the node size, so every node the cursor has passed is full and counting
    devices is enough to know a set of pipelines fits (the search relies on this). Within one TP
    degree, a pipeline's stages are consecutive, so neighbours share a node where they can.
    """
    free = {kind: [list(n) for n in nodes] for kind, nodes in kind_nodes(cluster).items()}
    requests = [(pi, si, st.kind, st.tp) for pi, pc in enumerate(pipes) for si, st in enumerate(pc.slots)]
    requests.sort(key=lambda r: -r[3])  # stable: pipeline then stage order within one degree
    out: list[list[tuple[int, ...]]] = [[() for _ in pc.slots] for pc in pipes]
    cursor: dict[str, int] = {}
    for pi, si, kind, tp in requests:
        nodes, c = free.get(kind, []), cursor.get(kind, 0)
        while c < len(nodes) and len(nodes[c]) < tp:
            c += 1
        if c == len(nodes):
            raise InfeasibleError(f"internal: not enough {kind} devices for the chosen pipelines")
        out[pi][si] = tuple(nodes[c][:tp])
        del nodes[c][:tp]
        cursor[kind] = c
    return out


# build_plan's plans by all they are built from: the cluster and model (ids, pinned), the candidate's
# groups and micro-batch counts (hetero.plan_key's), the job's batch, sequence length, schedule,
# precision and strategy, and whether placed and validated. The planner lays out and checks the same
# candidates under each optimizer sharding of a schedule; plans are frozen, so one serves them all.
_PLANS = Kept(256, shortcut=True)


def build_plan(*, cluster: Cluster, model: ModelSpec, est: CandidateShape, global_batch: int, seq_len: int,
               schedule: str, precision: str, strategy: str, validate: bool = True, place: bool = True) -> Plan:
    """The candidate laid out on devices. ``validate=False`` only for a layout the search checks and
    drops (templates.Searcher.fits's memory check): a plan made from it is validated when built.
    ``place=False``: every stage on placeholder devices 0 .. tp - 1, for that check where nothing it
    asks depends on device ids (an unsharded plan's memory: TP degrees and layer ranges)."""
    key = (id(cluster), id(model), tuple((g.pipe, g.count) for g in est.groups), est.micro_batches, global_batch,
           seq_len, schedule, precision, strategy, validate, place)
    return _PLANS.get(key, lambda: _build_plan(cluster=cluster, model=model, est=est, global_batch=global_batch,
                                               seq_len=seq_len, schedule=schedule, precision=precision,
                                               strategy=strategy, validate=validate, place=place),
                      pin=(cluster, model))


def _build_plan(*, cluster: Cluster, model: ModelSpec, est: CandidateShape, global_batch: int, seq_len: int,
                schedule: str, precision: str, strategy: str, validate: bool, place: bool) -> Plan:
    pipes, counts = [], []
    for g, ms in zip(est.groups, est.micro_batches, strict=True):
        for m in ms:
            pipes.append(g.pipe)
            counts.append(m)
    devices = (allocate_devices(cluster, pipes) if place
               else [[tuple(range(sl.tp)) for sl in pc.slots] for pc in pipes])
    pipelines = [to_pipeline(pc, devs, num_micro_batches=m, mbs=pc.mbs)
                 for pc, m, devs in zip(pipes, counts, devices, strict=True)]
    if place:  # replicas by their first device, so the plan reads like the cluster file
        pipelines.sort(key=lambda p: p.stages[0].devices[0])
    plan = Plan(model=model, cluster=cluster, global_batch=global_batch, seq_len=seq_len,
                pipelines=tuple(pipelines), schedule=schedule, precision=precision, strategy=strategy)
    return plan.validate() if validate else plan


def to_pipeline(pc: PipeShape, devices: list[tuple[int, ...]], *, num_micro_batches: int, mbs: int) -> Pipeline:
    """A priced pipeline template on concrete devices: contiguous layers, embedding first, head last."""
    stages, start = [], 0
    for s, (slot, n) in enumerate(zip(pc.slots, pc.layers, strict=True)):
        stages.append(Stage.laid(slot.kind, devices[s], (start, start + n), embedding=s == 0,
                                 head=s == len(pc.slots) - 1, recompute=pc.recompute[s],
                                 sequence_parallel=bool(pc.sp) and pc.sp[s]))
        start += n
    return Pipeline(micro_batch_size=mbs, num_micro_batches=num_micro_batches, stages=tuple(stages))

