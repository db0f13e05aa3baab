"""Automatic planner: searches the heterogeneous plan space (no torch); see docs/planner.md."""

from hethub.search.config import STRATEGIES, PlannerConfig
from hethub.search.planner import PlanResult, make_plan, upper_bound

__all__ = ["STRATEGIES", "PlanResult", "PlannerConfig", "make_plan", "upper_bound"]
