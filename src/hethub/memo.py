"""The one seam between the predictor's rules and the shortcuts that evaluate them at scale.

The rules (the memory model, the point-to-point buffer replay, the ZeRO split, the sync groups,
the pipeline simulation) are written once, plainly. Where the planner asks them thousands of times,
a shortcut gives the same numbers for less work: a bounded memo of pure results shared between
calls (``Kept``: stage memory, simulations, sync shapes, hops and sync groups in
:mod:`hethub.predict.plan_costs` and :mod:`hethub.predict.sync`, the memory model's per-shape terms),
or an equivalent form proved equal to its rule by an exhaustive test (the buffer peak's counts,
:mod:`hethub.predict.memory.p2p`). A shortcut of the second sort asks ``reference()`` and takes the
plain rule where it says so: that is how ``tests/unit/test_predict_fastpath.py`` compares whole
predictions and how ``bench/predict_speed.py`` times both in one process (docs/predictor.md, "Cost
at scale"). A top-level module so that the memory model, below the predictor's package, can use it.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
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
    memo is emptied, so no id is reused while an entry names it. ``shortcut``: a memo the plain
    rules did without, bypassed on the reference path (module doc)."""

    def __init__(self, limit: int, *, shortcut: bool = False) -> None:
        self.limit, self.shortcut = limit, shortcut
        self.entries: dict[tuple, Any] = {}
        self.pins: dict[int, object] = {}
        _ALL.add(self)

    def clear(self) -> None:
        self.entries.clear()
        self.pins.clear()

    def get(self, key: tuple, make: Callable[[], Any], *, pin: tuple[object, ...] = ()) -> Any:
        if self.shortcut and _REFERENCE[0]:
            return make()
        hit = self.entries.get(key)
        if hit is None:
            if len(self.entries) >= self.limit:
                self.clear()
            self.pins.update((id(o), o) for o in pin)
            hit = self.entries[key] = make()
        return hit


_REFERENCE = [False]  # one flag for the process; only tests and benchmarks set it
_LRU: list[Callable[[], None]] = []


def reference() -> bool:
    """Whether predictions take the plain rules instead of their shortcuts."""
    return _REFERENCE[0]


@contextmanager
def reference_path() -> Iterator[None]:
    """Within this block, every prediction takes the plain rules (memos emptied on entry and exit, so
    no shortcut's result is served inside and no reference result outside)."""
    before = _REFERENCE[0]
    clear_caches()
    _REFERENCE[0] = True
    try:
        yield
    finally:
        _REFERENCE[0] = before
        clear_caches()


def kept_lru(maxsize: int) -> Callable:
    """``functools.lru_cache(maxsize)`` that ``clear_caches`` empties too."""
    def wrap(fn: Callable) -> Callable:
        cached = functools.lru_cache(maxsize=maxsize)(fn)
        _LRU.append(cached.cache_clear)
        return cached
    return wrap


def clear_caches() -> None:
    """Empty every memo (a cold start: what a new job's first prediction pays)."""
    clear_all()
    for clear in _LRU:
        clear()
