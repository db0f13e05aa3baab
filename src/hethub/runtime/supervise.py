"""Keeping a local run in hand: the launcher's view of torchrun and its ranks.

``hethub train`` starts torchrun, which starts one process per rank, each in a session of its own
(torch's elastic agent does that so it can signal a worker's whole group). A signal sent to the
launcher alone (a scheduler's SIGTERM, a terminal's SIGHUP) would otherwise leave torchrun and
every rank running, orphaned, holding the checkpoint lock; :class:`Supervisor` forwards it and makes
sure the run ends. torchrun's report of a failed worker is noise beside the ranks' own hethub errors,
except for one fact it alone knows, a rank killed by a signal (the kernel's OOM killer sends
SIGKILL): :func:`agent_noise_filter` drops the report and :class:`AgentReport` keeps that fact.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SHUTDOWN_GRACE_S = 40.0  # torchrun's own wait for its workers after forwarding a signal is 30 s
FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_AGENT_LOG = re.compile(r"^[WEI]\d{4} [\d:.]+ \d+ .*torch/distributed/(elastic|run)")
_BOX_RANK = re.compile(r"^\s*rank\s*:\s*(\d+)")
_BOX_EXIT = re.compile(r"^\s*exitcode\s*:\s*(-?\d+)")


@dataclass
class AgentReport:
    """What torchrun's failure report said, read while it is filtered out: each failed rank's exit
    code, and those killed by a signal (a negative exit code: -9 is SIGKILL)."""

    exit_codes: dict[int, int] = field(default_factory=dict)
    _rank: int | None = None

    def read(self, line: str) -> None:
        if m := _BOX_RANK.match(line):
            self._rank = int(m.group(1))
        elif (m := _BOX_EXIT.match(line)) and self._rank is not None:
            self.exit_codes[self._rank] = int(m.group(1))
            self._rank = None

    @property
    def signalled(self) -> dict[int, int]:
        return {r: -c for r, c in sorted(self.exit_codes.items()) if c < 0}


def agent_noise_filter(lines: Iterable[str], *, report: AgentReport | None = None) -> Iterator[str]:
    """``lines`` without torchrun's report of a failed worker: its log lines (``E1201 12:00:00 123
    torch/distributed/...``), the traceback ending in ``ChildFailedError`` with its ``=====`` box,
    whose per-rank exit codes go to ``report``, and the one ending in ``SignalException`` (torchrun
    stopping on a signal the launcher forwarded). Any other traceback (a bug in a rank) passes through whole."""
    held: list[str] = []  # a traceback being read: shown unless it turns out to be torchrun's
    box = 0  # inside the ChildFailedError box: '=' rules seen so far (it ends at the 2nd)
    for line in lines:
        if box:
            if report is not None:
                report.read(line)
            if line.startswith("====="):
                box += 1
                if box == 3:
                    box = 0
            continue
        if held:
            if line.startswith((" ", "\t")) or line.startswith("Traceback"):
                held.append(line)
                continue
            if "ChildFailedError" in line:
                held, box = [], 1
                continue
            if "elastic.multiprocessing.api.SignalException" in line:  # torchrun stopping on a signal
                held = []
                continue
            yield from held
            held = []
        if line.startswith("Traceback (most recent call last)"):
            held = [line]
            continue
        if _AGENT_LOG.match(line):
            continue
        yield line
    yield from held


def rank_pid_file(error_dir: str | Path, rank: int | str) -> Path:
    """Where a rank started by ``hethub train`` leaves its pid (``Supervisor`` reaps from these)."""
    return Path(error_dir, f"rank-{rank}.pid")


class Supervisor:
    """While torchrun runs: SIGTERM, SIGINT and SIGHUP to this process are forwarded to torchrun's
    process group (torchrun then stops its workers, which it starts in sessions of their own); if the
    run has not ended ``grace_s`` later, or a second signal comes, torchrun and every rank are killed.
    When torchrun has exited, any rank still alive (orphaned by a torchrun that died itself) is
    killed too, so nothing of the run outlives the launcher and the checkpoint lock (an ``flock``
    held by rank 0) is free. A rank is known by the pid file it writes (``rank_pid_file``) and checked
    to be ours (its environment names the same hand-off folder) before it is signalled."""

    def __init__(self, proc: subprocess.Popen, *, error_dir: Path, grace_s: float = SHUTDOWN_GRACE_S) -> None:
        self.proc, self.error_dir, self.grace_s = proc, error_dir, grace_s
        self.signum: int | None = None
        self._timer: threading.Timer | None = None
        self._old: dict[int, Any] = {}

    def __enter__(self) -> Supervisor:
        if threading.current_thread() is threading.main_thread():
            for sig in FORWARDED_SIGNALS:
                self._old[sig] = signal.signal(sig, self._on_signal)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)
        if self._timer is not None:
            self._timer.cancel()
        if self.proc.poll() is None:  # leaving early (an exception here): the run must not outlive us
            self.kill_all()
            self.proc.wait()
        self._kill_ranks()

    def _on_signal(self, signum: int, frame: Any) -> None:
        if self.signum is not None:  # a second signal: no more waiting
            self.kill_all()
            return
        self.signum = signum
        _signal_group(self.proc.pid, signum)
        self._timer = threading.Timer(self.grace_s, self.kill_all)
        self._timer.daemon = True
        self._timer.start()

    def kill_all(self) -> None:
        _signal_group(self.proc.pid, signal.SIGKILL)
        self._kill_ranks()

    def _kill_ranks(self) -> None:
        for f in sorted(self.error_dir.glob("rank-*.pid")):
            try:
                pid = int(f.read_text(encoding="ascii").strip())
            except (OSError, ValueError):
                continue
            if _is_ours(pid, self.error_dir):
                _signal_group(pid, signal.SIGKILL)


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _is_ours(pid: int, error_dir: Path) -> bool:
    """Whether process ``pid`` is alive and a rank of this run (not a recycled pid)."""
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes()
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: trust the pid file
        return True
    return f"HETHUB_ERROR_DIR={error_dir}".encode() in env.split(b"\0")
