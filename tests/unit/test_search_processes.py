"""The planner's second process (search/parallel.py): the same result as one process, its errors
surfaced, no child left behind, and the config field that turns it off."""

import os
import signal
import time
from pathlib import Path
from typing import ClassVar

import pytest

from hethub.errors import InfeasibleError, SpecError
from hethub.search import PlannerConfig, make_plan
from hethub.search import planner as planner_mod
from hethub.search.parallel import FORK_AVAILABLE, Forked
from hethub.search.templates import Searcher
from hethub.spec.cluster import load_cluster, parse_cluster
from hethub.spec.model import get_model

CLUSTERS = Path(__file__).resolve().parents[2] / "examples" / "clusters"
pytestmark = pytest.mark.skipif(not FORK_AVAILABLE, reason="fork is not available here")


class _Spy(Forked):
    """Forked, recording the children it started."""

    pids: ClassVar[list[int]] = []

    def __init__(self, **parts):
        super().__init__(**parts)
        _Spy.pids.append(self._pid)


@pytest.fixture
def spy(monkeypatch):
    _Spy.pids = []
    monkeypatch.setattr(planner_mod, "Forked", _Spy)
    monkeypatch.setattr(planner_mod, "usable_cpus", lambda: 2)  # whatever this machine has
    return _Spy


def _reaped(pid: int) -> bool:
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return True
    return False


def _same(one, two) -> None:
    """Two PlanResults equal in everything but the time they took."""
    def alts(r):
        return [(plan.with_meta(search_time_s=0).to_json(), pred) for plan, pred in r.alternatives]

    assert alts(one) == alts(two)
    assert one.plan.with_meta(search_time_s=0).to_json() == two.plan.with_meta(search_time_s=0).to_json()
    assert one.prediction == two.prediction
    assert one.upper_bound_tokens_per_s == two.upper_bound_tokens_per_s
    assert one.efficiency == two.efficiency
    assert one.upper_bound_by_kind == two.upper_bound_by_kind
    assert one.relaxed_kinds == two.relaxed_kinds
    assert one.notes == two.notes


# Small clusters with the threshold lowered: the same code path as a large one, at a fraction of the CPU.
# Polish off: it runs after both parts in the parent either way, and its budget is wall time.
@pytest.mark.parametrize(("cluster", "model", "options"), [
    ("three-kinds-48", "llama-2-70b", {"global_batch": 256, "seq_len": 4096, "top_k": 3}),
    ("nvidia-amd-32", "llama-3-70b", {"global_batch": 256, "seq_len": 2048}),
    ("a100-v100-32", "llama-2-7b", {"global_batch": 64, "seq_len": 2048, "top_k": 3}),
    ("nvidia-ascend-32", "llama-2-13b", {"global_batch": 128, "seq_len": 2048, "top_k": 2}),
])
def test_two_processes_give_the_one_process_result(monkeypatch, spy, cluster, model, options):
    monkeypatch.setattr(planner_mod, "FORK_MIN_DEVICES", 1)
    c, m = load_cluster(CLUSTERS / f"{cluster}.toml"), get_model(model)
    one = make_plan(cluster=c, model=m, config=PlannerConfig(search_processes=1, polish=False, **options))
    assert not spy.pids
    two = make_plan(cluster=c, model=m, config=PlannerConfig(polish=False, **options))
    assert spy.pids  # it did fork
    assert all(_reaped(pid) for pid in spy.pids)
    _same(one, two)


def test_a_large_cluster_forks_by_default_with_the_same_result(spy):
    # 256 devices of two kinds, a small model: the default threshold, polish included (the planner's
    # own path end to end).
    network = {"inter_node_bw_bytes_per_s": 50e9, "inter_node_latency_s": 10e-6,
               "cross_kind_bw_bytes_per_s": 12.5e9, "cross_kind_latency_s": 40e-6}
    c = parse_cluster({"name": "two-proc-256", "network": network,
                       "group": [{"kind": k, "nodes": 16, "devices_per_node": 8, "devices_per_nic": 1}
                                 for k in ("h100-sxm", "a100-80gb")]}, where="test")
    assert c.num_devices >= planner_mod.FORK_MIN_DEVICES
    m = get_model("llama-2-7b")
    two = make_plan(cluster=c, model=m, config=PlannerConfig(global_batch=512, seq_len=2048, polish=False))
    assert len(spy.pids) == 1 and _reaped(spy.pids[0])
    one = make_plan(cluster=c, model=m, config=PlannerConfig(global_batch=512, seq_len=2048, polish=False,
                                                             search_processes=1))
    assert len(spy.pids) == 1
    _same(one, two)


