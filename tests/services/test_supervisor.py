"""The supervisor of `pdserve up` on real (tiny) processes: restart with doubling backoff, reset
after a stable run, a crash loop reported with the child's own output, ordered stop."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from services.supervisor import CrashLoop, RestartPolicy, Supervisor

FAST = RestartPolicy(initial_backoff_s=0.05, max_backoff_s=0.2, stable_s=1.0, max_quick_failures=4)


def python(code: str, log_path):
    """A spawn function: `python -c code`, output appended to log_path."""

    def spawn() -> subprocess.Popen:
        with open(log_path, "ab") as log:
            return subprocess.Popen([sys.executable, "-c", code], stdout=log, stderr=subprocess.STDOUT)

    return spawn


def poll_until(supervisor: Supervisor, predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        supervisor.poll()
        time.sleep(0.01)


def test_a_dead_child_is_restarted_and_the_others_keep_running(tmp_path):
    sup = Supervisor(FAST)
    steady = sup.start("steady", python("import time; time.sleep(60)", tmp_path / "steady.log"), tmp_path / "steady.log")
    victim = sup.start("victim", python("import time; time.sleep(60)", tmp_path / "victim.log"), tmp_path / "victim.log")
    try:
        first_pid, steady_pid = victim.proc.pid, steady.proc.pid
        victim.proc.kill()
        poll_until(sup, lambda: victim.running and victim.proc.pid != first_pid)
        assert victim.restarts == 1 and steady.proc.pid == steady_pid and steady.running
        assert victim.backoff_s == pytest.approx(0.1)  # doubled for the next time
    finally:
        sup.stop(timeout=5)
    assert not victim.running and not steady.running


def test_a_retired_child_drains_exits_and_is_forgotten_not_restarted(tmp_path):
    """What the autoscaler's drain does: SIGTERM one child for good; it finishes its work (here: a
    second of it after the signal) and exits; the supervisor then forgets it."""
    drains = ("import signal, sys, time\n"
              "signal.signal(signal.SIGTERM, lambda *_: (time.sleep(1.0), print('drained', flush=True), sys.exit(0)))\n"
              "time.sleep(60)")
    sup = Supervisor(FAST)
    keep = sup.start("keep", python("import time; time.sleep(60)", tmp_path / "keep.log"), tmp_path / "keep.log")
    leaving = sup.start("leaving", python(drains, tmp_path / "leaving.log"), tmp_path / "leaving.log")
    try:
        time.sleep(0.5)  # its handler is installed
        sup.retire("leaving")
        sup.poll()
        assert sup.has("leaving")  # still draining: it counts until it has exited
        poll_until(sup, lambda: not sup.has("leaving"))
        assert leaving.proc.returncode == 0 and "drained" in (tmp_path / "leaving.log").read_text()
        assert leaving.restarts == 0 and keep.running
        time.sleep(0.3)
        sup.poll()
        assert [c.name for c in sup.children] == ["keep"]
    finally:
        sup.stop(timeout=5)


def test_backoff_doubles_to_its_cap_and_resets_after_a_stable_run(tmp_path):
    clock = [0.0]
    policy = RestartPolicy(initial_backoff_s=0.5, max_backoff_s=2.0, stable_s=10.0, max_quick_failures=100)
    sup = Supervisor(policy, clock=lambda: clock[0])
    log = tmp_path / "c.log"
    child = sup.start("c", python("pass", log), log)
    waits = []
    for _ in range(4):  # exits at once each time: 0.5, 1, 2, 2 s
        child.proc.wait()
        sup.poll()
        waits.append(child.restart_at - clock[0])
        clock[0] = child.restart_at
        sup.poll()  # due: started again
    assert waits == [0.5, 1.0, 2.0, 2.0]
    child.proc.wait()
    clock[0] += 11.0  # this run lasted longer than stable_s: a new incident
    sup.poll()
    assert child.restart_at - clock[0] == 0.5 and child.quick_failures == 1
    sup.stop(timeout=5)


def test_a_child_that_crashes_at_once_is_reported_with_its_error(tmp_path):
    log = tmp_path / "bad.log"
    sup = Supervisor(FAST)
    sup.start("bad", python("import sys; sys.exit('bad flag: --frobnicate')", log), log)
    t0 = time.monotonic()
    with pytest.raises(CrashLoop) as err:
        poll_until(sup, lambda: False)
    assert time.monotonic() - t0 < 5
    assert err.value.name == "bad" and err.value.returncode == 1
    assert "bad flag: --frobnicate" in str(err.value) and "4 times in a row" in str(err.value)
    sup.stop(timeout=5)


def test_stop_goes_stage_by_stage_and_kills_what_ignores_sigterm(tmp_path):
    stopped = tmp_path / "order"
    code = ("import signal, sys, time\n"
            "def bye(*_):\n"
            "    open(sys.argv[1], 'a').write(sys.argv[2] + '\\n'); sys.exit(0)\n"
            "signal.signal(signal.SIGTERM, bye)\n"
            "print('ready', flush=True)\n"
            "time.sleep(60)\n")
    stubborn = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); time.sleep(60)"

    def spawn(name: str, src: str):
        def start() -> subprocess.Popen:
            with open(tmp_path / f"{name}.log", "ab") as log:
                return subprocess.Popen([sys.executable, "-c", src, str(stopped), name], stdout=log,
                                        stderr=subprocess.STDOUT)
        return start

    sup = Supervisor(FAST)
    children = [sup.start(name, spawn(name, src), tmp_path / f"{name}.log", stage=stage)
                for stage, (name, src) in enumerate((("first", code), ("stubborn", stubborn), ("last", code)))]
    for child in children:  # each has installed its handler
        deadline = time.monotonic() + 10
        while b"ready" not in (tmp_path / f"{child.name}.log").read_bytes():
            assert time.monotonic() < deadline
            time.sleep(0.01)
    t0 = time.monotonic()
    sup.stop(timeout=0.5)
    assert stopped.read_text().split() == ["last", "first"]
    assert children[1].proc.returncode == -9 and time.monotonic() - t0 < 5
    assert not any(child.running for child in children)
