"""Parts of a search computed in a forked child process while the parent computes others.

The planner's searches (each kind alone for the bound, the mixed search and its template scans)
share nothing but caches of pure functions (templates.Books), so a part can run in another process
and give the same values: a fork inherits the cluster, model, profiles and host objects as they
are, and only the results travel back, pickled over a pipe. Where the child cannot answer (it was
killed, or a result does not pickle), the parent computes the part itself, so a child never costs
a result.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import pickle
import signal
from collections.abc import Callable
from types import TracebackType
from typing import Any

try:
    import fcntl
except ImportError:  # no fcntl (Windows): pipes keep their size
    fcntl = None  # type: ignore[assignment]

FORK_AVAILABLE = "fork" in multiprocessing.get_all_start_methods()


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask where the OS has one): a child on a single
    CPU only takes turns with its parent, for the fork's cost."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity masks (macOS)
        return os.cpu_count() or 1


_HEADER_BYTES = 8  # each answer's length, before it on the pipe


class Forked:
    """``parts`` (name -> function), computed in order in a forked child; `result` returns a part's
    value or raises its exception.

    Each answer is sent as soon as it is computed, so the parent may take an early part while the
    child computes the later ones. Use it as a context manager: leaving the block before every
    answer was read (the parent's own work failed) kills and reaps the child, so no process outlives
    the block. Only the calling thread is copied into the child, which runs the parts alone and
    leaves by ``os._exit`` (no atexit handlers, no flush of buffers it inherited from the parent).
    """

    def __init__(self, **parts: Callable[[], Any]) -> None:
        self._parts = parts
        self._answers: dict[str, tuple[str, object]] = {}
        self._pid: int | None = None  # None once reaped (or never started)
        self.exit_status: int | None = None  # the child's wait status (os.waitpid) once reaped
        self._pipe: Any = None  # None once closed
        self._received = 0  # answers read from the pipe
        read_fd, write_fd = os.pipe()
        _widen(write_fd)
        try:
            pid = os.fork()
        except OSError:  # no process to be had (a process limit, memory): every part is computed here
            os.close(read_fd)
            os.close(write_fd)
            return
        if pid == 0:  # the child
            code = 0
            try:
                os.close(read_fd)
                for fn in parts.values():
                    try:
                        answer: tuple[str, object] = ("value", fn())
                    except BaseException as err:  # any: the parent re-raises it
                        answer = ("error", err)
                    data = pickle.dumps(answer, protocol=pickle.HIGHEST_PROTOCOL)
                    _write_all(write_fd, len(data).to_bytes(_HEADER_BYTES, "big") + data)
            except BaseException:  # an answer that does not pickle: the parent computes it and the rest
                code = 1
            finally:
                os._exit(code)
        os.close(write_fd)
        self._pid = pid
        self._pipe = os.fdopen(read_fd, "rb")

    def result(self, name: str) -> Any:
        """Part ``name``'s value (waiting for the child's answer), its exception re-raised, or the
        part computed here if the child died without answering it."""
        if name not in self._answers:
            self._answers[name] = self._collect(name)
        kind, value = self._answers[name]
        if kind == "error":
            raise value  # type: ignore[misc]
        return value

    def _collect(self, name: str) -> tuple[str, object]:
        names = list(self._parts)
        while self._pipe is not None and self._received <= names.index(name):
            answer = self._read()
            if answer is None:  # the child is gone: what it did not send is computed here
                self._close()
                break
            self._answers[names[self._received]] = answer
            self._received += 1
            if self._received == len(names):
                self._close()
        if name in self._answers:
            return self._answers[name]
        try:
            return "value", self._parts[name]()
        except Exception as err:  # raised by result(), as a child's would be
            return "error", err

    def _read(self) -> tuple[str, object] | None:
        header = self._pipe.read(_HEADER_BYTES)
        if len(header) < _HEADER_BYTES:
            return None
        size = int.from_bytes(header, "big")
        data = self._pipe.read(size)
        if len(data) < size:
            return None
        try:
            answer = pickle.loads(data)
        except Exception:  # a class the parent cannot unpickle: compute it here
            return None
        return answer if isinstance(answer, tuple) and len(answer) == 2 else None

    def _close(self) -> None:
        """Close the pipe and reap the child, killing it first if it may still be running."""
        if self._pipe is not None:
            pipe, self._pipe = self._pipe, None
            if self._received < len(self._parts) and self._pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self._pid, signal.SIGKILL)
            pipe.close()
        if self._pid is not None:
            # ChildProcessError: SIGCHLD is ignored here, so the system reaped the child itself.
            with contextlib.suppress(ChildProcessError):
                _, self.exit_status = os.waitpid(self._pid, 0)
            self._pid = None

    def __enter__(self) -> Forked:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._close()


# What a pipe may hold, where the system lets it be widened (Linux: up to /proc/sys/fs/pipe-max-size,
# 1 MiB by default): the child then writes an answer and goes on to its next part without waiting for
# the parent to read (the planner's scans at 512 devices pickle to ~0.2 MB; a 64 KiB pipe held the
# child ~0.24 s until the parent took them).
PIPE_BYTES = 1 << 20


def _widen(fd: int) -> None:
    """Ask for a PIPE_BYTES pipe (or the most this system allows); a pipe left as it is only slows the
    child's writes down, so refusals are ignored."""
    if fcntl is None or not hasattr(fcntl, "F_SETPIPE_SZ"):
        return
    size = PIPE_BYTES
    with contextlib.suppress(OSError, ValueError):
        with open("/proc/sys/fs/pipe-max-size") as f:
            size = min(size, int(f.read()))
    with contextlib.suppress(OSError):
        fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, size)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
