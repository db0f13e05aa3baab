"""What online re-balancing needs from the planner's side, settled by the training entry point
(``hethub.train.rank_plan``) before the runtime starts, since the runtime reaches neither the
predictor nor the planner (docs/rebalance.md):

* a resumed run continues with the micro-batch counts and layer split its checkpoint was saved
  under, when that plan is the launched one re-balanced (``rebalance.rebalanced_of``);
* the predictor's forward + backward per micro-batch of each stage, which the straggler watch
  compares each rank with (``meta.rebalance.stage_fb_s``);
* for ``--rebalance layers``, the most layers each stage may hold within its memory headroom
  (``meta.rebalance.max_layers``), so that a live layer move never takes a device past what the plan
  was checked for.
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

from hethub.emulation.host import host_model
from hethub.errors import HethubError
from hethub.layout import block_starts
from hethub.plan import Plan
from hethub.predict.memory import DEFAULT_MEM_HEADROOM
from hethub.predict.predictor import predict
from hethub.predict.stage_fits import stage_memory_fits
from hethub.rebalance import rebalanced_of
from hethub.rebalance.policy import META_KEY

MAX_EXTRA_LAYERS = 2  # how far above its planned layer count a stage's memory is checked


def saved_balance(plan: Plan, args: argparse.Namespace) -> Plan:
    """The plan a resumed run trains: the checkpoint's, when it is ``plan`` re-balanced; else ``plan``.
    Anything wrong with the checkpoint is left for the runtime's resume to report."""
    from hethub.runtime.checkpoint_io import latest_dir, read_manifest, resolve

    if not args.resume:
        return plan
    src = args.checkpoint_dir if args.resume == "auto" else args.resume
    try:
        if args.resume == "auto" and latest_dir(Path(src)) is None:
            return plan
        saved = Plan.from_dict(read_manifest(resolve(src))["plan"])
    except (HethubError, OSError, KeyError, TypeError, ValueError):
        return plan
    if saved == plan or not rebalanced_of(saved, plan):
        return plan
    return replace(saved, meta=plan.meta)


def with_rebalance_meta(plan: Plan, *, layers: bool, mem_headroom: float = DEFAULT_MEM_HEADROOM) -> Plan:
    """``plan`` carrying each stage's predicted forward + backward per micro-batch and, with ``layers``,
    each stage's memory limit in layers."""
    pred = predict(plan, host=host_model(plan.cluster))
    fb = [[0.0] * len(p.stages) for p in plan.pipelines]
    for s in pred.stages:
        fb[s.pipeline][s.stage] = s.fwd_s + s.bwd_s
    meta: dict[str, object] = {"stage_fb_s": fb}
    if layers:
        meta["max_layers"] = max_layers(plan, mem_headroom=mem_headroom)
    return plan.with_meta(**{META_KEY: meta})


def max_layers(plan: Plan, *, mem_headroom: float = DEFAULT_MEM_HEADROOM) -> list[list[int]]:
    """Per pipeline and stage, the most layers (its planned count plus at most MAX_EXTRA_LAYERS) it holds
    within the memory headroom: each extra layer checked by the memory model on the plan with that
    stage grown from its neighbours. Pipelines with several model chunks per stage keep their counts."""
    out: list[list[int]] = []
    memo: dict[tuple, list[int]] = {}
    for pi, p in enumerate(plan.pipelines):
        sig = (p.micro_batch_size, tuple((s.kind, s.tp, s.num_layers, s.embedding, s.head, s.recompute)
                                         for s in p.stages))
        if plan.sharded_optimizer or sig not in memo:
            limits = []
            for si, s in enumerate(p.stages):
                n = s.num_layers
                for k in range(1, MAX_EXTRA_LAYERS + 1 if p.virtual_stages == 1 else 1):
                    grown = _grown(plan, pi, si, k)
                    if grown is None or not stage_memory_fits(grown, mem_headroom=mem_headroom)[(pi, si)]:
                        break
                    n = s.num_layers + k
                limits.append(n)
            memo[sig] = limits
        out.append(list(memo[sig]))
    return out


def _grown(plan: Plan, pi: int, si: int, k: int) -> Plan | None:
    """``plan`` with stage ``si`` of pipeline ``pi`` holding ``k`` more layers, taken from the stages
    after it (else before it), each keeping one; None when they cannot give that many."""
    p = plan.pipelines[pi]
    counts = [s.num_layers for s in p.stages]
    counts[si] += k
    left = k
    for j in [*range(si + 1, len(counts)), *range(si - 1, -1, -1)]:
        take = min(left, counts[j] - 1)
        counts[j] -= take
        left -= take
    if left:
        return None
    starts = block_starts(counts)
    stages = tuple(replace(s, layers=(a, a + n)) for s, a, n in zip(p.stages, starts, counts, strict=True))
    pipes = list(plan.pipelines)
    pipes[pi] = replace(p, stages=stages)
    return replace(plan, pipelines=tuple(pipes))
