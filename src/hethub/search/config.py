"""What the planner is asked for: the training job, the strategy and how wide to search."""

from __future__ import annotations

from dataclasses import dataclass

from hethub.errors import SpecError
from hethub.plan import OPTIMIZER_SHARES, PLANNED_SHARDINGS
from hethub.predict.memory import DEFAULT_MEM_HEADROOM
from hethub.runtimes import DEFAULT_RUNTIME, RUNTIMES, planner_error
from hethub.schedules import AUTO_SCHEDULE, DEFAULT_SCHEDULE, SCHEDULES
from hethub.spec.model import PRECISIONS

STRATEGIES = ("hethub", "uniform", "flops-proportional", "homogeneous")
OBJECTIVES = ("throughput", "cost")
TP_DEGREES = (1, 2, 4, 8)  # the TP degrees searched unless the config narrows them


@dataclass(frozen=True)
class PlannerConfig:
    global_batch: int  # sequences per optimizer step
    seq_len: int
    strategy: str = "hethub"
    schedule: str = DEFAULT_SCHEDULE
    precision: str = "bf16-mixed"
    top_k: int = 1
    # Micro-batch sizes tried (each must divide the global batch to be used).
    micro_batch_sizes: tuple[int, ...] = (1, 2, 4, 8)
    # TP degrees tried; a kind only uses those that divide its node size and the model's dimensions.
    tp_degrees: tuple[int, ...] = TP_DEGREES
    allow_recompute: bool = True
    sequence_parallel: bool = True  # offered on TP > 1 stages, a stage mode beside recomputation
    context_parallel: bool = True  # the best plans' replicas fused into CP 2 / 4 where a stage recomputes fully
    # How many closed-form finalists the full predictor re-scores; more is slower and rarely better.
    finalists: int = 6
    # Besides them, the best of each micro-batch size (and of the plans mixing sizes): the closed form
    # ranks sizes with errors of their own, so the predictor decides between sizes (hetero.Results).
    # None: finalists + top_k per size, so allowing more sizes never loses the plan one size gives;
    # 0: none beyond the overall ones (faster, but more sizes can then give a worse plan).
    finalists_per_size: int | None = None
    # Cost-aware planning (commands/cost_plan.py): most tokens/s, or fewest dollars per token; both within
    # the budget (dollars per hour of the devices used) and above the throughput floor, if given.
    objective: str = "throughput"
    # The predictor-driven local search after the closed-form search (planner.py); cost planning
    # screens sub-fleets without it and polishes only the winner.
    polish: bool = True
    budget_per_hour: float | None = None
    min_tokens_per_s: float | None = None
    # Share of each device's memory plans leave free (predict/memory/capacity.py says why 0.1).
    mem_headroom: float = DEFAULT_MEM_HEADROOM
    # Optimizer sharding (plan.py's training.optimizer_sharding: ZeRO-1, 2 or 3), or "auto": plan with
    # each and keep the faster predicted (search/variants.py).
    optimizer_sharding: str = "none"
    optimizer_shares: str = "proportional"
    # Holders each parameter group is assumed to have when the search checks a sharded stage's memory
    # (its replicas are not chosen yet); the predictor re-scores each finalist with its real ones.
    shard_holders: int = 1
    # Model chunks per stage the search sizes stages and prices pipelines for (the interleaved
    # schedule's v; the planner sets it while choosing v, predict/interleave.py).
    virtual_stages: int = 1
    runtime: str = DEFAULT_RUNTIME  # hethub.runtimes: the search keeps to what it runs, priced by its rules

    def __post_init__(self) -> None:
        def bad(field: str, problem: str, fix: str) -> SpecError:
            return SpecError(f"planner option '{field}' {problem}. Fix: {fix}.")

        for name in ("global_batch", "seq_len", "top_k", "finalists", "virtual_stages"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise bad(name, f"must be a positive integer, got {v!r}", "give a positive integer")
        v = self.finalists_per_size
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
            raise bad("finalists_per_size", f"must be a non-negative integer or None, got {v!r}",
                      "give e.g. 2, 0 for none, or leave it out (finalists + top_k)")
        for name, choices in (("strategy", STRATEGIES), ("precision", PRECISIONS),
                              ("optimizer_shares", OPTIMIZER_SHARES), ("objective", OBJECTIVES)):
            if getattr(self, name) not in choices:
                raise bad(name, f"is {getattr(self, name)!r}", f"use one of {', '.join(choices)}")
        if self.schedule not in (*SCHEDULES, AUTO_SCHEDULE):
            raise bad("schedule", f"is {self.schedule!r}", f"use one of {', '.join(SCHEDULES)} or {AUTO_SCHEDULE}")
        if (isinstance(self.mem_headroom, bool) or not isinstance(self.mem_headroom, (int, float))
                or not 0 <= self.mem_headroom < 1):
            raise bad("mem_headroom", f"must be a fraction in [0, 1), got {self.mem_headroom!r}",
                      "give e.g. 0.1 to keep 10% of each device's memory free")
        for name in ("micro_batch_sizes", "tp_degrees"):
            vals = getattr(self, name)
            if not vals or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in vals):
                raise bad(name, f"must be a non-empty tuple of positive integers, got {vals!r}",
                          "give e.g. (1, 2, 4)")
        if self.optimizer_sharding not in (*PLANNED_SHARDINGS, "auto"):
            raise bad("optimizer_sharding", f"is {self.optimizer_sharding!r}",
                      f"use one of {', '.join(PLANNED_SHARDINGS)} or auto")
        if self.optimizer_sharding == "zero3" and self.schedule == "interleaved":
            raise bad("optimizer_sharding", "is zero3, which runs no virtual stages", "use zero2 or auto with it")
        for name in ("budget_per_hour", "min_tokens_per_s"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int | float) or not v > 0):
                raise bad(name, f"must be a positive number, got {v!r}", "give a positive number or leave it out")
        if (why := planner_error(self.runtime, schedule=self.schedule, sharding=self.optimizer_sharding)):
            raise SpecError(why)
        if not RUNTIMES[self.runtime].stage_recompute:  # it plans no recomputation (runtimes.py says why)
            object.__setattr__(self, "allow_recompute", False)
        if any(t & (t - 1) for t in self.tp_degrees):
            # Powers of two pack into nodes without fragmentation (see docs/planner.md, "devices").
            raise bad("tp_degrees", f"must be powers of two, got {self.tp_degrees!r}", "use 1, 2, 4, 8, ...")

    @property
    def equal_shares(self) -> bool:  # every replica the same micro-batches (hethub.runtimes: unequal_shares)
        return not RUNTIMES[self.runtime].unequal_shares

    @property
    def cost_aware(self) -> bool:
        """Whether the plan needs prices: a cost objective, a budget or a throughput floor."""
        return self.objective == "cost" or self.budget_per_hour is not None or self.min_tokens_per_s is not None

    @property
    def per_size_finalists(self) -> int:
        """Finalists kept per micro-batch size (`finalists_per_size`, None read as finalists + top_k)."""
        return self.finalists + self.top_k if self.finalists_per_size is None else self.finalists_per_size

    @property
    def usable_micro_batch_sizes(self) -> tuple[int, ...]:
        return tuple(sorted({b for b in self.micro_batch_sizes if self.global_batch % b == 0}))
