"""Emulated slow kinds: a chunk that used t CPU-seconds is followed by a (k-1)*t sleep."""

from __future__ import annotations

import time

import pytest

from hethub.runtime.slowdown import Emulator


def _spin(cpu_s: float) -> None:
    t0 = time.thread_time()
    while time.thread_time() - t0 < cpu_s:
        pass


def test_emulator_sleeps_k_minus_1_times_the_cpu_time() -> None:
    emu = Emulator(3.0)
    with emu.chunk():
        _spin(0.03)
    assert 0.06 <= emu.slept_s <= 0.075


def test_real_speed_kind_never_sleeps_and_bad_slowdown_is_refused() -> None:
    emu = Emulator()
    with emu.chunk():
        _spin(0.005)
    assert emu.slept_s == 0.0 and not emu.active
    with pytest.raises(ValueError, match=">= 1"):
        Emulator(0.5)
