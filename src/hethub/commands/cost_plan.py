"""Cost-aware planning: an hourly price per device kind, dollars per token, budgets.

Users rent mixed fleets by the hour, so the cheapest way to train is not always to use every
device: a slow kind can cost more per token than it adds. The planner here searches sub-fleets
(every non-empty subset of the kinds, each at all, half or a quarter of its nodes, whole nodes
only) with `make_plan` and keeps, among the plans that meet the budget and the throughput floor,

* ``objective="throughput"``: the most tokens/s;
* ``objective="cost"``: the fewest dollars per token, i.e. price per hour / (tokens/s x 3600).

A plan pays for the devices it uses (a pipeline's devices, at their kind's price per device-hour);
devices of the cluster it leaves idle are reported as left out. Prices come from the catalog
(on-demand cloud list prices, with their sources) or the cluster file (``price_per_hour`` under
``[kinds.NAME]``).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace

from hethub.errors import InfeasibleError, SpecError
from hethub.plan import Plan
from hethub.predict.profiles import ProfileSet
from hethub.search.config import PlannerConfig
from hethub.search.planner import PlanResult, make_plan
from hethub.spec.cluster import Cluster
from hethub.spec.model import ModelSpec

NODE_FRACTIONS = (1.0, 0.5, 0.25)  # of each kind's nodes, in sub-fleets


@dataclass(frozen=True)
class Costed:
    """A plan with what it costs."""

    result: PlanResult
    price_per_hour: float  # dollars per hour of the devices the plan uses
    left_out: dict[str, int]  # devices of each kind of the full cluster the plan does not use

    @property
    def tokens_per_s(self) -> float:
        return self.result.prediction.tokens_per_s

    @property
    def usd_per_million_tokens(self) -> float:
        return usd_per_million_tokens(self.price_per_hour, self.tokens_per_s)

    def meets(self, *, budget_per_hour: float | None, min_tokens_per_s: float | None) -> bool:
        return ((budget_per_hour is None or self.price_per_hour <= budget_per_hour * (1 + 1e-12))
                and (min_tokens_per_s is None or self.tokens_per_s >= min_tokens_per_s))


@dataclass(frozen=True)
class CostPlan:
    """The chosen plan, the plain throughput plan on the whole cluster beside it, and how many
    sub-fleets were searched."""

    chosen: Costed
    throughput: Costed
    considered: int


def usd_per_million_tokens(price_per_hour: float, tokens_per_s: float) -> float:
    return price_per_hour / (tokens_per_s * 3600) * 1e6 if tokens_per_s > 0 else float("inf")


def plan_price_per_hour(plan: Plan) -> float:
    """Dollars per hour of the devices `plan` uses; SpecError names a kind without a price."""
    total = 0.0
    for d in plan.devices:
        kind = plan.cluster.kind_of(d)
        total += kind_price(plan.cluster, kind.name)
    return total


def kind_price(cluster: Cluster, kind: str) -> float:
    price = cluster.kinds[kind].price_per_hour
    if price is None:
        raise SpecError(f"cluster {cluster.name!r}: kind {kind!r} has no 'price_per_hour' (the catalog has no "
                        f"public price for it). Fix: add price_per_hour = <dollars per device-hour> under "
                        f"[kinds.{kind}] in the cluster file.")
    return price


def costed(result: PlanResult, full: Cluster) -> Costed:
    used: dict[str, int] = {}
    for d in result.plan.devices:
        k = result.plan.cluster.devices[d].kind
        used[k] = used.get(k, 0) + 1
    left = {k: n - used.get(k, 0) for k, n in full.count_by_kind().items() if n - used.get(k, 0) > 0}
    return Costed(result=result, price_per_hour=plan_price_per_hour(result.plan), left_out=left)


def sub_fleets(cluster: Cluster) -> list[Cluster]:
    """Every non-empty subset of the kinds, each at NODE_FRACTIONS of its nodes (at least one node),
    whole cluster first; duplicates dropped."""
    kinds = cluster.kind_names
    out, seen = [], set()
    for size in range(len(kinds), 0, -1):
        for subset in itertools.combinations(kinds, size):
            for frac in NODE_FRACTIONS:
                groups = tuple(replace(g, num_nodes=max(1, int(g.num_nodes * frac)))
                               for g in cluster.groups if g.kind in subset)
                key = tuple((g.kind, g.num_nodes, g.devices_per_node) for g in groups)
                if key in seen:
                    continue
                seen.add(key)
                name = cluster.name if key == tuple((g.kind, g.num_nodes, g.devices_per_node)
                                                    for g in cluster.groups) else \
                    f"{cluster.name}[{'+'.join(f'{g.num_nodes}x{g.kind}' for g in groups)}]"
                out.append(replace(cluster, name=name, groups=groups,
                                   kinds={k: v for k, v in cluster.kinds.items() if k in subset}))
    return out


def plan_for_cost(*, cluster: Cluster, model: ModelSpec, config: PlannerConfig,
                  profiles: ProfileSet | None = None, host: object | None = None) -> CostPlan:
    """The best plan under `config.objective`, `config.budget_per_hour` and `config.min_tokens_per_s`,
    over sub-fleets of `cluster`; the throughput plan on the whole cluster comes with it."""
    for k in cluster.kind_names:
        kind_price(cluster, k)  # every kind needs a price before any search
    plain = replace(config, objective="throughput", budget_per_hour=None, min_tokens_per_s=None)
    full = costed(make_plan(cluster=cluster, model=model, config=plain, profiles=profiles, host=host), cluster)
    # Sub-fleets are screened without the predictor-driven polish (a few % at most); the winner is
    # planned again with it.
    screen = replace(plain, polish=False)
    best: tuple[Costed, Cluster] | None = None
    fleets = sub_fleets(cluster)
    for fleet in fleets:
        if fleet.name == cluster.name:
            cand = full
        else:
            try:
                cand = costed(make_plan(cluster=fleet, model=model, config=screen, profiles=profiles, host=host),
                              cluster)
            except InfeasibleError:
                continue
        if not cand.meets(budget_per_hour=config.budget_per_hour, min_tokens_per_s=config.min_tokens_per_s):
            continue
        if best is None or _better(cand, best[0], objective=config.objective):
            best = (cand, fleet)
    if best is None:
        raise InfeasibleError(_why_none(full, config))
    chosen, fleet = best
    if chosen is not full:
        polished = costed(make_plan(cluster=fleet, model=model, config=plain, profiles=profiles, host=host), cluster)
        if polished.meets(budget_per_hour=config.budget_per_hour, min_tokens_per_s=config.min_tokens_per_s) and \
                not _better(chosen, polished, objective=config.objective):
            chosen = polished
    return CostPlan(chosen=chosen, throughput=full, considered=len(fleets))


def _better(a: Costed, b: Costed, *, objective: str) -> bool:
    if objective == "cost":
        return (a.usd_per_million_tokens, -a.tokens_per_s) < (b.usd_per_million_tokens, -b.tokens_per_s)
    return (a.tokens_per_s, -a.price_per_hour) > (b.tokens_per_s, -b.price_per_hour)


def _why_none(full: Costed, config: PlannerConfig) -> str:
    parts = []
    if config.budget_per_hour is not None:
        parts.append(f"a budget of ${config.budget_per_hour:,.2f}/h")
    if config.min_tokens_per_s is not None:
        parts.append(f"at least {config.min_tokens_per_s:,.0f} tokens/s")
    return (f"no sub-fleet of the cluster meets {' and '.join(parts)} (the whole cluster's throughput plan: "
            f"{full.tokens_per_s:,.0f} tokens/s for ${full.price_per_hour:,.2f}/h). Fix: raise "
            "--budget-per-hour or lower --min-tokens-per-s.")
