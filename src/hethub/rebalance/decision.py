"""One re-balancing change: new micro-batch counts per pipeline, and at most one layer moved between
adjacent stages. Applied to a plan here (pure); the runtime applies it to the ranks
(``hethub.runtime.rebalance``), after one rank decided it and every rank received it as integers."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from hethub.plan import Plan

SHARES, MOVE = 1, 2  # the first integer of an encoded decision (0: no change)


@dataclass(frozen=True)
class LayerMove:
    """Stage ``src`` of pipeline ``pipeline`` hands one layer to the adjacent stage ``dst``: its last
    layer when ``dst`` follows it, its first when ``dst`` precedes it."""

    pipeline: int
    src: int
    dst: int

    def layer(self, plan: Plan) -> int:
        a, b = plan.pipelines[self.pipeline].stages[self.src].layers
        return b - 1 if self.dst > self.src else a

    def describe(self, plan: Plan) -> str:
        return (f"layer {self.layer(plan)} of pipeline {self.pipeline} from stage {self.src} to stage {self.dst}")


@dataclass(frozen=True)
class Decision:
    counts: tuple[int, ...]  # micro-batches of each pipeline from the next step on
    move: LayerMove | None = None
    reason: str = ""  # why (the log rank's wording; not sent to the other ranks)
    step_s: float = 0.0  # the predicted step before and after the change (log rank only)
    new_step_s: float = 0.0

    @property
    def gain(self) -> float:
        """Predicted fraction of the step time saved."""
        return 1.0 - self.new_step_s / self.step_s if self.step_s > 0 else 0.0

    def apply(self, plan: Plan) -> Plan:
        """``plan`` with the new counts and the moved layer, validated."""
        pipes = [replace(p, num_micro_batches=m) for p, m in zip(plan.pipelines, self.counts, strict=True)]
        if self.move is not None:
            mv = self.move
            p = pipes[mv.pipeline]
            stages = list(p.stages)
            a, b = stages[mv.src].layers
            c, d = stages[mv.dst].layers
            if mv.dst == mv.src + 1:
                stages[mv.src], stages[mv.dst] = replace(stages[mv.src], layers=(a, b - 1)), \
                    replace(stages[mv.dst], layers=(c - 1, d))
            else:
                stages[mv.src], stages[mv.dst] = replace(stages[mv.src], layers=(a + 1, b)), \
                    replace(stages[mv.dst], layers=(c, d + 1))
            pipes[mv.pipeline] = replace(p, stages=tuple(stages))
        return replace(plan, pipelines=tuple(pipes)).validate()

    def encode(self) -> list[int]:
        """The integers every rank needs: kind, counts, (pipeline, src, dst) of the move or -1s."""
        mv = self.move
        return [MOVE if mv else SHARES, *self.counts, *((mv.pipeline, mv.src, mv.dst) if mv else (-1, -1, -1))]

    @staticmethod
    def encoded_len(num_pipelines: int) -> int:
        return 1 + num_pipelines + 3

    @staticmethod
    def decode(values: Sequence[int]) -> Decision | None:
        vals = [int(v) for v in values]
        if vals[0] == 0:
            return None
        counts, tail = tuple(vals[1:-3]), vals[-3:]
        return Decision(counts=counts, move=LayerMove(*tail) if vals[0] == MOVE else None)

    def to_record(self, plan: Plan) -> dict[str, Any]:
        """What the metrics and the log keep of it (``plan``: the plan it was applied to)."""
        out: dict[str, Any] = {"shares": list(self.counts), "reason": self.reason,
                               "predicted_step_s": round(self.step_s, 6),
                               "predicted_new_step_s": round(self.new_step_s, 6), "predicted_gain": round(self.gain, 4)}
        if self.move is not None:
            out["move"] = {"pipeline": self.move.pipeline, "src": self.move.src, "dst": self.move.dst,
                           "layer": self.move.layer(plan)}
        return out


def _balance_free(plan: Plan) -> dict[str, Any]:
    d = plan.to_dict()
    d.pop("meta", None)
    for p in d["pipelines"]:
        p.pop("num_micro_batches")
        for s in p["stages"]:
            s.pop("layers", None)
            s["chunks"] = len(s.pop("chunks", [None]))
    return d


def rebalanced_of(candidate: Plan, base: Plan) -> bool:
    """Whether ``candidate`` is ``base`` after re-balancing: the same in everything but the pipelines'
    micro-batch counts and the stages' layer ranges (so a checkpoint saved under it resumes under it)."""
    return _balance_free(candidate) == _balance_free(base)


def shares_of(plan: Plan) -> list[int]:
    return [p.num_micro_batches for p in plan.pipelines]


def stage_layers_of(plan: Plan) -> list[list[int]]:
    return [[s.num_layers for s in p.stages] for p in plan.pipelines]