def test_a_smallest_size_found_not_promising_is_searched_again_with_the_others(monkeypatch, spy):
    # With two processes the parent searches the smallest micro-batch size before it has the other
    # sizes' scans; where those show it is not promising, its search goes and the promising sizes are
    # searched as one process would.
    import hethub.search.hetero as hetero

    monkeypatch.setattr(planner_mod, "FORK_MIN_DEVICES", 1)
    promising, searched = hetero._promising_mbs, []
    monkeypatch.setattr(hetero, "_promising_mbs", lambda s: promising(s)[1:])  # drop the smallest
    real = hetero._search_size

    def search_size(s, results, mbs):
        searched.append(mbs)
        return real(s, results, mbs)

    monkeypatch.setattr(hetero, "_search_size", search_size)
    one, first, two, second = _one_then_two(searched)
    assert 1 not in first and first
    assert spy.pids and second[0] == 1 and 1 not in second[1:]  # searched first, then dropped
    _same(one, two)


def _one_then_two(seen: list) -> tuple:
    """The small job planned in one process, then in two: each result with what `seen` got meanwhile."""
    c, m = _small_job()
    options = {"global_batch": 64, "seq_len": 2048, "polish": False}
    one = make_plan(cluster=c, model=m, config=PlannerConfig(search_processes=1, **options))
    first = list(seen)
    seen.clear()
    two = make_plan(cluster=c, model=m, config=PlannerConfig(**options))
    return one, first, two, list(seen)


def test_the_child_prepares_the_second_size_and_the_parent_takes_it(monkeypatch, spy):
    # Beside its scans the child makes the second micro-batch size's base choices and aligned variants
    # (hetero.prepare_size): the parent then does not make them, and the plan is one process's.
    import hethub.search.hetero as hetero

    monkeypatch.setattr(planner_mod, "FORK_MIN_DEVICES", 1)
    parent, made = os.getpid(), []
    real = hetero._base_choices

    def base_choices(s, ranked, mbs):
        if os.getpid() == parent:
            made.append(mbs)
        return real(s, ranked, mbs)

    monkeypatch.setattr(hetero, "_base_choices", base_choices)
    one, first, two, second = _one_then_two(made)
    assert 2 in first
    assert spy.pids and 1 in second and 2 not in second
    _same(one, two)


def test_a_child_goes_on_past_an_answer_larger_than_a_default_pipe():
    # Forked widens its pipe where the system allows, so the child sends a large answer and goes on to
    # its next part without waiting for the parent to read it (the planner's template scans, then the
    # bound): both answers sit in the pipe before the parent reads any.
    import array
    import fcntl
    import termios

    pipe_max = Path("/proc/sys/fs/pipe-max-size")
    if not hasattr(fcntl, "F_SETPIPE_SZ") or not pipe_max.exists() or int(pipe_max.read_text()) < 600_000:
        pytest.skip("this system does not let a pipe hold the answer")
    with Forked(big=lambda: b"x" * 500_000, after=lambda: "after") as f:
        waiting, deadline = array.array("i", [0]), time.monotonic() + 30
        while time.monotonic() < deadline:
            fcntl.ioctl(f._pipe.fileno(), termios.FIONREAD, waiting)
            if waiting[0] > 500_000 + 64:  # the big answer and the next one's header at least
                break
            time.sleep(0.01)
        assert waiting[0] > 500_000 + 64
        assert len(f.result("big")) == 500_000 and f.result("after") == "after"


def test_one_cpu_or_one_process_asked_for_does_not_fork(monkeypatch, spy):
    monkeypatch.setattr(planner_mod, "FORK_MIN_DEVICES", 1)
    c, m = load_cluster(CLUSTERS / "nvidia-amd-32.toml"), get_model("llama-2-7b")
    make_plan(cluster=c, model=m, config=PlannerConfig(global_batch=64, seq_len=2048, polish=False,
                                                       search_processes=1))
    monkeypatch.setattr(planner_mod, "usable_cpus", lambda: 1)
    make_plan(cluster=c, model=m, config=PlannerConfig(global_batch=64, seq_len=2048, polish=False))
    assert not spy.pids


def _small_job():
    return load_cluster(CLUSTERS / "nvidia-amd-32.toml"), get_model("llama-2-7b")


def test_the_childs_error_is_raised_in_the_parent(monkeypatch, spy):
    monkeypatch.setattr(planner_mod, "FORK_MIN_DEVICES", 1)

    def bound(**_):
        raise InfeasibleError("no kind can hold it. Fix: a bigger cluster.")

    monkeypatch.setattr(planner_mod, "bound_parts", bound)
    c, m = _small_job()
    with pytest.raises(InfeasibleError, match=r"^no kind can hold it\. Fix: a bigger cluster\.$"):
        make_plan(cluster=c, model=m, config=PlannerConfig(global_batch=64, seq_len=2048))
    assert len(spy.pids) == 1 and _reaped(spy.pids[0])


