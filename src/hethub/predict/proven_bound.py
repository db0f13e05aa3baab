"""The proven upper bound on a job's predicted tokens/s, which plans' efficiency is read against.

Every device counts at its kind's best modelled rate on its share of the layers: the least per-layer
forward + backward time of the one stage cost model (``stage_cost.py``) over the TP degrees and
micro-batch sizes a plan may use. Why no plan of those degrees and sizes can beat it under the
predictor, and what it relaxes: docs/planner.md, "Upper bound, efficiency and the kind-alone
reference". It depends on the job only, never on a plan's schedule, sharding or strategy.
"""

from __future__ import annotations

from dataclasses import dataclass

from hethub.plan import Recompute
from hethub.predict.profiles import ProfileSet
from hethub.predict.stage_cost import StageJob, stage_step
from hethub.spec.cluster import Cluster
from hethub.spec.model import ModelSpec


@dataclass(frozen=True)
class ProvenBound:
    """The bound (tokens/s) and each kind's part of it."""

    tokens_per_s: float
    by_kind: dict[str, float]

    def efficiency(self, tokens_per_s: float) -> float:
        """``tokens_per_s`` over the bound: at most 1 for any plan the planner writes (module docstring)."""
        return tokens_per_s / self.tokens_per_s if self.tokens_per_s > 0 else 0.0


def least_layer_time_s(job: StageJob, cluster: Cluster, kind: str, *, tp: int, mbs: int) -> float:
    """The least forward + backward time per layer of one micro-batch on a TP-``tp`` stage of ``kind``
    at any depth (no recomputation, no TP collectives, no embedding or head): a stage of ``l`` layers
    takes at least ``l`` times this, TP collectives being added on top (``stage_step``)."""
    k = cluster.kinds[kind]
    prof = job.profile(kind)
    entry = prof.lookup(mbs=mbs, tp=tp) if prof is not None else None
    # A measured profile may price a layer differently by the stack's depth: every depth is read.
    depths = range(1, job.model.num_layers + 1) if entry is not None and entry.layer_by_depth else (1,)
    best = float("inf")
    for layers in depths:
        t = stage_step(job, k, layers=layers, embedding=False, head=False, tp=tp, mbs=mbs,
                       recompute=Recompute.NONE).times
        best = min(best, (t.fwd_s + t.bwd_s) / layers)
    return best


def proven_bound(*, cluster: Cluster, model: ModelSpec, seq_len: int, precision: str,
                 tp_by_kind: dict[str, tuple[int, ...]], micro_batch_sizes: tuple[int, ...],
                 profiles: ProfileSet | None = None) -> ProvenBound:
    """The job's proven upper bound on tokens/s over plans whose stages of each kind use the TP degrees
    of ``tp_by_kind`` and whose micro-batches are of ``micro_batch_sizes`` (module docstring)."""
    job = StageJob.planned(model=model, cluster=cluster, seq_len=seq_len, precision=precision, profiles=profiles)
    by_kind: dict[str, float] = {}
    for kind, count in cluster.count_by_kind().items():
        rate = 0.0  # layer-tokens per second of one device
        for tp in tp_by_kind.get(kind, ()):
            for mbs in sorted(set(micro_batch_sizes)):
                tau = least_layer_time_s(job, cluster, kind, tp=tp, mbs=mbs)
                if tau > 0:
                    rate = max(rate, mbs * seq_len / (tp * tau))
        by_kind[kind] = count * rate / model.num_layers
    return ProvenBound(tokens_per_s=sum(by_kind.values()), by_kind=by_kind)
