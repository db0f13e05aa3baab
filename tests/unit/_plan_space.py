"""The planner's search space, enumerated exhaustively (for small problems and tests only).

A plan in the space:

* one micro-batch size b for every pipeline (b divides the global batch);
* any number of pipelines, each an ordered sequence of kind segments: every kind at most once per
  pipeline, one TP degree per segment (a power of two dividing the kind's node size and the model's
  heads, KV heads and FFN size), one or more stages per segment;
* any layer split: stages in the middle hold >= 1 layer, the first and last may hold only the
  embedding / head;
* recomputation per stage: the fastest of none, selective, full that fits the stage (each only adds
  time; layout_assemble.py);
* any positive micro-batch counts summing to global_batch / b;
* devices placed by assemble.allocate_devices; devices may stay idle; every stage must fit memory.

The planner searches this space with pruning and closed-form bounds (docs/planner.md); a test checks
on small clusters that it finds the exhaustive optimum under the same predictor.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

from hethub.layout_assemble import allocate_devices, to_pipeline
from hethub.plan import Plan
from hethub.predict.predictor import predict
from hethub.predict.profiles import ProfileSet
from hethub.predict.result import Prediction
from hethub.predict.stage_modes import choose_recompute
from hethub.search.config import PlannerConfig
from hethub.search.split import Slot
from hethub.search.templates import Searcher
from hethub.spec.cluster import Cluster
from hethub.spec.model import ModelSpec

MAX_DEVICES = 8
MAX_LAYERS = 8


def pipeline_shapes(s: Searcher) -> list[tuple[Slot, ...]]:
    """Every stage sequence a pipeline may have (before layers), within the cluster's device counts."""
    segs = {k: [(t, n) for t in s.tps[k] for n in range(1, s.counts[k] // t + 1)] for k in s.counts}
    out = []
    kinds = list(s.counts)
    for size in range(1, len(kinds) + 1):
        for order in itertools.permutations(kinds, size):
            for choice in itertools.product(*[segs[k] for k in order]):
                slots = tuple(Slot(k, t) for k, (t, n) in zip(order, choice, strict=True) for _ in range(n))
                if len(slots) <= s.model.num_layers + 2:
                    out.append(slots)
    return out


def _splits(n_layers: int, p: int) -> Iterator[tuple[int, ...]]:
    if p == 1:
        yield (n_layers,)
        return
    for first in range(n_layers + 1):
        for last in range(n_layers - first + 1):
            middle = n_layers - first - last
            if p == 2:
                if middle == 0:
                    yield (first, last)
                continue
            # Middle stages >= 1 each: compositions of `middle` into p - 2 positive parts.
            if middle < p - 2:
                continue
            for cuts in itertools.combinations(range(1, middle), p - 3):
                parts = [b - a for a, b in itertools.pairwise((0, *cuts, middle))]
                yield (first, *parts, last)


def _compositions(total: int, parts: int) -> Iterator[tuple[int, ...]]:
    for cuts in itertools.combinations(range(1, total), parts - 1):
        yield tuple(b - a for a, b in itertools.pairwise((0, *cuts, total)))


def enumerate_plans(*, cluster: Cluster, model: ModelSpec, config: PlannerConfig,
                    profiles: ProfileSet | None = None) -> Iterator[Plan]:
    """Every memory-feasible-by-construction plan of the space (predict() still checks memory)."""
    if cluster.num_devices > MAX_DEVICES or model.num_layers > MAX_LAYERS:
        raise ValueError(f"exhaustive enumeration is for <= {MAX_DEVICES} devices and <= {MAX_LAYERS} layers")
    s = Searcher(cluster=cluster, model=model, config=config, profiles=profiles)
    shapes = pipeline_shapes(s)
    for mbs in config.usable_micro_batch_sizes:
        total_mb = config.global_batch // mbs
        # The memory-feasible splits of every shape (recomputation chosen per stage).
        priced = [[pc for split in _splits(model.num_layers, len(sh)) if (pc := s.fixed(sh, split, mbs)) is not None]
                  for sh in shapes]
        options = [i for i, ps in enumerate(priced) if ps]
        for combo in _multisets(options, shapes, dict(s.counts), limit=min(total_mb, cluster.num_devices)):
            # Identical shapes: choose their splits as a multiset too.
            per_shape = [(i, len(list(g))) for i, g in itertools.groupby(combo)]
            choices = [itertools.combinations_with_replacement(priced[i], n) for i, n in per_shape]
            for picked in itertools.product(*choices):
                pipes = [pc for group in picked for pc in group]
                devices = allocate_devices(cluster, pipes)
                seen = set()
                for ms in _compositions(total_mb, len(pipes)):
                    key = tuple(sorted(zip((id(p) for p in pipes), ms, strict=True)))
                    if key not in seen:  # permuting the counts of identical pipelines gives the same plan
                        seen.add(key)
                        yield _plan(s, pipes, devices, ms, mbs)


def _multisets(options: list[int], shapes: list[tuple[Slot, ...]], free: dict[str, int],
               limit: int, start: int = 0) -> Iterator[tuple[int, ...]]:
    """Nondecreasing tuples of shape indices whose devices fit `free`, at most `limit` long."""
    if limit == 0:
        return
    for j in range(start, len(options)):
        i = options[j]
        need: dict[str, int] = {}
        for sl in shapes[i]:
            need[sl.kind] = need.get(sl.kind, 0) + sl.tp
        if any(n > free[k] for k, n in need.items()):
            continue
        yield (i,)
        rest = {k: free[k] - need.get(k, 0) for k in free}
        for tail in _multisets(options, shapes, rest, limit - 1, j):
            yield (i, *tail)


def _plan(s: Searcher, pipes: list, devices: list, ms: tuple[int, ...], mbs: int) -> Plan:
    pipelines = [to_pipeline(pc, devs, num_micro_batches=m, mbs=mbs)
                 for pc, devs, m in zip(pipes, devices, ms, strict=True)]
    cfg = s.config
    plan = Plan(model=s.model, cluster=s.cluster, global_batch=cfg.global_batch, seq_len=cfg.seq_len,
                pipelines=tuple(pipelines), schedule=cfg.schedule, precision=cfg.precision, strategy="exhaustive")
    return choose_recompute(plan, allow_recompute=cfg.allow_recompute, mem_headroom=cfg.mem_headroom,
                            allow_sp=cfg.sequence_parallel)


def exhaustive_best(*, cluster: Cluster, model: ModelSpec, config: PlannerConfig,
                    profiles: ProfileSet | None = None) -> tuple[Plan, Prediction, int]:
    """The predictor's best plan of the whole space, and how many plans were scored."""
    best: tuple[Plan, Prediction] | None = None
    n = 0
    for plan in enumerate_plans(cluster=cluster, model=model, config=config, profiles=profiles):
        pred = predict(plan, profiles=profiles, mem_headroom=config.mem_headroom)
        n += 1
        if pred.fits_memory and (best is None or pred.step_time_s < best[1].step_time_s):
            best = (plan, pred)
    if best is None:
        raise ValueError("no plan of the space fits memory")
    return best[0], best[1], n
