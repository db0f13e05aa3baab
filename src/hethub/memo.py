"""A bounded memo for pure results shared between calls: the planner predicts and checks hundreds
of plans of one job, and the predictor keeps what those share (stage memory, simulations, sync
shapes, hops and sync groups: :mod:`hethub.predict.plan_costs`, :mod:`hethub.predict.sync`; the
memory model's per-shape terms: :mod:`hethub.predict.memory.model`). A top-level module so that the
memory model, below the predictor's package, can use it too.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

# Every memo, so that a caller comparing cold costs (bench/predict_speed.py) can empty them all.
_ALL: weakref.WeakSet[Kept] = weakref.WeakSet()


def clear_all() -> None:
    """Empty every memo (they hold only pure results: nothing but the time to recompute is lost)."""
    for kept in list(_ALL):
        kept.clear()


class Kept:
    """A memo emptied whole when it reaches ``limit`` entries: bounded memory without
    LRU bookkeeping. Keys may hold ids of objects passed as ``pin``: they are kept alive until the
    memo is emptied, so no id is reused while an entry names it."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.entries: dict[tuple, Any] = {}
        self.pins: dict[int, object] = {}
        _ALL.add(self)

    def clear(self) -> None:
        self.entries.clear()
        self.pins.clear()

    def get(self, key: tuple, make: Callable[[], Any], *, pin: tuple[object, ...] = ()) -> Any:
        hit = self.entries.get(key)
        if hit is None:
            if len(self.entries) >= self.limit:
                self.clear()
            self.pins.update((id(o), o) for o in pin)
            hit = self.entries[key] = make()
        return hit
