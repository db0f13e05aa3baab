"""The one seam through which a search uses more than one core: independent tasks run in forked
worker processes, their results handed back in task order, exactly as a serial run returns them.

``fan_out(tasks)`` runs ``tasks`` (callables taking no argument) on up to `workers()` processes: this
one and forked children, each claiming the next task from a shared queue (dynamic dispatch, so three
tasks on two workers balance; ``order`` puts the longest first). This process claims ``order``'s first
task before it forks, so what that task adds to the memos outlives the fan-out. A child pickles its results and
exceptions back; the parent re-raises the exception of the lowest-numbered failed task (a serial run's
first), its type kept, the child's traceback added as a note. Children are killed and reaped
whatever happens in the parent (an exception, KeyboardInterrupt), so none outlives a call; on Linux
a child also dies with a parent killed outright (``PR_SET_PDEATHSIG``).

Why a result cannot depend on the worker count or the machine's load: a task is a pure function of
what existed at the fork (the search's inputs and its pure memos, `hethub.memo`), so it computes the
same value in any process, and the values come back in task order. What a child adds to the memos
dies with it: the parent recomputes what it later asks of them (the same values, for time only). They
are not handed back because few are asked again: what two workers redo is mostly what tasks side by
side each build (the stage models and their solves that a serial run shares), not a later fan-out's.
Objects named by ``sharing`` (the job's cluster, model, profiles) cross as references, not copies, so
a result's plans hold the parent's own objects; the pickler finds them by ``reducer_override``, which
pickle does not ask of numbers, strings and plain containers (most of a result), so those are refused.

Serial, in this process and in task order (the plain path, `reference_path` or not): with one
worker (``HETHUB_PLAN_WORKERS=1``), one task, no ``os.fork``, inside a worker (no nested forks) and
whenever another thread is alive (forking beside a live thread, gloo's or a test runner's, can
deadlock the child on a lock that thread held). ``done(i, result)`` is called in the parent only,
in completion order (progress bars).
"""

from __future__ import annotations

import contextlib
import ctypes
import io
import os
import pickle
import signal
import struct
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

from hethub.errors import field_error

T = TypeVar("T")
ENV = "HETHUB_PLAN_WORKERS"
_IN_WORKER = [False]  # in a forked child (its own fan-outs run serially) or within `serial`
_SHARED: list[object] = []  # `sharing`'s objects
_TIMED: list[list[tuple[float, list[float]]]] = []  # `timed`'s records
_INDEX = struct.Struct("<i")
_QUEUE_BYTES = 65536  # a Linux pipe's default capacity
# Types pickle never asks `_Pickler.reducer_override` about (`sharing` refuses them).
_PLAIN = (bool, int, float, str, bytes, bytearray, tuple, list, dict, set, frozenset)


def workers() -> int:
    """Processes a fan-out may use: ``HETHUB_PLAN_WORKERS`` where set, else the CPUs this process may run on."""
    raw = os.environ.get(ENV, "").strip()
    if raw:
        if not raw.isdigit() or int(raw) < 1:
            raise field_error("environment", ENV, f"must be a positive integer, got {raw!r}",
                              f"set {ENV}=1 for a serial search, or unset it to use every CPU")
        return int(raw)
    affinity = getattr(os, "sched_getaffinity", None)
    return len(affinity(0)) if affinity else os.cpu_count() or 1


def forks(n_tasks: int) -> int:
    """How many children `fan_out` would fork for ``n_tasks`` tasks now (0: it runs them serially)."""
    if _IN_WORKER[0] or not hasattr(os, "fork") or threading.active_count() > 1:
        return 0
    return max(0, min(workers(), n_tasks) - 1)


@contextlib.contextmanager
def sharing(*objects: object) -> Iterator[None]:
    """Within it, a fan-out's results that hold ``objects`` (a job's cluster, model, profiles) hold this
    process's own, not copies: they cross as references (nested blocks add theirs). Objects of their own
    classes (not numbers, strings, bytes or plain containers, which results hold by the thousand)."""
    plain = [o for o in objects if o is not None and type(o) in _PLAIN]  # None is one object everywhere
    if plain:
        raise TypeError(f"fanout.sharing: {type(plain[0]).__name__} objects cross by value; share an object of "
                        "its own class (wrap the value in one)")
    n = len(_SHARED)
    _SHARED.extend(objects)
    try:
        yield
    finally:
        del _SHARED[n:]


