"""Each kind alone: the upper bound's parts (HETHUB's bound, searched as thoroughly as the combined
plan), and each kind's best single-kind plans, which the combined search's finalists include."""

from __future__ import annotations

from hethub.plan import Plan
from hethub.predict.host import HostModel
from hethub.predict.profiles import ProfileSet
from hethub.predict.result import Prediction
from hethub.search.config import PlannerConfig
from hethub.search.finalists import finalist_plans, score_plans
from hethub.search.hetero import search
from hethub.search.templates import Books, Searcher
from hethub.spec.cluster import Cluster
from hethub.spec.model import ModelSpec

# Each kind's part of the bound, its notes, the kind-alone finalists scored, the relaxed kinds.
BoundParts = tuple[dict[str, float], tuple[str, ...], list[tuple[Plan, Prediction]], frozenset[str]]


def bound_parts(*, cluster: Cluster, model: ModelSpec, config: PlannerConfig,
                profiles: ProfileSet | None, books: Books | None = None,
                host: HostModel | None = None) -> BoundParts:
    """Each kind's part of the upper bound, its notes, each kind's best feasible single-kind
    candidates, scored, and the kinds whose part is a relaxed-memory plan."""
    parts: dict[str, float] = {}
    relaxed_kinds: set[str] = set()
    notes, feasible = [], []
    for kind in cluster.kind_names:
        plans = _kind_alone(cluster=cluster, model=model, config=config, profiles=profiles, kind=kind, relax=False,
                            books=books)
        # The part is the best, and the combined search takes the best two (`feasible`).
        scored = score_plans(plans, profiles, host=host, headroom=config.mem_headroom, keep=2)
        if scored:
            feasible.extend(scored[:2])
            parts[kind] = scored[0][1].tokens_per_s
            continue
        relaxed = score_plans(_kind_alone(cluster=cluster, model=model, config=config, profiles=profiles, kind=kind,
                                     relax=True, books=books), profiles, require_fit=False, host=host,
                         headroom=config.mem_headroom, keep=1)
        n = cluster.count_by_kind()[kind]
        parts[kind] = relaxed[0][1].tokens_per_s if relaxed else 0.0
        if relaxed:
            relaxed_kinds.add(kind)
            notes.append(f"kind {kind} alone ({n} devices) cannot hold {model.name} at seq_len {config.seq_len}; "
                         "the upper bound uses its best plan with the memory limit relaxed")
        else:
            notes.append(f"kind {kind} alone ({n} devices) has no plan for {model.name} even with memory relaxed "
                         "(no usable TP degree or too few devices); it adds nothing to the upper bound")
    return parts, tuple(notes), feasible, frozenset(relaxed_kinds)


def _kind_alone(*, cluster: Cluster, model: ModelSpec, config: PlannerConfig, profiles: ProfileSet | None,
                kind: str, relax: bool, books: Books | None) -> list[Plan]:
    s = Searcher(cluster=cluster, model=model, config=config, profiles=profiles, relax_memory=relax, kinds=(kind,),
                 books=books)
    return finalist_plans(s, search(s, kinds_alone=True), config=config, strategy="homogeneous",
                          per_size=config.per_size_finalists)
