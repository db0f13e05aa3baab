"""The one seam between the predictor's rules and the shortcuts that evaluate them at scale.

The rules (the memory model, the point-to-point buffer replay, the ZeRO split, the sync groups,
the pipeline simulation) are written once, plainly. Where the planner asks them thousands of times,
a shortcut gives the same numbers for less work: a cache keyed on what a result depends on, or an
equivalent form proved equal to the rule by an exhaustive test. Each shortcut asks ``reference()``
and takes the plain rule where it says so, which is how the tests compare every shortcut with its
rule on whole predictions (``tests/unit/test_predict_fastpath.py``) and how
``bench/predict_speed.py`` times both in one process. Shortcuts live beside their rule and are
named in docs/predictor.md ("Cost at scale").
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from hethub.memo import clear_all

_REFERENCE = [False]  # one flag for the process; only tests and benchmarks set it
_LRU: list[Callable[[], None]] = []


def reference() -> bool:
    """Whether predictions take the plain rules instead of their shortcuts."""
    return _REFERENCE[0]


@contextmanager
def reference_path() -> Iterator[None]:
    """Within this block, every prediction takes the plain rules (caches emptied on entry and exit,
    so no shortcut's result is served inside and no reference result outside)."""
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
    """Empty every memo of the predictor (a cold start: what a new job's first prediction pays)."""
    clear_all()
    for clear in _LRU:
        clear()