@contextlib.contextmanager
def serial() -> Iterator[None]:
    """Within it, every fan-out runs serially in this process (a training rank's re-planning: torch's
    native threads are invisible to `threading`)."""
    before = _IN_WORKER[0]
    _IN_WORKER[0] = True
    try:
        yield
    finally:
        _IN_WORKER[0] = before


@contextlib.contextmanager
def timed() -> Iterator[list[tuple[float, list[float]]]]:
    """Within it, each forked fan-out appends (this process's CPU s in it, each child's CPU s), so a
    benchmark can give the critical path: the serial rest plus each fan-out's busiest worker."""
    got: list[tuple[float, list[float]]] = []
    _TIMED.append(got)
    try:
        yield got
    finally:
        _TIMED.remove(got)


def fan_out(tasks: Sequence[Callable[[], T]], *, order: Sequence[int] | None = None,
            done: Callable[[int, T], None] | None = None) -> list[T]:
    """``[task() for task in tasks]``, the tasks spread over forked workers (module doc). ``order``:
    the task numbers in the order to start them (longest first balances best; default: as given);
    ``done``: called in this process as each result arrives."""
    order = list(range(len(tasks))) if order is None else list(order)
    if sorted(order) != list(range(len(tasks))):
        raise ValueError(f"fan_out: order {order} is not a permutation of the {len(tasks)} task numbers")
    children = forks(len(tasks))
    if children == 0:
        out = []
        for i, task in enumerate(tasks):
            out.append(task())
            if done is not None:
                done(i, out[-1])
        return out
    return _Pool(tasks, order=order, done=done, shared=list(_SHARED)).run(children)


class _Pool:
    """One parallel `fan_out`: a queue of task numbers, this process and ``children`` forked workers."""

    def __init__(self, tasks: Sequence[Callable[[], Any]], *, order: list[int],
                 done: Callable[[int, Any], None] | None, shared: list[object]) -> None:
        self.tasks, self.done, self.shared = tasks, done, shared
        self.results: dict[int, tuple[bool, Any]] = {}  # task -> (ok, value or exception)
        if len(order) * _INDEX.size > _QUEUE_BYTES:  # written whole before the first fork, never blocking
            raise ValueError(f"fan_out: {len(order)} tasks exceed the queue's {_QUEUE_BYTES // _INDEX.size}")
        self.queue_r, queue_w = os.pipe()
        with os.fdopen(queue_w, "wb") as w:  # closed before any fork: an empty queue reads as its end
            w.write(b"".join(_INDEX.pack(i) for i in order))

    def _claim(self) -> int | None:
        got = os.read(self.queue_r, _INDEX.size)  # one read of 4 bytes from a pipe is atomic
        return _INDEX.unpack(got)[0] if got else None

    def _work(self, record: Callable[[int, bool, Any], None], *, child: bool = False, first: int | None = None,
              ) -> None:
        while (i := first if first is not None else self._claim()) is not None:
            first = None
            try:
                value, ok = self.tasks[i](), True
            except Exception as e:  # re-raised by `run` once every task has run
                if child:  # the parent's traceback would end at its re-raise
                    e.add_note(f"in fan_out worker pid {os.getpid()}, task {i}:\n{traceback.format_exc()}")
                value, ok = e, False
            record(i, ok, value)

    def run(self, children: int) -> list[Any]:
        sys.stdout.flush()
        sys.stderr.flush()  # a child flushes its own output only, never the parent's
        start_s, self.child_s = time.process_time(), []
        pids: dict[int, int] = {}  # pid -> read end of its result pipe
        parent = os.getpid()
        first = self._claim()  # claimed before any fork: this process runs ``order``'s first task
        try:
            for _ in range(children):
                r, w = os.pipe()
                pid = os.fork()
                if pid == 0:  # pragma: no cover (a child; tests see its results)
                    os.close(r)
                    self._child(w, parent)
                os.close(w)
                pids[pid] = r
            with serial():  # this process is a worker too: fan-outs inside its tasks run in it
                self._work(self._record, first=first)
            while pids:
                pid, r = next(iter(pids.items()))
                self._collect(pid, r)
                del pids[pid]
                os.close(r)
        finally:
            for pid, r in pids.items():  # only on an error here: stop and reap the rest
                os.close(r)
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
                with contextlib.suppress(OSError):
                    os.waitpid(pid, 0)
            os.close(self.queue_r)
        for record in _TIMED:
            record.append((time.process_time() - start_s, self.child_s))
        failed = sorted(i for i, (ok, _) in self.results.items() if not ok)
        if failed:
            raise self.results[failed[0]][1]
        return [self.results[i][1] for i in range(len(self.tasks))]

    def _record(self, i: int, ok: bool, value: Any) -> None:
        self.results[i] = (ok, value)
        if ok and self.done is not None:
            self.done(i, value)

    def _child(self, w: int, parent: int) -> None:
        """A worker's life: claim tasks until the queue is empty, send every result, exit."""
        code = 1
        try:
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's: it kills its workers
            _die_with(parent)
            _IN_WORKER[0] = True
            got: list[tuple[int, bool, Any]] = []
            self._work(lambda i, ok, value: got.append((i, ok, value if ok else _portable(value))), child=True)
            try:  # one pickle: what results share stays shared
                data = self._dumps(got)
            except Exception:  # some result does not pickle: say which
                data = self._dumps([x if self._sendable(x) else (x[0], False, RuntimeError(
                    f"fan_out task {x[0]}: its result {x[2]!r:.200} does not pickle")) for x in got])
            with os.fdopen(w, "wb") as out:
                out.write(data)
            sys.stdout.flush()
            sys.stderr.flush()
            code = 0
        finally:
            os._exit(code)  # no exit handlers, no flush of buffers inherited from the parent

    def _dumps(self, got: list[tuple[int, bool, Any]]) -> bytes:
        buf = io.BytesIO()
        _Pickler(buf, {id(o): n for n, o in enumerate(self.shared)}).dump(got)
        return buf.getvalue()

    def _sendable(self, item: tuple[int, bool, Any]) -> bool:
        try:
            self._dumps([item])
        except Exception:
            return False
        return True

    def _collect(self, pid: int, r: int) -> None:
        with os.fdopen(r, "rb", closefd=False) as f:
            data = f.read()
        _, status, usage = os.wait4(pid, 0)
        self.child_s.append(usage.ru_utime + usage.ru_stime)
        for item in _Unpickler(io.BytesIO(data), self.shared).load() if data else ():
            self._record(*item)
        if status != 0:
            raise ChildProcessError(f"fan_out worker pid {pid} ended with status {status} "
                                    f"({os.waitstatus_to_exitcode(status)}); its tasks' results are lost")


