"""Other people's load on this host, in cores: what a local emulation's measurement shares the cores
with, and no predictor of our own ranks can know. Measured from the whole machine's busy CPU time
(/proc/stat) less this process's and its finished children's."""

from __future__ import annotations

import os
import resource
import time
from pathlib import Path


def machine_busy_s() -> float | None:
    """CPU seconds all cores spent busy since boot (/proc/stat); None where the system has no such file."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    except OSError:
        return None
    vals = [float(v) for v in fields]
    idle = vals[3] + vals[4]  # idle + iowait
    return (sum(vals[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def own_cpu_s() -> float:
    """CPU seconds of this process and of its children that have been waited for."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


class ForeignLoad:
    """Cores others kept busy between :meth:`start` and :meth:`cores` (children must have ended)."""

    def __init__(self) -> None:
        self.start()

    def start(self) -> None:
        self._busy0, self._own0, self._t0 = machine_busy_s(), own_cpu_s(), time.monotonic()

    def cores(self) -> float | None:
        busy = machine_busy_s()
        if busy is None or self._busy0 is None:
            return None
        wall = time.monotonic() - self._t0
        return max(0.0, (busy - self._busy0) - (own_cpu_s() - self._own0)) / wall if wall > 0 else 0.0
