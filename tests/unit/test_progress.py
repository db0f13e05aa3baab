"""hethub.progress: plain log lines off a terminal, a tqdm bar on one."""

import io

import pytest

from hethub.progress import progress


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_non_tty_iterable_logs_every_ten_percent_and_a_final_line() -> None:
    stream, clock = io.StringIO(), FakeClock()
    seen = []
    for i in progress(range(100), desc="search", unit="plans", stream=stream, clock=clock):
        clock.now += 0.25  # 4 plans/s
        seen.append(i)
    assert seen == list(range(100))
    lines = stream.getvalue().splitlines()
    assert len(lines) == 10  # 10%, 20%, ..., 90%, then "done"
    assert lines[3] == "search: 40/100 plans (4 plans/s, ETA 15 s)"
    assert lines[-1] == "search: 100/100 plans done in 25 s (4 plans/s)"
    assert "\r" not in stream.getvalue() and "\x1b" not in stream.getvalue()


def test_non_tty_context_manager_logs_by_time_when_progress_is_slow() -> None:
    stream, clock = io.StringIO(), FakeClock()
    with progress(1000, desc="profile", unit="layers", stream=stream, clock=clock, every_s=5.0) as bar:
        for _ in range(30):
            clock.now += 2.0
            bar.update()
    lines = stream.getvalue().splitlines()
    # 30 updates over 60 s, far below 10% of 1000: one line every ~5 s (every third update) + final
    assert len(lines) == 11
    assert lines[0] == "profile: 3/1000 layers (0.5 layers/s, ETA 33 min 14 s)"
    assert lines[-1] == "profile: 30/1000 layers done in 1 min 0 s (0.5 layers/s)"


def test_unknown_total_and_stderr_default(capsys: pytest.CaptureFixture[str]) -> None:
    clock = FakeClock()
    for _ in progress(iter(range(3)), desc="bench", unit="steps", clock=clock, every_s=1.0):
        clock.now += 1.0
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "bench: 1 steps (1 steps/s)"
    assert err[-1] == "bench: 3 steps done in 3.0 s (1 steps/s)"


def test_tty_uses_a_tqdm_bar() -> None:
    stream = io.StringIO()
    with progress(5, desc="train", unit="steps", stream=stream, tty=True) as bar:
        bar.update(5)
    out = stream.getvalue()
    assert "train" in out and "5/5" in out and "\r" in out


def test_a_tty_bar_starts_no_thread() -> None:
    # tqdm's monitor thread would keep the planner's fan-out serial (hethub.fanout forks beside no thread).
    import threading

    from tqdm import tqdm

    if tqdm.monitor is not None:  # one an earlier bar started (it joins the thread)
        tqdm.monitor.exit()
        tqdm.monitor = None
    before = threading.active_count()
    with progress(5, desc="plan", unit="steps", stream=io.StringIO(), tty=True) as bar:
        bar.update(2)
        assert threading.active_count() == before


def test_iterating_a_total_is_an_error() -> None:
    with pytest.raises(TypeError, match="update"):
        list(progress(3, desc="x", stream=io.StringIO()))
