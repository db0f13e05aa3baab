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
at scale"). A lazy order (``Ranked``: the planner's variants check each shape's memory only where
the finalists read that far, `search/variants.repriced`) is of the second sort, proved by
``tests/unit/test_lazy_reprice.py``; so are the enumeration's fit checks, run only where a decision
reads them (``Later``, ``Places``: `search/hetero.Results`), proved by
``tests/unit/test_enumeration_fastpath.py``; and the template scan's bounds tightened only as far as an
order reads them (``Tiers``: `search/templates.Searcher.top_above`), proved by ``tests/unit/test_size_bounds.py``.
Memos live for one search (``search_scope``, which ``make_plan`` opens). A top-level module so that the memory
model, below the predictor's package, can use it.
"""

from __future__ import annotations

import bisect
import functools
import gc
import heapq
import itertools
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Generic, TypeVar

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


class Later:
    """A pure check run when its answer is first read (``value``), so that a search never runs the
    checks no decision of its reads; on the reference path at once, where it was made."""

    __slots__ = ("_check", "_value")

    def __init__(self, check: Callable[[], bool]) -> None:
        self._check: Callable[[], bool] | None = check
        self._value: bool | None = None
        if _REFERENCE[0]:
            self.value  # noqa: B018 (run now)

    def peek(self) -> bool | None:
        """The answer if it was read already, else None (nothing is run)."""
        return self._value

    @property
    def value(self) -> bool:
        if self._value is None:
            self._value, self._check = bool(self._check()), None
        return self._value


class Places:
    """The best ``n`` (value, key) entries, lowest value first, of those whose checks (``Later``; None:
    passed) pass, as a list kept sorted and cut after n sure ones would hold them: a check runs only
    where an answer (`enters`, `holds`) depends on it, and one that fails leaves its entry's place
    to the next. On the reference path every check ran when its entry came: the plain top-n list."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.entries: list[tuple[float, Any, Later | None]] = []  # sorted by value, ties in arrival order

    def enters(self, value: float, *, margin: float = 1.0) -> bool:
        """Whether ``value`` would enter: fewer than n passing entries have value x margin at most it."""
        sure, unsure = 0, []
        for v, _, check in self.entries:
            if v * margin > value:
                break
            seen = True if check is None else check.peek()
            sure += seen is True
            if seen is None:
                unsure.append(check)
        for i, check in enumerate(unsure):  # best first, until they settle the answer
            if sure >= self.n or sure + len(unsure) - i < self.n:
                break
            sure += check.value
        return sure < self.n

    def holds(self, key: Any) -> bool:
        """Whether ``key`` is among the best n passing entries."""
        if all(k != key for _, k, _ in self.entries):
            return False
        passing = (k for _, k, check in self.entries if check is None or check.value)
        return key in itertools.islice(passing, self.n)

    def insert(self, value: float, key: Any, check: Later | None) -> None:
        bisect.insort(self.entries, (value, key, check), key=lambda e: e[0])
        self.entries = [e for e in self.entries if e[2] is None or e[2].peek() is not False]
        sure = list(itertools.accumulate(e[2] is None or e[2].peek() is True for e in self.entries))
        del self.entries[bisect.bisect_left(sure, self.n) + 1:]  # after the n-th sure entry none can return


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


_SCOPES = [0]  # how many search scopes are open


@contextmanager
def search_scope() -> Iterator[None]:
    """One search's lifetime for every memo: the outermost scope empties them all as it ends (nested
    scopes keep them), so a process that plans job after job holds at most one search's entries,
    however large the last search was, and no job's entries outlive it (entries keyed by an object's
    id pin it: none is ever served to an object that reuses the id). Python's cyclic garbage
    collector is paused inside (restored after): a search's memos live until it returns, so the
    collector's passes over them free nothing, and a search leaves no reference cycles
    (mixed.Family holds its searcher weakly) for reference counting to miss."""
    outermost, collecting = _SCOPES[0] == 0, gc.isenabled()
    _SCOPES[0] += 1
    gc.disable()
    try:
        yield
    finally:
        _SCOPES[0] -= 1
        if outermost:
            clear_caches()
        if collecting:
            gc.enable()


T = TypeVar("T")


