"""The search's stage costs: caches over the predictor's stage cost model (predict/stage_cost.py).

Every decoder layer is identical, so a stage's time and memory are affine in its layer count and
the search prices a stage in O(1) (predict.stage_cost.StageModel); the rules themselves (TP,
profile, attention, precision, vocabulary, memory) live there only.
"""

from __future__ import annotations

from dataclasses import dataclass

from hethub.plan import Recompute
from hethub.predict.memory import DEFAULT_MEM_HEADROOM, usable_bytes
from hethub.predict.profiles import ProfileSet
from hethub.predict.stage_cost import Affine, StageJob, StageModel
from hethub.spec.cluster import Cluster
from hethub.spec.model import ModelSpec

__all__ = ["RECOMPUTE_ORDER", "Affine", "CostBook", "Job", "RecomputeFloor", "StageCost", "recompute_options"]

# The recomputation modes, by falling memory and rising backward time: a stage takes the first that fits.
RECOMPUTE_ORDER = (Recompute.NONE, Recompute.SELECTIVE, Recompute.FULL)
StageCost = StageModel


def recompute_options(allow_recompute: bool) -> tuple[Recompute, ...]:
    """The modes a stage may take once the layout is fixed (polish, baselines): all, or only ``none``."""
    return RECOMPUTE_ORDER if allow_recompute else (Recompute.NONE,)


@dataclass(frozen=True)
class Job:
    """What every stage cost of one search depends on besides the stage itself."""

    model: ModelSpec
    seq_len: int
    precision: str
    schedule: str
    profiles: ProfileSet | None = None
    chunks: int = 1  # model chunks per stage the schedule runs (interleaved: v)
    relax_memory: bool = False  # the upper bound prices kinds that cannot hold the model
    mem_headroom: float = DEFAULT_MEM_HEADROOM  # share of each device's memory plans leave free
    # ZeRO-1: each stage keeps AdamW state for 1/holders of its parameters (an assumption the
    # predictor checks on the finalists with the plan's real holders); 1: unsharded.
    optimizer_shard_holders: int = 1


class RecomputeFloor:
    """What the search's floors (bounds.py, mixed.py) take for "a stage that recomputes": the most
    layers either recomputing mode holds (full's, in practice) at the least time either takes
    (selective's). The split prices both modes (split._options), so a floor built from none and this
    stays below every split whichever mode each stage takes."""

    def __init__(self, selective: StageCost, full: StageCost) -> None:
        self.modes = (selective, full)
        for name in ("fwd_per_layer_s", "bwd_per_layer_s", "emb_fwd_s", "emb_bwd_s", "head_fwd_s", "head_bwd_s"):
            setattr(self, name, min(getattr(m, name) for m in self.modes))

    def work(self, *, emb: bool, head: bool) -> Affine:
        works = [m.work(emb=emb, head=head) for m in self.modes]
        return Affine(min(w.per_layer for w in works), min(w.base for w in works))

    def max_layers(self, *, emb: bool, head: bool, in_flight: int, limit: int) -> int:
        return max(m.max_layers(emb=emb, head=head, in_flight=in_flight, limit=limit) for m in self.modes)


class CostBook:
    """StageCosts by shape, and layer splits by template: built once per job, shared by searches."""

    def __init__(self, job: Job, cluster: Cluster) -> None:
        self.job, self.kinds = job, cluster.kinds
        self.stage_job = StageJob.planned(model=job.model, cluster=cluster, seq_len=job.seq_len,
                                          precision=job.precision, profiles=job.profiles)
        self._cache: dict[tuple[str, int, int, Recompute], StageModel] = {}
        self.splits: dict[tuple, object] = {}
        self.options: dict[tuple, list] = {}
        self.capacity: dict[tuple, object] = {}  # bounds.Capacity by (kind, tp, micro-batch size)
        self.floors: dict[tuple, tuple[float, float] | None] = {}  # bounds.py: kind-pure templates' time floors
        self.stage_floors: dict[tuple, tuple[float, float]] = {}  # bounds.py: (per layer, base) of a stage
        self.pipe_floors: dict[tuple, object] = {}  # bounds.pipe_floor by (segments, micro-batch size)
        self.solo: dict[tuple[int, int], tuple[object, float]] = {}  # (id(pipe), replicas) -> (pipe, sync tail)

    def recompute_floor(self, kind: str, *, tp: int, mbs: int) -> RecomputeFloor:
        """The floors' stand-in for every recomputing mode of one stage shape (see RecomputeFloor)."""
        key = ("floor", kind, tp, mbs)
        hit = self.options.get(key)
        if hit is None:
            hit = self.options[key] = RecomputeFloor(self.stage(kind, tp=tp, mbs=mbs, recompute=Recompute.SELECTIVE),
                                                     self.stage(kind, tp=tp, mbs=mbs, recompute=Recompute.FULL))
        return hit  # type: ignore[return-value]

    def stage(self, kind: str, *, tp: int, mbs: int, recompute: Recompute | bool) -> StageCost:
        """The cost model of one stage shape (a bool ``recompute`` means full or none)."""
        recompute = Recompute.of(recompute)
        key = (kind, tp, mbs, recompute)
        sm = self._cache.get(key)
        if sm is None:
            k, j = self.kinds[kind], self.job
            cap = float("inf") if j.relax_memory else usable_bytes(k, headroom=j.mem_headroom)
            sm = self._cache[key] = StageModel(self.stage_job, k, tp=tp, mbs=mbs, recompute=recompute,
                                               capacity_bytes=cap, shard_holders=j.optimizer_shard_holders)
        return sm
