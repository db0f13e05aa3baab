"""The plans of the predictor accuracy benchmark, on examples/clusters/local-cpu.toml.

Devices 0 and 1 are cpu-fast, 2 and 3 cpu-slow (emulated 2.5x slower). ``TUNING`` is the set the
predictor's overhead and contention model were developed against. ``SEEN`` holds five former
held-out sets: no constant was ever fitted to any, but the first (held out until 2026-11-30
14:25 UTC) had its per-rank traces read in that day's diagnosis, the second (14:25-14:40)
showed the flaw fixed then (an emulated kind's slowdown stretched TP stages' waits in
collectives), the third (14:40-15:36) ran once in the bench and one of its plans was then
traced, the fourth (15:36-16:05) ran three times in the bench, its rows seen before the
straggler windows were chosen, and the fifth (16:05-17:20) ran in four sessions whose rows were then
read in a diagnosis, so none shows how the model generalises any more. ``HELD_OUT`` was written at
17:20, before any of its plans had run, and is kept out of all diagnosis. All cover 1-4 ranks,
unequal splits, uneven replicas, TP, emulated kinds, 1F1B and GPipe.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from hethub.plan import Pipeline, Plan, Stage
from hethub.spec.cluster import Cluster, Link
from hethub.spec.model import ModelSpec

F, S = "cpu-fast", "cpu-slow"
# (kind, devices, layers) per stage; layers are contiguous from 0.
StageDef = tuple[str, tuple[int, ...], int]


@dataclass(frozen=True)
class PlanDef:
    name: str
    pipelines: tuple[tuple[int, int, tuple[StageDef, ...]], ...]  # (mbs, micro-batches, stages)
    schedule: str = "1f1b"
    # Emulate the link between the fast and the slow node at this bandwidth (bytes/s; cluster
    # ``emulated_links``: the runtime holds each cross-node message back to it). None: loopback.
    emulated_link_bw: float | None = None


TUNING: tuple[PlanDef, ...] = (
    PlanDef("1 fast rank", ((2, 4, ((F, (0,), 8),)),)),
    PlanDef("2 stages fast/fast 4|4", ((2, 4, ((F, (0,), 4), (F, (1,), 4))),)),
    PlanDef("2 stages fast/slow 5|3", ((2, 4, ((F, (0,), 5), (S, (2,), 3))),)),
    PlanDef("2 fast replicas (DP)", ((2, 2, ((F, (0,), 8),)), (2, 2, ((F, (1,), 8),)))),
    PlanDef("4 stages f,f,s,s 3|2|2|1", ((2, 4, ((F, (0,), 3), (F, (1,), 2), (S, (2,), 2), (S, (3,), 1))),)),
    PlanDef("4 stages f,f,s,s GPipe", ((2, 4, ((F, (0,), 3), (F, (1,), 2), (S, (2,), 2), (S, (3,), 1))),),
            schedule="gpipe"),
    PlanDef("uneven replicas fast | slow 4|4", ((2, 3, ((F, (0,), 8),)), (2, 2, ((S, (2,), 4), (S, (3,), 4))))),
    PlanDef("TP2 fast 5 | slow 3", ((2, 4, ((F, (0, 1), 5), (S, (2,), 3))),)),
)

SEEN: tuple[PlanDef, ...] = (
    PlanDef("1 slow rank", ((2, 3, ((S, (2,), 8),)),)),
    PlanDef("3 stages f,f,s 2|3|3 GPipe", ((2, 3, ((F, (0,), 2), (F, (1,), 3), (S, (2,), 3))),), schedule="gpipe"),
    PlanDef("4 replicas f,f,s,s", ((2, 3, ((F, (0,), 8),)), (2, 3, ((F, (1,), 8),)), (2, 1, ((S, (2,), 8),)),
                                   (2, 1, ((S, (3,), 8),)))),
    PlanDef("2x2 stages, splits 4|4 and 6|2", ((2, 4, ((F, (0,), 4), (F, (1,), 4))),
                                               (2, 2, ((S, (2,), 6), (S, (3,), 2))))),
    PlanDef("TP2 fast, whole model", ((2, 4, ((F, (0, 1), 8),)),)),
    PlanDef("2 stages slow/fast 3|5, mbs 1", ((1, 6, ((S, (2,), 3), (F, (0,), 5))),)),
    PlanDef("TP2 fast + slow replica", ((2, 4, ((F, (0, 1), 8),)), (2, 1, ((S, (2,), 8),)))),
    PlanDef("4 stages s,s,f,f mbs 4", ((4, 2, ((S, (2,), 1), (S, (3,), 2), (F, (0,), 2), (F, (1,), 3))),)),
    PlanDef("3 stages f,s,f 3|2|3", ((2, 4, ((F, (0,), 3), (S, (2,), 2), (F, (1,), 3))),)),
    PlanDef("fast 2 stages 5|3 + slow replica", ((2, 3, ((F, (0,), 5), (F, (1,), 3))), (2, 1, ((S, (2,), 8),)))),
    PlanDef("TP2 slow 3 | fast 5", ((2, 4, ((S, (2, 3), 3), (F, (0,), 5))),)),
    PlanDef("4 stages f,s,f,s 2|2|2|2 GPipe mbs 1", ((1, 6, ((F, (0,), 2), (S, (2,), 2), (F, (1,), 2), (S, (3,), 2))),),
            schedule="gpipe"),
    PlanDef("2 fast replicas mbs 4", ((4, 1, ((F, (0,), 8),)), (4, 1, ((F, (1,), 8),)))),
    PlanDef("fast rank x5 | slow rank x2", ((2, 5, ((F, (0,), 8),)), (2, 2, ((S, (2,), 8),)))),
    PlanDef("2 stages fast/slow 6|2 GPipe mbs 1", ((1, 8, ((F, (0,), 6), (S, (2,), 2))),), schedule="gpipe"),
    PlanDef("3 replicas f,f,s mbs 1", ((1, 4, ((F, (0,), 8),)), (1, 4, ((F, (1,), 8),)), (1, 2, ((S, (2,), 8),)))),
    # Held out 14:40-15:36 on 2026-11-30: run once by the bench, then one of its plans used in diagnosis.
    PlanDef("2 stages slow/slow 4|4", ((2, 4, ((S, (2,), 4), (S, (3,), 4))),)),
    PlanDef("TP2 fast 3 | TP2 slow 5", ((2, 4, ((F, (0, 1), 3), (S, (2, 3), 5))),)),
    PlanDef("3 stages s,f,f 2|3|3 GPipe", ((2, 4, ((S, (2,), 2), (F, (0,), 3), (F, (1,), 3))),), schedule="gpipe"),
    PlanDef("2 replicas of fast|slow 5|3", ((2, 3, ((F, (0,), 5), (S, (2,), 3))),
                                            (2, 3, ((F, (1,), 5), (S, (3,), 3))))),
    PlanDef("1 fast rank mbs 4", ((4, 2, ((F, (0,), 8),)),)),
    PlanDef("4 stages f,f,s,s 1|3|3|1 mbs 1", ((1, 8, ((F, (0,), 1), (F, (1,), 3), (S, (2,), 3), (S, (3,), 1))),)),
    PlanDef("TP2 fast x3 | slow 2 stages x1", ((2, 3, ((F, (0, 1), 8),)), (2, 1, ((S, (2,), 4), (S, (3,), 4))))),
    PlanDef("2 stages fast/fast 6|2 GPipe mbs 4", ((4, 2, ((F, (0,), 6), (F, (1,), 2))),), schedule="gpipe"),
    # Held out 15:36-16:05: ran three times in the bench; its rows were seen, not traced.
    PlanDef("2 stages slow/fast 2|6", ((2, 4, ((S, (2,), 2), (F, (0,), 6))),)),
    PlanDef("3 stages f,s,s 4|2|2 mbs 1", ((1, 6, ((F, (1,), 4), (S, (2,), 2), (S, (3,), 2))),)),
    PlanDef("TP2 slow, whole model", ((2, 2, ((S, (2, 3), 8),)),)),
    PlanDef("fast x4 | slow 2 stages 3|5 x2", ((2, 4, ((F, (0,), 8),)), (2, 2, ((S, (2,), 3), (S, (3,), 5))))),
    PlanDef("4 stages s,f,s,f 1|3|1|3 GPipe", ((2, 3, ((S, (2,), 1), (F, (0,), 3), (S, (3,), 1), (F, (1,), 3))),),
            schedule="gpipe"),
    PlanDef("slow 3 | TP2 fast 5 GPipe", ((2, 4, ((S, (2,), 3), (F, (0, 1), 5))),), schedule="gpipe"),
    PlanDef("2 slow replicas mbs 1", ((1, 3, ((S, (2,), 8),)), (1, 3, ((S, (3,), 8),)))),
    PlanDef("1 fast rank GPipe mbs 1", ((1, 6, ((F, (1,), 8),)),), schedule="gpipe"),
    # Held out 16:05-17:20 on 2026-11-30: ran in bench sessions S4-S7; their rows (per-rank compute
    # against the profile, per-plan lean over the four sessions) were then read in a diagnosis.
    PlanDef("2 stages fast/slow 7|1 mbs 4", ((4, 2, ((F, (1,), 7), (S, (3,), 1))),)),
    PlanDef("fast 2 stages 2|6 GPipe x2 | slow x1", ((2, 2, ((F, (0,), 2), (F, (1,), 6))), (2, 1, ((S, (2,), 8),))),
            schedule="gpipe"),
    PlanDef("TP2 fast 6 | slow 1 | slow 1", ((2, 3, ((F, (0, 1), 6), (S, (2,), 1), (S, (3,), 1))),)),
    PlanDef("2 fast replicas mbs 1 x5", ((1, 5, ((F, (0,), 8),)), (1, 5, ((F, (1,), 8),)))),
    PlanDef("3 stages s,f,s 3|4|1", ((2, 3, ((S, (3,), 3), (F, (1,), 4), (S, (2,), 1))),)),
    PlanDef("1 slow rank mbs 4", ((4, 1, ((S, (2,), 8),)),)),
    PlanDef("4 replicas f,s,f,s mbs 1", ((1, 4, ((F, (0,), 8),)), (1, 2, ((S, (2,), 8),)), (1, 4, ((F, (1,), 8),)),
                                           (1, 2, ((S, (3,), 8),)))),
    PlanDef("TP2 slow 2 | fast 6 GPipe mbs 1", ((1, 6, ((S, (2, 3), 2), (F, (0,), 6))),), schedule="gpipe"),
)


HELD_OUT: tuple[PlanDef, ...] = (
    PlanDef("2 stages slow/fast 4|4 mbs 1", ((1, 6, ((S, (3,), 4), (F, (1,), 4))),)),
    PlanDef("fast 2 stages 3|5 x3 | slow x1", ((2, 3, ((F, (0,), 3), (F, (1,), 5))), (2, 1, ((S, (3,), 8),)))),
    PlanDef("fast x4 | slow 2 stages 5|3 x2 GPipe", ((2, 4, ((F, (1,), 8),)), (2, 2, ((S, (2,), 5), (S, (3,), 3)))),
            schedule="gpipe"),
    PlanDef("4 stages f,s,s,f 2|1|1|4", ((2, 4, ((F, (0,), 2), (S, (2,), 1), (S, (3,), 1), (F, (1,), 4))),)),
    PlanDef("TP2 fast 4 | TP2 slow 4 GPipe mbs 1", ((1, 6, ((F, (0, 1), 4), (S, (2, 3), 4))),), schedule="gpipe"),
    PlanDef("fast x2 | slow x1, mbs 4", ((4, 2, ((F, (0,), 8),)), (4, 1, ((S, (3,), 8),)))),
    PlanDef("1 fast rank mbs 1 x8", ((1, 8, ((F, (0,), 8),)),)),
    PlanDef("2 stages fast/fast 2|6 x6", ((2, 6, ((F, (1,), 2), (F, (0,), 6))),)),
)


# One job, many plans: every plan trains the same global batch of 8 sequences, so their step times
# rank the way a planner ranks candidates for that job. Written 2026-12-01 for issue 14's ranking
# target, with step times meant to differ by more than this machine's run-to-run noise (5-10 %):
# 1-4 stages, 1-2 replicas, TP 1-2, the emulated slow kind, an emulated slow link, 1F1B, GPipe and ZB-H1,
# 2-8 micro-batches.
RANKING: tuple[PlanDef, ...] = (
    PlanDef("1 fast rank mbs 2 x4", ((2, 4, ((F, (0,), 8),)),)),
    PlanDef("1 fast rank mbs 1 x8", ((1, 8, ((F, (0,), 8),)),)),
    PlanDef("1 fast rank mbs 4 x2", ((4, 2, ((F, (1,), 8),)),)),
    PlanDef("1 slow rank mbs 2 x4", ((2, 4, ((S, (2,), 8),)),)),
    PlanDef("2 fast replicas mbs 2 x2", ((2, 2, ((F, (0,), 8),)), (2, 2, ((F, (1,), 8),)))),
    PlanDef("2 fast replicas mbs 1 x4", ((1, 4, ((F, (0,), 8),)), (1, 4, ((F, (1,), 8),)))),
    PlanDef("2 stages fast/fast 4|4 x4", ((2, 4, ((F, (0,), 4), (F, (1,), 4))),)),
    PlanDef("2 stages fast/fast 4|4 ZB-H1 mbs 1 x8", ((1, 8, ((F, (0,), 4), (F, (1,), 4))),), schedule="zb-h1"),
    PlanDef("2 stages fast/slow 5|3 x4", ((2, 4, ((F, (0,), 5), (S, (2,), 3))),)),
    # One micro-batch's activations are 131 kB; over 8 MB/s each hop takes ~16 ms.
    PlanDef("2 stages fast/slow 5|3 x4, 8 MB/s link", ((2, 4, ((F, (0,), 5), (S, (2,), 3))),),
            emulated_link_bw=8e6),
    PlanDef("2 stages slow/slow 4|4 GPipe x4", ((2, 4, ((S, (2,), 4), (S, (3,), 4))),), schedule="gpipe"),
    PlanDef("4 stages f,f,s,s 3|2|2|1 x4", ((2, 4, ((F, (0,), 3), (F, (1,), 2), (S, (2,), 2), (S, (3,), 1))),)),
    PlanDef("4 stages f,f,s,s 3|2|2|1 ZB-H1 mbs 1 x8",
            ((1, 8, ((F, (0,), 3), (F, (1,), 2), (S, (2,), 2), (S, (3,), 1))),), schedule="zb-h1"),
    PlanDef("TP2 fast, whole model x4", ((2, 4, ((F, (0, 1), 8),)),)),
    PlanDef("TP2 fast 5 | slow 3 x4", ((2, 4, ((F, (0, 1), 5), (S, (2,), 3))),)),
    PlanDef("fast x3 | slow x1 replicas", ((2, 3, ((F, (0,), 8),)), (2, 1, ((S, (2,), 8),)))),
    PlanDef("fast 2 stages 4|4 x3 | slow x1", ((2, 3, ((F, (0,), 4), (F, (1,), 4))), (2, 1, ((S, (2,), 8),)))),
)


def build_plan(d: PlanDef, *, cluster: Cluster, model: ModelSpec, seq_len: int) -> Plan:
    pipes = []
    for mbs, m, stages in d.pipelines:
        start, built = 0, []
        for i, (kind, devices, n) in enumerate(stages):
            built.append(Stage(kind=kind, devices=devices, layers=(start, start + n), embedding=i == 0,
                               head=i == len(stages) - 1))
            start += n
        if start != model.num_layers:
            raise ValueError(f"plan {d.name!r} covers {start} of {model.num_layers} layers")
        pipes.append(Pipeline(micro_batch_size=mbs, num_micro_batches=m, stages=tuple(built)))
    if d.emulated_link_bw is not None:
        if cluster.host is None:
            raise ValueError(f"plan {d.name!r} emulates a link, which needs a local emulation cluster (host_cores)")
        link = Link(d.emulated_link_bw, cluster.cross_kind.latency_s)
        cluster = replace(cluster, cross_kind=link, inter_node=link, host=replace(cluster.host, links=True))
    return Plan(model=model, cluster=cluster, global_batch=sum(p.num_samples for p in pipes), seq_len=seq_len,
                pipelines=tuple(pipes), schedule=d.schedule, precision="fp32",
                meta={"bench": d.name}).validate()
