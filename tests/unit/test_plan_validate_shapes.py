"""``Plan.validate`` checks each stage shape once per plan (``plan_check.stage_shape``) and a pipeline
that reuses no device at once: it refuses, with the same first error, exactly what the plain checks
refuse (``hethub.memo.reference_path``), on plans of replicas with one or two stages broken in any
field the checks read, the second after the first (which error comes first)."""

from __future__ import annotations

import dataclasses
import random

from test_prediction_memos import CLUSTER, _broken, _plans, validate_answers

from conftest import tiny_model
from hethub.memo import clear_caches, reference_path
from hethub.plan import Pipeline, Plan, Stage


def _replicas(rng: random.Random) -> Plan:
    """Replicas of one random template (each stage on a node of its kind: TP 2, or TP 1 on one device
    or with CP 2 over both) until a kind's nodes run out, some pipelines with CP 2 and others not."""
    model = tiny_model()
    n = rng.randint(1, 3)
    cuts = sorted(rng.sample(range(1, model.num_layers), n - 1))
    bounds = [0, *cuts, model.num_layers]
    template = [(rng.choice(["fast", "slow"]), rng.choice([1, 2])) for _ in range(n)]
    nodes = {"fast": [(i, i + 1) for i in range(0, 8, 2)], "slow": [(i, i + 1) for i in range(8, 16, 2)]}
    pipes = []
    while all(sum(k == kind for k, _ in template) <= len(nodes[kind]) for kind in nodes):
        cp = 2 if rng.random() < 0.3 else 1
        stages = []
        for si, (kind, tp) in enumerate(template):
            node = nodes[kind].pop()
            devices = node if tp == 2 or cp == 2 else node[:1]
            stages.append(Stage(kind, devices, (bounds[si], bounds[si + 1]), embedding=si == 0, head=si == n - 1,
                                cp=cp, sequence_parallel=tp == 2 and cp == 1 and rng.random() < 0.3))
        pipes.append(Pipeline(1, rng.randint(n, 4), tuple(stages)))
    return Plan(model=model, cluster=CLUSTER, global_batch=sum(p.num_samples for p in pipes), seq_len=32,
                pipelines=tuple(pipes)).validate()


def _field_broken(s: Stage, rng: random.Random) -> Stage:
    """``s`` with one field the stage checks read made wrong, or of another type."""
    change = rng.choice([
        {"embedding": not s.embedding}, {"head": not s.head}, {"kind": "nope"},
        {"kind": "slow" if s.kind == "fast" else "fast"}, {"devices": ()}, {"devices": s.devices[:1] * 3},
        {"cp": True}, {"cp": 2 if s.cp == 1 else 1}, {"cp": 3}, {"sequence_parallel": not s.sequence_parallel},
        {"sequence_parallel": 1}, {"layers": (s.layers[0], s.layers[1] + 1)}, {"embedding": 1},
    ])
    return dataclasses.replace(s, **change)


def _twice_broken(plan: Plan, rng: random.Random) -> Plan:
    """``plan`` with one stage's field broken and, sometimes, an earlier stage's devices too."""
    at = [(pi, si) for pi, p in enumerate(plan.pipelines) for si in range(len(p.stages))]
    last = len(plan.pipelines[-1].stages)  # a last replica's stage half the time: its shape passed before
    pi, si = at[rng.randrange(len(at))] if rng.random() < 0.5 else at[-1 - rng.randrange(last)]
    base = _broken(plan, rng) if rng.random() < 0.4 else plan
    pipes = list(base.pipelines)
    stages = list(pipes[pi].stages)
    stages[si] = _field_broken(plan.pipelines[pi].stages[si], rng)
    pipes[pi] = dataclasses.replace(pipes[pi], stages=tuple(stages))
    return dataclasses.replace(base, pipelines=tuple(pipes))


def test_stage_shapes_refuse_as_the_plain_checks_do() -> None:
    rng = random.Random(3)
    plans = _plans(41, 12) + [_replicas(rng) for _ in range(30)]
    cases = [*plans, *(_twice_broken(p, rng) for p in plans for _ in range(12))]
    with reference_path():
        ref = validate_answers(cases)
    assert ref[:len(plans)] == ["ok"] * len(plans) and ref.count("ok") < len(cases) // 2
    assert len({r.split(" is ")[0] for r in ref}) > 10  # many fields refused
    clear_caches()
    assert validate_answers(cases) == ref
    assert validate_answers(cases) == ref