class Tiers(Generic[T]):
    """Items by upper bounds, largest first, each bound read at its loosest tier first and the next tighter one
    only while it is the largest left: ``bound(item, tier)``, tiers from ``loosest`` down to 0 (the bound itself),
    each at least the next. The largest bounds are so found without reading the others' tighter ones; kept by
    its reader, a later question goes on from where the last one stopped. The reader passes ``bound`` with each
    question, so a kept order holds no reference back to it (no reference cycle: `search_scope`)."""

    def __init__(self, items: list[T], bound: Callable[[T, int], float], *, loosest: int) -> None:
        self.heap = [(-bound(x, loosest), i, loosest, x) for i, x in enumerate(items)]
        heapq.heapify(self.heap)

    def _tighten(self, bound: Callable[[T, int], float]) -> None:
        """The largest bound left (a loose one) replaced by its item's next tighter one."""
        _, i, tier, x = self.heap[0]
        heapq.heapreplace(self.heap, (-bound(x, tier - 1), i, tier - 1, x))

    def top(self, *, above: float, bound: Callable[[T, int], float]) -> tuple[float, bool]:
        """The largest bound left, its loose ones tightened while one at least ``above`` is the largest, and
        whether it is the bound itself (0.0, True where none is left)."""
        while self.heap and self.heap[0][2] > 0 and -self.heap[0][0] >= above:
            self._tighten(bound)
        return (-self.heap[0][0], self.heap[0][2] == 0) if self.heap else (0.0, True)

    def pop(self, stop: Callable[[float], bool], *, bound: Callable[[T, int], float]) -> tuple[float, T] | None:
        """The item of the largest bound and its bound, taken out, its loose bounds (and others') tightened
        until that one is the bound itself; None where ``stop`` holds for the largest bound left first (asked
        after each bound read)."""
        while self.heap and not stop(-self.heap[0][0]):
            if self.heap[0][2] == 0:
                upper, _, _, x = heapq.heappop(self.heap)
                return -upper, x
            self._tighten(bound)
        return None


class Ranked(Generic[T]):
    """Groups of alternatives, each group standing for its first alternative, by ``key`` (ties: the
    given order), that passes ``check``; the groups that have one in that alternative's key order
    (ties: group order): a stable sort of the groups' passing choices. ``check`` is the expensive
    part, so an alternative is checked only when the order is read up to it (a heap of each group's
    next alternative: one whose key is the least left is at or before its group's choice). On the
    reference path every alternative is checked and the choices sorted, the plain rule."""

    def __init__(self, options: list[list[T]], *, key: Callable[[T], float],
                 check: Callable[[T], bool] | None = None) -> None:
        self.options = [sorted(o, key=key) for o in options]
        self.key, self.check = key, check
        self.passed: dict[tuple[int, int], bool] = {}
        self.order: list[tuple[int, T]] = []  # the order's first groups: (group, its choice)
        self.heap = [(key(o[0]), i, 0) for i, o in enumerate(self.options) if o]
        heapq.heapify(self.heap)
        self.lead, self.moved = 0, []  # `promote`'s
        if _REFERENCE[0]:
            every = [(i, [x for j, x in enumerate(o) if self._passes(i, j)]) for i, o in enumerate(self.options)]
            self.order = sorted(((i, ok[0]) for i, ok in every if ok), key=lambda x: key(x[1]))
            self.heap = []

    def _passes(self, i: int, j: int) -> bool:
        if (i, j) not in self.passed:
            self.passed[i, j] = self.check is None or self.check(self.options[i][j])
        return self.passed[i, j]

    def _at(self, n: int, wanted: Callable[[T], bool]) -> tuple[int, T] | None:
        """The order's ``n``-th group and choice, None past its end. A group whose next alternative
        ``wanted`` refuses is dropped unchecked: the reader promises it refuses all of that group's
        alternatives, now and later."""
        while len(self.order) <= n and self.heap:
            _, i, j = self.heap[0]
            if not wanted(self.options[i][j]):
                heapq.heappop(self.heap)
            elif self._passes(i, j):
                heapq.heappop(self.heap)
                self.order.append((i, self.options[i][j]))
            elif j + 1 < len(self.options[i]):
                heapq.heapreplace(self.heap, (self.key(self.options[i][j + 1]), i, j + 1))
            else:
                heapq.heappop(self.heap)
        return self.order[n] if n < len(self.order) else None

    def first(self, n: int) -> list[T]:
        """The order's first ``n`` choices (checked up to them)."""
        if n > 0:
            self._at(n - 1, lambda _: True)
        return [x for _, x in self.order[:n]]

    def choice(self, i: int) -> T | None:
        """Group ``i``'s choice, checking only its own alternatives."""
        return next((x for j, x in enumerate(self.options[i]) if self._passes(i, j)), None)

    def promote(self, lead: int, groups: range) -> int:
        """Read the first ``lead`` groups, then those of ``groups`` after them (in the order), then
        the rest; returns how many moved."""
        ahead = {i for i, _ in self.order[:len(self.first(lead))]}
        moved = [(i, x) for i in groups[:len(self.options)] if i not in ahead and (x := self.choice(i)) is not None]
        self.lead, self.moved = lead, sorted(moved, key=lambda m: self.key(m[1]))
        return len(moved)

    def read(self, wanted: Callable[[T], bool] = lambda _: True) -> Iterator[T]:
        """The choices in order (`promote`'s), those of groups ``wanted`` refuses possibly left out
        (`_at`): for one reader, whose refusals stand."""
        moved = {i for i, _ in self.moved}
        yield from (x for _, x in self.order[:self.lead])
        yield from (x for _, x in self.moved)
        n = self.lead
        while (got := self._at(n, wanted)) is not None:
            n += 1
            if got[0] not in moved:
                yield got[1]