def test_the_bounds_error_wins_as_in_one_process(monkeypatch, spy):
    # One process runs the bound first: its error is the one raised, whatever the mixed search does.
    monkeypatch.setattr(planner_mod, "FORK_MIN_DEVICES", 1)

    def bound(**_):
        raise InfeasibleError("from the bound")

    def mixed(*_, **__):
        raise InfeasibleError("from the mixed search")

    monkeypatch.setattr(planner_mod, "bound_parts", bound)
    monkeypatch.setattr(planner_mod, "_hethub_candidates", mixed)
    c, m = _small_job()
    for procs in (1, 2):
        with pytest.raises(InfeasibleError, match="from the bound"):
            make_plan(cluster=c, model=m, config=PlannerConfig(global_batch=64, seq_len=2048, search_processes=procs))
    assert len(spy.pids) == 1 and _reaped(spy.pids[0])


@pytest.mark.parametrize("dies_in", ["scans", "bound"])
def test_a_crashed_child_is_computed_in_the_parent(monkeypatch, spy, dies_in):
    # The child sends its template scans, then the bound: dying in either, what it did not send is
    # computed in the parent.
    monkeypatch.setattr(planner_mod, "FORK_MIN_DEVICES", 1)
    c, m = _small_job()
    want = make_plan(cluster=c, model=m, config=PlannerConfig(global_batch=64, seq_len=2048, polish=False,
                                                              search_processes=1))
    parent = os.getpid()
    if dies_in == "bound":
        real = planner_mod.bound_parts

        def bound(**kw):
            if os.getpid() != parent:
                os._exit(3)  # dies without answering
            return real(**kw)

        monkeypatch.setattr(planner_mod, "bound_parts", bound)
    else:
        real_scans = Searcher.pure_scans

        def pure_scans(self, keys):
            if os.getpid() != parent:
                os._exit(3)
            return real_scans(self, keys)

        monkeypatch.setattr(Searcher, "pure_scans", pure_scans)
    got = make_plan(cluster=c, model=m, config=PlannerConfig(global_batch=64, seq_len=2048, polish=False))
    assert len(spy.pids) == 1 and _reaped(spy.pids[0])
    _same(want, got)


def test_forked_values_errors_and_fallbacks():
    with Forked(a=lambda: {"a": (1, 2.5)}, b=lambda: 1 / 0, c=lambda: "c") as f:
        assert f.result("c") == "c"  # read in any order
        assert f.result("a") == {"a": (1, 2.5)}
        with pytest.raises(ZeroDivisionError):
            f.result("b")
    # A value that does not pickle (a lambda) is computed in the parent, and so are the parts after it.
    parent = os.getpid()
    with Forked(fn=lambda: (lambda: 7), pid=os.getpid) as f:
        assert f.result("fn")() == 7
        assert f.result("pid") == parent
    # So are those of a child that is killed, here after its first answer.

    def pid_or_die() -> int:
        if os.getpid() != parent:
            os.kill(os.getpid(), signal.SIGKILL)
        return os.getpid()

    with Forked(first=os.getpid, second=pid_or_die) as f:
        assert f.result("second") == parent
        assert f.result("first") != parent  # the child's answer, sent before it died
    assert os.WIFSIGNALED(f.exit_status)


def test_no_fork_to_be_had_computes_every_part_here(monkeypatch):
    def no_fork():
        raise OSError("Resource temporarily unavailable")

    monkeypatch.setattr(os, "fork", no_fork)
    with Forked(a=os.getpid, b=lambda: 1 / 0) as f:
        assert f.result("a") == os.getpid()
        with pytest.raises(ZeroDivisionError):
            f.result("b")
    monkeypatch.setattr(planner_mod, "FORK_MIN_DEVICES", 1)
    c, m = _small_job()
    assert make_plan(cluster=c, model=m, config=PlannerConfig(global_batch=64, seq_len=2048, polish=False)).plan


def test_a_process_that_ignores_sigchld_still_gets_the_answers():
    # With SIGCHLD ignored the system reaps children itself and waitpid finds none.
    before = signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    try:
        with Forked(a=lambda: 5, b=lambda: "b") as f:
            assert (f.result("a"), f.result("b")) == (5, "b")
    finally:
        signal.signal(signal.SIGCHLD, before)


def test_leaving_the_block_early_stops_and_reaps_the_child():
    with pytest.raises(RuntimeError), Forked(sleep=lambda: time.sleep(600)) as f:
        pid = f._pid
        raise RuntimeError("the parent's own work failed")
    assert _reaped(pid)
    assert os.WIFSIGNALED(f.exit_status) and os.WTERMSIG(f.exit_status) == signal.SIGKILL  # killed, not waited for


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_search_processes_is_validated(bad):
    with pytest.raises(SpecError, match=r"'search_processes' must be a positive integer.*Fix: give 1"):
        PlannerConfig(global_batch=8, seq_len=128, search_processes=bad)
