"""A plan's stage memories under its optimizer sharding (ZeRO-1/2/3): the split's weights from the
stages' free memory, each stage's largest slice (``predict/sharding.py``) and its sharded memory, for
the prediction (``with_sharding``) and, where only whether each stage fits is asked, a screen that
answers the same from bounds on the slices without walking the ranks (``screened_fits``)."""

from __future__ import annotations

import itertools
from collections.abc import Collection

from hethub.memo import reference
from hethub.plan import Plan
from hethub.predict.memory import StageMemory, sharded_memory, usable_bytes, zero23_memory
from hethub.predict.sharding import (
    rank_shards,
    rank_weights,
    stage_elems_bounds,
    stage_elems_of,
    stage_shard_elems,
    stage_weights,
)
from hethub.predict.zero23_bytes import zero23_stage_bytes

StageId = tuple[int, int]
# Float sums of one memory's parts in another order (a bound's parts against the exact ones') differ by
# far less than this share of the total: a screened answer keeps this margin to the usable bytes.
SCREEN_MARGIN = 1e-9


def with_sharding(plan: Plan, mems: dict[StageId, StageMemory], *, headroom: float,
                  held: dict[StageId, tuple[int, int, int]] | None = None,
                  ) -> tuple[dict[StageId, StageMemory], dict[int, float] | None]:
    """Each stage's memory under the plan's optimizer sharding, and the ranks' slice weights (None
    when unsharded: ``mems`` as they are); ``held``: the plan's ``zero23_held`` where the caller has it."""
    if not plan.sharded_optimizer:
        return mems, None
    # The split the plan carries is the one the runtime makes; the headroom only computes a missing one,
    # the same for every rank of a stage: then each stage's slice is found per stage (a shortcut: memo.py).
    if plan.shard_weights is not None:
        weights = plan.rank_shard_weights()
        per_stage = stage_shard_elems(plan, rank_shards(plan, weights))
    else:
        by_stage = shard_weights(plan, mems, headroom=headroom)
        weights = rank_weights(plan, by_stage)
        per_stage = (stage_shard_elems(plan, rank_shards(plan, weights)) if reference()
                     else stage_elems_of(plan, by_stage))
    held = zero23_held(plan) if held is None else held
    # Stages of one unsharded memory and slice (replicas) share their sharded memory (a shortcut: memo.py).
    made: dict[tuple, StageMemory] = {}
    out = {}
    fresh = reference()
    for sid, mem in mems.items():
        key = sid if fresh else (id(mem), plan.pipelines[sid[0]].stages[sid[1]].kind, per_stage[sid], held.get(sid))
        hit = made.get(key)
        if hit is None:
            hit = made[key] = sharded_stage(plan, sid, mem, per_stage[sid], held.get(sid))
        out[sid] = hit
    return out, weights


def sharded_stage(plan: Plan, sid: StageId, mem: StageMemory, elems: tuple[int, int],
                  held: tuple[int, int, int] | None) -> StageMemory:
    """Stage ``sid``'s memory ``mem`` with its largest (moment, master) slice ``elems``, and under ZeRO-2/3
    its ``zero23_stage_bytes`` ``held``: each part its stage's on every rank but the gradient shard,
    whose largest is the largest moment slice's (``zero23_rank_bytes``)."""
    s = plan.pipelines[sid[0]].stages[sid[1]]
    out = sharded_memory(mem, moment_elems=elems[0], master_elems=elems[1], precision=plan.precision_of(s.kind),
                         kind=plan.cluster.kinds[s.kind])
    if held is not None:
        whole, gathered, rounds = held
        out = zero23_memory(out, stage=plan.zero_stage, moment_elems=elems[0], grad_bytes=4 * elems[0],
                            whole_weight_bytes=whole, gathered_bytes=gathered, round_bytes=rounds)
    return out


def zero23_held(plan: Plan) -> dict[StageId, tuple[int, int, int]]:
    """Per stage under ZeRO-2/3: its ``zero23_stage_bytes`` (none below ZeRO-2)."""
    if plan.zero_stage < 2:
        return {}
    ids = ((pi, si) for pi, p in enumerate(plan.pipelines) for si in range(len(p.stages)))  # stage_places' order
    return dict(zip(ids, zero23_stage_bytes(plan), strict=True))


def shard_weights(plan: Plan, mems: dict[StageId, StageMemory], *, headroom: float) -> dict[StageId, float]:
    """Each stage's ranks' weight in their buckets' optimizer-state split (predict/sharding.py): with
    ``proportional`` shares, its device's usable memory less the stage's predicted peak without
    optimizer state and master weights (both sharded in mixed precision; none in fp32)."""
    # What ZeRO-2 and 3 shard too (gradients; parameters) is not what a share has to fit beside.
    sharded = {2: ("grads",), 3: ("grads", "weights")}.get(plan.zero_stage, ())
    usable = {kind: usable_bytes(k, headroom=headroom) for kind, k in plan.cluster.kinds.items()}
    made: dict[tuple[int, str], float] = {}  # replicas' stages share their memory
    free = {}
    for (pi, si), mem in mems.items():
        kind = plan.pipelines[pi].stages[si].kind
        key = (id(mem), kind)
        if key not in made:
            made[key] = usable[kind] - (mem.total_bytes - mem.optimizer_bytes - mem.master_weights_bytes
                                        - sum(getattr(mem, f"{part}_bytes") for part in sharded))
        free[(pi, si)] = made[key]
    return stage_weights(plan, free_bytes=free)


def screened_fits(plan: Plan, mems: dict[StageId, StageMemory], *, headroom: float, usable: dict[str, float],
                  asked: Collection[StageId] | None = None, held: dict[StageId, tuple[int, int, int]] | None = None,
                  ) -> dict[StageId, bool] | None:
    """Per stage (of ``asked``; None: all), whether its memory under the plan's sharding (``with_sharding``)
    is within ``usable`` bytes of its kind, found from ``stage_elems_bounds``' slices instead of the exact
    ones where both bounds agree, else None (then ask ``with_sharding``). Sound: a stage's total grows
    with its slices part by part (``sharded_memory``, ``zero23_memory``), so the exact total lies
    between the bounds'. Only for a plan whose split is found from its memory (no ``shard_weights``),
    off the reference path. ``held``: as for ``with_sharding``."""
    by_stage = shard_weights(plan, mems, headroom=headroom)  # in stage_places' order
    lo_m, hi_m, lo_ma, hi_ma = stage_elems_bounds(plan, list(by_stage.values()))
    held = zero23_held(plan) if held is None else held
    starts = list(itertools.accumulate((len(p.stages) for p in plan.pipelines), initial=0))
    out: dict[StageId, bool] = {}
    made: dict[tuple, bool] = {}  # replicas' stages: one memory, weight and slice bounds
    for sid in by_stage if asked is None else asked:
        i = starts[sid[0]] + sid[1]
        mem, kind, stage_held = mems[sid], plan.pipelines[sid[0]].stages[sid[1]].kind, held.get(sid)
        key = (id(mem), kind, lo_m[i], hi_m[i], lo_ma[i], hi_ma[i], stage_held)
        hit = made.get(key)
        if hit is None:
            cap = usable[kind]
            slack = abs(cap) * SCREEN_MARGIN
            if sharded_stage(plan, sid, mem, (hi_m[i], hi_ma[i]), stage_held).total_bytes <= cap - slack:
                hit = True
            elif sharded_stage(plan, sid, mem, (lo_m[i], lo_ma[i]), stage_held).total_bytes > cap + slack:
                hit = False
            else:
                return None
            made[key] = hit
        out[sid] = hit
    return out
