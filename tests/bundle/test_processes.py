"""`processes.stop_groups`: a process started in its own session is stopped with its whole
group, children that ignore SIGTERM or outlive their parent included, and is reaped."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import psutil
from kvagent_server.bundle.processes import stop_groups

#: A child that ignores SIGTERM (as a stuck engine core would) and then prints its pid.
CHILD = ("import os, signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
         "print(os.getpid(), flush=True); time.sleep(600)")
#: A group leader that starts CHILD in its group, then exits (argv[1] "exit"), ignores
#: SIGTERM ("ignore") or waits for it ("term").
LEADER = f"""
import signal, subprocess, sys, time
if sys.argv[1] == "ignore":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
subprocess.Popen([sys.executable, "-c", {CHILD!r}])
if sys.argv[1] == "exit":
    sys.exit(0)
time.sleep(600)
"""


def _start(mode: str = "term") -> tuple[subprocess.Popen[str], int]:
    proc = subprocess.Popen([sys.executable, "-c", LEADER, mode], stdout=subprocess.PIPE,
                            text=True, start_new_session=True)
    assert proc.stdout is not None
    return proc, int(proc.stdout.readline())


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_the_child_that_ignores_sigterm_is_killed_after_the_grace() -> None:
    proc, child = _start()
    started = time.monotonic()
    assert stop_groups(proc, grace=1.0) == []
    assert time.monotonic() - started >= 1.0  # the child had its grace before the SIGKILL
    assert proc.returncode == -signal.SIGTERM
    assert not _alive(child)


def test_a_child_left_by_a_leader_that_exited_is_stopped() -> None:
    proc, child = _start("exit")
    proc.wait(30)
    assert _alive(child)
    assert stop_groups(proc, grace=0.5) == []
    assert not _alive(child)


def test_sigkill_first_is_a_crash_without_a_grace() -> None:
    proc, child = _start("ignore")
    started = time.monotonic()
    assert stop_groups(proc, grace=60.0, sig=signal.SIGKILL) == []
    assert time.monotonic() - started < 30.0
    assert proc.returncode == -signal.SIGKILL
    assert not _alive(child)


def test_several_groups_at_once_and_a_second_stop_is_a_no_op() -> None:
    started = [_start() for _ in range(2)]
    procs = [proc for proc, _ in started]
    assert stop_groups(*procs, grace=0.5) == []
    assert all(p.returncode is not None for p in procs)
    assert not any(_alive(child) for _, child in started)
    assert stop_groups(*procs) == []
