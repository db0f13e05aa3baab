"""hethub.fanout: the seam that runs a search's independent tasks in forked workers.

A test runner's worker has threads (pytest-xdist's), where the seam rightly runs serially, so every
check that needs a real fork runs in a fresh single-threaded interpreter (`_run`), which records the
process each task ran in and fails unless a child really ran some."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from hethub import fanout
from hethub.errors import SpecError

SRC = Path(__file__).resolve().parents[2] / "src"
TESTS = Path(__file__).resolve().parents[1]


# Two tasks that wait for each other can only finish side by side, in two processes.
PRELUDE = """
    import json, multiprocessing, os, time
    from hethub import fanout
    from hethub.errors import InfeasibleError
    meet = multiprocessing.get_context("fork").Barrier(2, timeout=60)
    parent = os.getpid()
    def children_left():
        try:
            os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return False
        return True
"""


def _run(code: str, *, prelude: bool = True, timeout_s: float = 300) -> dict:
    """``code`` (after `PRELUDE`) in a fresh interpreter (one thread) with two workers; it prints one JSON line."""
    env = {**os.environ, fanout.ENV: "2", "PYTHONPATH": os.pathsep.join([str(SRC), str(TESTS)])}
    source = (textwrap.dedent(PRELUDE) if prelude else "") + textwrap.dedent(code)
    out = subprocess.run([sys.executable, "-c", source], env=env, capture_output=True, text=True, timeout=timeout_s)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_tasks_run_side_by_side_with_results_in_task_order():
    got = _run("""
        def task(i):
            if i < 2:
                meet.wait()  # tasks 0 and 1 run at once, so in two processes
            return i * i, os.getpid()
        done = []
        with fanout.timed() as spans:
            out = fanout.fan_out([lambda i=i: task(i) for i in range(5)], order=[1, 0, 4, 3, 2],
                                 done=lambda i, r: done.append((i, os.getpid())))
        print(json.dumps({"values": [v for v, _ in out], "pids": [p for _, p in out], "parent": parent,
                          "done": sorted(done), "left": children_left(), "spans": spans}))
    """)
    assert got["values"] == [0, 1, 4, 9, 16]
    assert got["pids"][0] != got["pids"][1] and got["parent"] in got["pids"][:2]
    assert got["done"] == [[i, got["parent"]] for i in range(5)]  # every result reported in the parent
    assert not got["left"]  # every child reaped
    [(own_s, children_s)] = got["spans"]  # one fan-out: this process's CPU s and its one child's
    assert own_s >= 0 and len(children_s) == 1 and children_s[0] >= 0


def test_the_first_task_in_order_runs_in_this_process_however_late_it_claims():
    # The parent sleeps after each fork, so its children could claim every task before it claims one.
    got = _run("""
        real_fork = os.fork
        def slow_fork():
            pid = real_fork()
            if pid:
                time.sleep(0.5)
            return pid
        os.fork = slow_fork
        out = fanout.fan_out([os.getpid] * 4, order=[2, 0, 3, 1])
        print(json.dumps({"pids": out, "parent": parent}))
    """)
    assert got["pids"][2] == got["parent"]


def test_the_first_failed_task_in_task_order_raises_its_own_type_from_a_child():
    got = _run("""
        def fail(i):
            meet.wait()
            if i == 0 or os.getpid() != parent:  # task 0 fails wherever it runs; the other only in a child
                raise InfeasibleError(f"task {i}")
            return i
        errors = []
        for tasks in ([lambda: fail(0), lambda: fail(1)], [lambda: meet.wait() and 0, lambda: fail(1)]):
            try:
                fanout.fan_out(tasks)
                errors.append(["", ""])
            except InfeasibleError as e:
                errors.append([str(e), "".join(getattr(e, "__notes__", []))])
        print(json.dumps({"errors": errors, "left": children_left()}))
    """)
    first, second = got["errors"]
    assert first[0] == "task 0"  # the serial run's error, whichever process raised first
    if second[0]:  # task 1 raised only where it ran in the child: its type crossed, with the child's traceback
        assert second[0] == "task 1" and "in fan_out worker pid" in second[1] and "fail" in second[1]
    assert len(got["errors"]) == 2 and not got["left"]


def test_an_interrupt_in_the_parent_kills_and_reaps_its_workers():
    got = _run("""
        def task():
            meet.wait()
            if os.getpid() == parent:
                raise KeyboardInterrupt
            time.sleep(120)  # the child: killed, not waited for
        t0 = time.monotonic()
        try:
            fanout.fan_out([task, task])
        except KeyboardInterrupt:
            pass
        print(json.dumps({"s": time.monotonic() - t0, "left": children_left()}))
    """)
    assert got["s"] < 60 and not got["left"]


def test_an_interrupt_while_waiting_for_a_worker_kills_and_reaps_it(tmp_path):
    import signal
    import time

    ready, past = tmp_path / "ready", tmp_path / "parent-past-the-barrier"
    # The interrupt must find the parent past the barrier (waiting on its worker's pipe): one that
    # lands inside multiprocessing's Barrier can leave its condition waiting for a wake-up forever.
    code = textwrap.dedent(PRELUDE) + textwrap.dedent(f"""
        import signal, sys
        # Ctrl-C raises KeyboardInterrupt even where this interpreter was started with SIGINT
        # ignored (a shell's background job, as some CI runners launch the suite).
        signal.signal(signal.SIGINT, signal.default_int_handler)
        def task():
            meet.wait()
            if os.getpid() != parent:
                open({str(ready)!r}, "w").close()
                time.sleep(120)
            else:
                open({str(past)!r}, "w").close()
        try:
            fanout.fan_out([task, task])
        except KeyboardInterrupt:
            print(json.dumps({{"left": children_left()}}))
            sys.exit(0)
    """)
    env = {**os.environ, fanout.ENV: "2", "PYTHONPATH": str(SRC)}
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not (ready.exists() and past.exists()) and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)  # the parent, its own task done, waits on the worker's pipe
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0 and json.loads(out) == {"left": False}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_parent_killed_outright_takes_its_workers_along(tmp_path):
    import signal
    import time

    pids = tmp_path / "pids"
    code = textwrap.dedent(PRELUDE) + textwrap.dedent(f"""
        def task():
            meet.wait()
            with open({str(pids)!r}, "a") as f:
                f.write(f"{{os.getpid()}}\\n")
            time.sleep(120)
        fanout.fan_out([task, task])
    """)
    env = {**os.environ, fanout.ENV: "2", "PYTHONPATH": str(SRC)}
    proc = subprocess.Popen([sys.executable, "-c", code], env=env)
    try:
        deadline = time.monotonic() + 60
        while (not pids.exists() or len(pids.read_text().split()) < 2) and time.monotonic() < deadline:
            time.sleep(0.05)
        child = next(int(p) for p in pids.read_text().split() if int(p) != proc.pid)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    for _ in range(200):  # the kernel kills it; the init process reaps it
        if not Path(f"/proc/{child}").exists() or "Z" in Path(f"/proc/{child}/stat").read_text().split()[2]:
            break
        time.sleep(0.05)
    else:
        os.kill(child, signal.SIGKILL)
        pytest.fail(f"worker {child} outlived its killed parent")


def test_a_worker_that_dies_or_sends_what_does_not_pickle_is_an_error():
    got = _run("""
        def dies():
            meet.wait()
            if os.getpid() != parent:
                os._exit(3)
        def unpicklable():
            meet.wait()
            return (lambda: None) if os.getpid() != parent else None
        class Odd(Exception):  # its arguments do not rebuild it: unpickling fails
            def __init__(self, a, b):
                super().__init__(f"{a}/{b}")
        def odd():
            meet.wait()
            if os.getpid() != parent:
                raise Odd(1, 2)
        out = []
        for task, err in ((dies, ChildProcessError), (unpicklable, RuntimeError), (odd, RuntimeError)):
            try:
                fanout.fan_out([task, task])
                out.append("none")
            except err as e:
                out.append(str(e))
        print(json.dumps({"out": out, "left": children_left()}))
    """)
    died, pickled, odd = got["out"]
    assert "ended with status" in died and "does not pickle" in pickled and not got["left"]
    assert odd == "Odd: 1/2"  # named, in a type that crosses


def test_nested_fan_out_and_shared_objects():
    got = _run("""
        import types
        shared = types.SimpleNamespace(big=list(range(1000)))
        def slow_pid():
            time.sleep(0.3)  # long enough for a forked worker, were there one, to claim the other
            return os.getpid()
        def task():
            meet.wait()
            inner = fanout.fan_out([slow_pid, slow_pid])  # inside a task (the parent's too): serial, in its process
            return os.getpid(), inner, shared
        with fanout.sharing(shared):
            out = fanout.fan_out([task, task])
        print(json.dumps({"nested": [[p, *inner] for p, inner, _ in out], "same": [s is shared for *_, s in out]}))
    """)
    assert all(len(set(n)) == 1 for n in got["nested"]) and got["nested"][0][0] != got["nested"][1][0]
    assert got["same"] == [True, True]  # crossed as a reference: the parent's own object


def test_sharing_refuses_what_can_only_cross_by_value():
    # Plain values (a dict, a list, a number) are pickled whole whatever sharing says: refused, with the fix.
    with pytest.raises(TypeError, match="its own class"):
        with fanout.sharing({"a": 1}):
            pass
    with fanout.sharing(None, fanout):  # None is one object everywhere; a module is an object of its own class
        pass


def test_serial_in_process_beside_a_live_thread(monkeypatch):
    monkeypatch.setenv(fanout.ENV, "2")
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait)
    thread.start()
    try:
        assert fanout.forks(3) == 0
        done = []
        assert fanout.fan_out([os.getpid] * 3, done=lambda i, r: done.append(i)) == [os.getpid()] * 3
        assert done == [0, 1, 2]
    finally:
        stop.set()
        thread.join()


def test_workers_from_the_environment(monkeypatch):
    monkeypatch.setenv(fanout.ENV, "1")
    assert fanout.workers() == 1 and fanout.forks(5) == 0
    monkeypatch.setenv(fanout.ENV, "3")
    assert fanout.workers() == 3
    with fanout.serial():
        assert fanout.forks(5) == 0
    monkeypatch.setenv(fanout.ENV, "two")
    with pytest.raises(SpecError, match=f"{fanout.ENV}.*positive integer.*Fix"):
        fanout.workers()
    monkeypatch.delenv(fanout.ENV)
    assert fanout.workers() >= 1
    with pytest.raises(ValueError, match="permutation"):
        fanout.fan_out([os.getpid] * 2, order=[0, 0])


def test_make_plan_forked_gives_the_serial_plan():
    # The default path (schedules and shardings auto) on a small two-kind cluster: with two workers
    # (children recorded as they claim tasks) and with one, from cold memos; the plans (every
    # alternative, with its predicted step), notes and the bound's parts equal.
    got = _run("""
        import json, os
        from hethub import fanout
        from hethub.memo import clear_caches
        from hethub.search.config import PlannerConfig
        from hethub.search.planner import make_plan
        from conftest import small_cluster, tiny_model
        ran = set()
        claim = fanout._Pool._claim
        def recorded(self):
            i = claim(self)
            if i is not None and os.getpid() != parent:
                with open(log, "a") as f:
                    f.write(f"{os.getpid()}\\n")
            return i
        fanout._Pool._claim = recorded
        parent, log = os.getpid(), f"/tmp/hethub-fanout-{os.getpid()}.log"
        config = PlannerConfig(global_batch=16, seq_len=32, micro_batch_sizes=(1, 2), schedule="auto",
                               optimizer_sharding="auto")
        plans = []
        for workers in ("2", "1"):
            os.environ[fanout.ENV] = workers
            clear_caches()
            r = make_plan(cluster=small_cluster(), model=tiny_model(), config=config)
            alternatives = []
            for plan, pred in r.alternatives:
                d = plan.to_dict()
                d.pop("meta")
                alternatives.append([d, pred.step_time_s])
            plans.append(json.dumps([alternatives, r.notes, r.upper_bound_by_kind], sort_keys=True, default=str))
            children = len(open(log).read().split()) if os.path.exists(log) else 0
            os.path.exists(log) and os.remove(log)
            plans.append(children)
        print(json.dumps({"plans": plans}))
    """, prelude=False)
    forked, forked_tasks, serial, serial_tasks = got["plans"]
    assert forked_tasks > 0 and serial_tasks == 0  # the first search really ran tasks in children
    assert forked == serial