def _portable(e: Exception) -> Exception:
    """``e`` if it survives pickling both ways (its type, message and notes cross), else a RuntimeError
    that names it."""
    try:
        pickle.loads(pickle.dumps(e))
    except Exception:
        out = RuntimeError(f"{type(e).__name__}: {e}")
        for note in getattr(e, "__notes__", []):
            out.add_note(note)
        return out
    return e


def _die_with(parent: int) -> None:
    """Have the kernel kill this process when its parent dies (Linux; elsewhere nothing is done)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (AttributeError, OSError):
        return
    if os.getppid() != parent:  # the parent died before the call
        os._exit(1)


def _shared(n: int) -> object:
    """What `_Pickler` writes for shared object ``n``; `_Unpickler` reads it as its own object ``n``."""
    raise RuntimeError("a fan_out result's shared object is read back by fanout._Unpickler only")


class _Pickler(pickle.Pickler):
    """Pickles the objects whose ids ``ids`` numbers as those numbers (`fan_out`'s ``shared``). Asked by
    ``reducer_override``, which pickle skips for numbers, strings and plain containers (a result is
    mostly those; ``persistent_id`` is asked of every object), so `sharing` takes objects of other types."""

    def __init__(self, file: io.BytesIO, ids: dict[int, int]) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.ids = ids

    def reducer_override(self, obj: object) -> Any:
        n = self.ids.get(id(obj))
        return NotImplemented if n is None else (_shared, (n,))


class _Unpickler(pickle.Unpickler):
    """Reads `_Pickler`'s numbers back as this process's own shared objects."""

    def __init__(self, file: io.BytesIO, shared: list[object]) -> None:
        super().__init__(file)
        self.shared = shared

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == (__name__, "_shared"):
            return self.shared.__getitem__
        return super().find_class(module, name)
