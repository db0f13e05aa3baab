"""Baseline strategies that show what the heterogeneity-aware search gains.

Both use every device in device-id order, Megatron-style: dp pipelines of pp stages of tp devices,
pipeline i on a contiguous block of devices. They differ only in how they split work:

* ``uniform``: equal layers per stage (the first L mod pp stages take one more) and an equal batch
  per replica, whatever the kinds;
* ``flops-proportional``: layers per stage in proportion to the stage's effective FLOP/s, and
  micro-batches per replica in proportion to the replica's FLOP/s.

Each returns every memory-feasible (tp, pp, dp, micro-batch) shape with a closed-form step time;
the planner re-scores the best few with the predictor.
"""

from __future__ import annotations

from hethub.plan import Pipeline, Plan, Stage
from hethub.predict.closed_step import step_time_s
from hethub.schedules import get_schedule
from hethub.search.combine import Group
from hethub.search.split import Slot, price, recompute_options
from hethub.search.templates import Searcher, tp_options


def _proportional(total: int, weights: list[float], *, minimum: int) -> list[int] | None:
    """Integers >= minimum summing to total, proportional to weights (largest remainder)."""
    n = len(weights)
    spare = total - minimum * n
    if spare < 0:
        return None
    raw = [spare * w / sum(weights) for w in weights]
    out = [int(x) for x in raw]
    for i in sorted(range(n), key=lambda i: out[i] - raw[i])[: spare - sum(out)]:
        out[i] += 1
    return [minimum + x for x in out]


def baseline_plans(s: Searcher, *, strategy: str) -> list[Plan]:
    """The strategy's layouts for every TP, PP and DP degree and micro-batch size, best closed form first."""
    cluster, model, cfg = s.cluster, s.model, s.config
    ids = [d.id for d in cluster.devices]
    n_dev, n_layers = len(ids), model.num_layers
    common = set(cfg.tp_degrees)
    for k in cluster.kind_names:
        common &= set(tp_options(cluster, model, k, cfg.tp_degrees))
    out: list[tuple[float, Plan]] = []
    for tp in sorted(common):
        for pp in range(1, min(n_layers, n_dev // tp) + 1):
            if n_dev % (tp * pp):
                continue
            dp = n_dev // (tp * pp)
            if cfg.global_batch % dp:
                continue
            for mbs in cfg.usable_micro_batch_sizes:
                if (cfg.global_batch // dp) % mbs:
                    continue
                plan = _shape(s, strategy=strategy, ids=ids, tp=tp, pp=pp, dp=dp, mbs=mbs)
                if plan is not None:
                    out.append(plan)
    return [plan for _, plan in sorted(out, key=lambda x: x[0])]


def _shape(s: Searcher, *, strategy: str, ids: list[int], tp: int, pp: int, dp: int,
           mbs: int) -> tuple[float, Plan] | None:
    cluster, model, cfg = s.cluster, s.model, s.config
    kinds = [[cluster.devices[ids[(i * pp + st) * tp]].kind for st in range(pp)] for i in range(dp)]
    total_mb = cfg.global_batch // mbs
    if strategy == "uniform":
        layer_split = [[model.num_layers // pp + (i < model.num_layers % pp) for i in range(pp)]] * dp
        mbs_split = [total_mb // dp] * dp
    else:
        speed = [[cluster.kinds[k].effective_flops * tp for k in row] for row in kinds]
        layer_split = [_proportional(model.num_layers, row, minimum=1) for row in speed]
        mbs_split = _proportional(total_mb, [sum(row) for row in speed], minimum=1)
        if mbs_split is None or any(x is None for x in layer_split):
            return None
    groups, pipelines = [], []
    for i in range(dp):
        slots = tuple(Slot(k, tp) for k in kinds[i])
        models, m = [], mbs_split[i]
        for st, (slot, n) in enumerate(zip(slots, layer_split[i], strict=True)):
            in_flight = get_schedule(cfg.schedule).in_flight(stage=st, num_stages=pp, num_micro_batches=m)
            for rc in recompute_options(cfg.allow_recompute):
                sm = s.book.stage(slot.kind, tp=tp, mbs=mbs, recompute=rc)
                if sm.max_layers(emb=st == 0, head=st == pp - 1, in_flight=in_flight, limit=n) >= n:
                    models.append(sm)
                    break
            else:
                return None
        pc = price(models, layer_split[i], model=model, slots=slots, mbs=mbs, hops=s.links.pipe_hops,
                   schedule=cfg.schedule)
        groups.append((Group(pc, 1), m))
        stages, start = [], 0
        for st, n in enumerate(layer_split[i]):
            devs = tuple(ids[(i * pp + st) * tp:(i * pp + st + 1) * tp])
            stages.append(Stage(kind=slots[st].kind, devices=devs, layers=(start, start + n), embedding=st == 0,
                                head=st == pp - 1, recompute=models[st].recompute))
            start += n
        pipelines.append(Pipeline(micro_batch_size=mbs, num_micro_batches=m, stages=tuple(stages)))
    step = step_time_s([g for g, _ in groups], [g.pipe.time_s(m) for g, m in groups], links=s.links, model=model,
                       precision=cfg.precision)
    plan = Plan(model=model, cluster=cluster, global_batch=cfg.global_batch, seq_len=cfg.seq_len,
                pipelines=tuple(pipelines), schedule=cfg.schedule, precision=cfg.precision, strategy=strategy)
    return step, plan
