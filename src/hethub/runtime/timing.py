"""Timing marks on a device's own timeline, read without stalling the step.

Kernels run asynchronously on an accelerator: ``time.perf_counter`` around an op measures how long
the host took to queue it, not how long it ran. On a device with timing events (CUDA, ROCm, XPU,
Ascend through ``torch.Event``) a mark is an event recorded on the current stream, and marks are
turned into seconds only after the step's one host synchronisation (``Trainer.train_step``), so
timing adds no synchronisation of its own. On the CPU the work is done when the call returns, so a
mark is ``perf_counter()`` and reads at once.
"""

from __future__ import annotations

import time
from typing import Any

import torch

Mark = Any  # a float (host clock) or a torch.Event


class OpTimer:
    """Marks on ``device``'s timeline (module doc); ``device_events`` says which kind it makes."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.device_events = device.type != "cpu" and _has_timing_events(device)

    def mark(self) -> Mark:
        if not self.device_events:
            return time.perf_counter()
        event = torch.Event(device=self.device, enable_timing=True)
        event.record()
        return event

    def seconds(self, since: Mark, mark: Mark) -> float:
        """Seconds from mark ``since`` to ``mark``; on a device, waits for ``mark`` to be reached
        (call after the step's synchronisation, when it has been)."""
        if not self.device_events:
            return float(mark - since)
        mark.synchronize()
        return since.elapsed_time(mark) / 1e3


def _has_timing_events(device: torch.device) -> bool:
    try:
        torch.Event(device=device, enable_timing=True)
    except (RuntimeError, ValueError, TypeError):
        return False  # a backend without timing events: host marks
    return True
