"""One part of a search computed in a forked child process while the parent computes another.

The planner's two searches (each kind alone for the bound, the mixed search) share nothing but
caches of pure functions (templates.Books), so either can run in its own process and give the same
values: a fork inherits the cluster, model, profiles and host objects as they are, and only the
result travels back, pickled over a pipe. Where the child cannot answer (it was killed, or its
result does not pickle), the parent computes the part itself, so a child never costs a result.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import pickle
import signal
from collections.abc import Callable
from types import TracebackType
from typing import Generic, TypeVar

T = TypeVar("T")

FORK_AVAILABLE = "fork" in multiprocessing.get_all_start_methods()


class Forked(Generic[T]):
    """``fn()`` computed in a forked child; `result` returns its value or raises its exception.

    Use it as a context manager: leaving the block without asking for the result (the parent's own
    work failed) kills and reaps the child, so no process outlives the block. Only one thread of
    the parent is copied into the child, which runs ``fn`` alone and leaves by ``os._exit`` (no
    atexit handlers, no flush of buffers it inherited from the parent).
    """

    def __init__(self, fn: Callable[[], T]) -> None:
        self._fn = fn
        self._answer: tuple[str, object] | None = None
        read_fd, write_fd = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child
            code = 1
            try:
                os.close(read_fd)
                try:
                    answer: tuple[str, object] = ("value", fn())
                except BaseException as err:  # any: the parent re-raises it
                    answer = ("error", err)
                data = pickle.dumps(answer, protocol=pickle.HIGHEST_PROTOCOL)
                with os.fdopen(write_fd, "wb") as pipe:
                    pipe.write(data)
                code = 0
            finally:
                os._exit(code)  # an unpicklable answer exits 1 with nothing sent: the parent computes it
        os.close(write_fd)
        self._pid: int | None = pid  # None once reaped
        self.exit_status: int | None = None  # the child's wait status (os.waitpid) once reaped
        self._read_fd: int | None = read_fd  # None once handed to a file object, which closes it

    def result(self) -> T:
        """The child's value (waiting for it), its exception re-raised, or ``fn()`` computed here if
        the child died without answering."""
        if self._answer is None:
            self._answer = self._collect()
        kind, value = self._answer
        if kind == "error":
            raise value  # type: ignore[misc]
        return value  # type: ignore[return-value]

    def _collect(self) -> tuple[str, object]:
        fd, self._read_fd = self._read_fd, None
        assert fd is not None
        try:
            with os.fdopen(fd, "rb") as pipe:  # EOF once the child has exited, however it did
                data = pipe.read()
        finally:
            status = self._reap()
        if status == 0 and data:
            with contextlib.suppress(Exception):  # a class the parent cannot unpickle: compute it here
                answer = pickle.loads(data)
                if isinstance(answer, tuple) and len(answer) == 2 and answer[0] in ("value", "error"):
                    return answer
        try:
            return "value", self._fn()
        except Exception as err:  # raised by result(), as a child's would be
            return "error", err

    def _reap(self) -> int:
        if self._pid is None:
            return -1
        _, self.exit_status = os.waitpid(self._pid, 0)
        self._pid = None
        return self.exit_status

    def __enter__(self) -> Forked[T]:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._pid is not None:  # the result was never asked for: stop the child and reap it
            with contextlib.suppress(ProcessLookupError):
                os.kill(self._pid, signal.SIGKILL)
            self._reap()
        if self._read_fd is not None:
            os.close(self._read_fd)
            self._read_fd = None
