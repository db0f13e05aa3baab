"""The default path: one enumeration of candidate shapes, priced under every schedule and optimizer
sharding the config leaves open.

A *variant* is a schedule and an optimizer sharding. A shape (kind-pure templates, their replicas
and fills, mixed pipelines) does not depend on the variant; its layer splits (in-flight memory),
closed-form times and memory do. The search enumerates shapes per sharding (sharding frees memory,
which admits shapes the unsharded search cannot hold) and per schedule whose closed form differs
(1F1B, ZB-H1: each prunes with its own bar, and ZB-H1 favours deeper pipelines), and pools the best
distinct shapes of all; every variant splits and prices every shape of the pool (`reprice`). The
predictor then scores each variant's best, the best are polished, and the interleaved schedule
starts from the 1F1B plans and from the shapes priced with stages sized for two chunks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from hethub.plan import PLANNED_SHARDINGS, Plan, zero_stage_of
from hethub.predict.host import HostModel
from hethub.predict.profiles import ProfileSet
from hethub.predict.result import Prediction
from hethub.predict.stage_links import LinkBook
from hethub.schedules import AUTO_CANDIDATES, AUTO_SCHEDULE
from hethub.search.combine import Estimate, Group, estimate_samples
from hethub.search.config import PlannerConfig
from hethub.search.finalists import BoundParts, bound_parts, finalist_plans, score_plans
from hethub.search.hetero import plan_key, search
from hethub.search.templates import Books, Searcher
from hethub.spec.cluster import Cluster
from hethub.spec.model import ModelSpec

ONE_F_ONE_B, INTERLEAVED = "1f1b", "interleaved"
SIZED_CHUNKS = 2  # the v the interleaved schedule's stages are also sized for
# Distinct shapes of each enumeration priced under every variant (their first `finalists + top_k`
# are what one variant's own search would have kept; the rest is room for the variants' reorder).
SHAPES_PER_ENUMERATION = 24


@dataclass(frozen=True)
class Variant:
    """A schedule (with its model chunks per stage) and an optimizer sharding."""

    schedule: str
    sharding: str
    chunks: int = 1

    def config(self, config: PlannerConfig, *, holders: int = 1) -> PlannerConfig:
        return replace(config, schedule=self.schedule, optimizer_sharding=self.sharding, virtual_stages=self.chunks,
                       shard_holders=holders if self.sharding != "none" else 1)

    def pool(self, shapes: list[Estimate], firsts: frozenset[int]) -> tuple[list[Estimate], frozenset[int]]:
        """The shapes the variant prices (and which are the enumerations' firsts): all of them, or for
        ZeRO-2/3 only the enumerations' firsts and only where memory binds (some stage of the pool
        recomputes or runs SP): their per-micro-batch collectives cost time (docs/planner.md)."""
        if zero_stage_of(self.sharding) < 2:
            return shapes, firsts
        if not any(any(g.pipe.recompute) or any(g.pipe.sp) for e in shapes for g in e.groups):
            return [], frozenset()
        return [shapes[i] for i in sorted(firsts)], frozenset(range(len(firsts)))

    def searcher(self, config: PlannerConfig, *, cluster: Cluster, model: ModelSpec, profiles: ProfileSet | None,
                 links: LinkBook, holders: int = 1) -> Searcher:
        """The variant's searcher (its stage models, splits and checks), on the job's one ``links``."""
        return Searcher(cluster=cluster, model=model, config=self.config(config, holders=holders), profiles=profiles,
                        books=Books(links=links))


def variants_of(config: PlannerConfig) -> tuple[list[Variant], list[str]]:
    """The variants the config leaves open (the interleaved schedule's sized one included) and the
    shardings."""
    schedules = list(AUTO_CANDIDATES) if config.schedule == AUTO_SCHEDULE else [config.schedule]
    shardings = ["none", "zero1"] if config.optimizer_sharding == "auto" else [config.optimizer_sharding]
    # ZeRO-2/3 free memory the way ZeRO-1 does, more of it: their shapes are the enumerations' (priced
    # under them where memory binds, `Variant.offered`), not enumerated again.
    priced = list(PLANNED_SHARDINGS) if config.optimizer_sharding == "auto" else shardings
    out = [Variant(sch, z) for sch in schedules if sch != INTERLEAVED for z in priced]
    if INTERLEAVED in schedules and config.strategy == "hethub":
        out += [Variant(INTERLEAVED, z, SIZED_CHUNKS) for z in priced if zero_stage_of(z) < 3]
    return out, shardings


@dataclass
class Enumeration:
    """The shapes of one enumeration (one schedule, one sharding), best closed form first, and each
    kind alone under it (the bound's parts)."""

    schedule: str
    sharding: str
    shapes: list[Estimate]
    bound: BoundParts


def enumerate_shapes(s: Searcher, *, host: HostModel | None, bar: Sequence[float] = ()) -> Enumeration:
    """One enumeration: the search's candidates under ``s``'s schedule and sharding that could beat
    the closed-form steps ``bar`` (the enumerations before it), and each kind alone (the bound's
    parts). ``s`` is the variant's searcher, which `priced_plans` reuses (its splits and checks)."""
    shapes, seen = [], set()
    for est in search(s, bar=bar):
        key = plan_key(est)
        if key not in seen:
            seen.add(key)
            shapes.append(est)
        if len(shapes) >= SHAPES_PER_ENUMERATION:
            break
    parts = bound_parts(cluster=s.cluster, model=s.model, config=s.config, profiles=s.job.profiles, books=s.books,
                        host=host)
    return Enumeration(s.config.schedule, s.config.optimizer_sharding, shapes, parts)


def reprice(s: Searcher, est: Estimate) -> Estimate | None:
    """``est``'s shape (each group's stage kinds, TP degrees and replicas) split and priced under the
    searcher's variant; None where it does not fit."""
    groups = []
    for g in est.groups:
        pipes = s.splits(g.pipe.slots, g.pipe.mbs)
        if not pipes:
            return None
        groups.append(Group(pipes[0], g.count))
    sizes = {g.pipe.mbs for g in groups}
    if len(sizes) == 1:
        out = s.estimate(groups, sizes.pop())
    else:
        out = estimate_samples(groups, total_samples=s.config.global_batch, links=s.links, model=s.model,
                               precision=s.config.precision)
    return out if out is not None and s.fits(out) else None


def priced_plans(s: Searcher, *, config: PlannerConfig, host: HostModel | None, shapes: list[Estimate], keep: int,
                 firsts: frozenset[int] = frozenset()) -> list[tuple[Plan, Prediction]]:
    """The shapes priced under the variant of ``s`` (its searcher: sharded stages assume its holders,
    as the sharded enumeration did), the best distinct laid out and predicted, with those of the
    shapes at ``firsts`` (indices); fastest first. ``config``: the user's (finalists, top_k)."""
    profiles = s.job.profiles
    ests: list[Estimate] = []
    first: list[Estimate] = []  # the enumeration's own best few, whatever this variant's closed form says
    for i, est in enumerate(shapes):
        got = reprice(s, est)
        if got is not None:
            ests.append(got)
            if i in firsts:
                first.append(got)
    if not ests:
        return []
    # The closed form ranks variants with errors of their own (ZB-H1's split backward is an assumed
    # half), so the shapes the enumeration ranked first are laid out too and the predictor decides.
    ests.sort(key=lambda e: e.step_time_s)
    n = config.finalists + config.top_k
    ests = ests[:n] + [e for e in first if e not in ests[:n]] + ests[n:]
    cfg = replace(s.config, top_k=config.top_k, finalists=config.finalists + len(first))
    plans = finalist_plans(s, ests, config=cfg, strategy="hethub", per_size=config.per_size_finalists)
    return score_plans(plans, profiles, host=host, headroom=config.mem_headroom, keep=keep)
