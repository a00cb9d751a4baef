"""Process groups: start a process in its own group, stop the whole group, leave nothing.

vLLM's API server spawns engine-core and worker processes; killing only the pid leaves them
behind holding cores, memory and ports. Every bundle process therefore starts a new session
(its own process group) and carries a marker in its environment (`KVAGENT_RUN_DIR`,
`KVAGENT_PROCESS`) that its children inherit, so a stop can find even a child that left the
group.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import time
from collections.abc import Collection, Iterable, Iterator
from pathlib import Path
from typing import Any

import psutil

RUN_DIR_ENV = "KVAGENT_RUN_DIR"
PROCESS_ENV = "KVAGENT_PROCESS"


def launch(argv: list[str], *, env: dict[str, str], log_path: Path, run_dir: Path, name: str,
           cpu_affinity: Collection[int] | None = None) -> subprocess.Popen[bytes]:
    """Start `argv` in a new session, stdout+stderr appended to `log_path`; with
    `cpu_affinity`, every thread it and its children start runs on those cores."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    full_env = {**os.environ, **env, RUN_DIR_ENV: str(run_dir), PROCESS_ENV: name,
                "PYTHONUNBUFFERED": "1"}
    with open(log_path, "ab") as log:
        log.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} starting {name}: "
                  f"{shlex.join(argv)}\n".encode())
        log.flush()
        with _affinity(cpu_affinity):
            return subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                env=full_env, start_new_session=True, close_fds=True,
            )


@contextlib.contextmanager
def _affinity(cores: Collection[int] | None) -> Iterator[None]:
    """The calling thread on `cores` for the block: a child forked there inherits them.
    (Setting them in the child instead needs `preexec_fn`, unsafe beside threads.)"""
    if not cores:
        yield
        return
    saved = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, cores)
    except OSError as exc:  # a core this machine lacks (an explicit cpu_binds)
        raise OSError(exc.errno, f"cannot run on cores {sorted(cores)}: {exc.strerror}"
                      ) from None
    try:
        yield
    finally:
        os.sched_setaffinity(0, saved)


def create_time(pid: int) -> float | None:
    try:
        return float(psutil.Process(pid).create_time())
    except psutil.Error:
        return None


def is_alive(pid: int | None, created: float | None = None) -> bool:
    """True when `pid` runs (not a zombie) and, if given, was created at `created`
    (guards against pid reuse after a reboot or a long time)."""
    if pid is None:
        return False
    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return False
        return created is None or abs(proc.create_time() - created) < 1.0
    except psutil.Error:
        return False


def marked(run_dir: Path, name: str | None = None) -> list[psutil.Process]:
    """Live processes carrying this run's marker (optionally for one bundle process)."""
    out = []
    want = str(run_dir)
    me = os.getpid()
    for proc in psutil.process_iter(["pid", "status"]):
        if proc.pid == me or proc.info["status"] == psutil.STATUS_ZOMBIE:
            continue
        try:
            env = proc.environ()
        except psutil.Error:
            continue
        if env.get(RUN_DIR_ENV) == want and (name is None or env.get(PROCESS_ENV) == name):
            out.append(proc)
    return out


def group_members(pgid: int) -> list[psutil.Process]:
    out = []
    for proc in psutil.process_iter(["pid", "status"]):
        if proc.info["status"] == psutil.STATUS_ZOMBIE:
            continue
        try:
            if os.getpgid(proc.pid) == pgid:
                out.append(proc)
        except OSError:
            continue
    return out


def _signal_all(pgids: Iterable[int], procs: Iterable[psutil.Process], sig: int) -> None:
    for pgid in pgids:
        try:
            os.killpg(pgid, sig)
        except (ProcessLookupError, PermissionError):
            pass
    for proc in procs:
        try:
            proc.send_signal(sig)
        except psutil.Error:
            pass


def terminate(pgids: list[int], run_dir: Path | None, *, name: str | None = None, grace: float,
              reap: Iterable[subprocess.Popen[Any]] = (),
              sig: int = signal.SIGTERM) -> list[int]:
    """`sig` (SIGTERM) to the groups and every process marked with `run_dir` (none when it
    is None), SIGKILL what is left after `grace`.

    Returns the pids still alive afterwards (empty on success).
    """
    pgids = [g for g in pgids if g > 1 and g != os.getpgid(0)]
    reap = list(reap)

    def alive() -> list[psutil.Process]:
        for p in reap:
            p.poll()
        found = {p.pid: p for g in pgids for p in group_members(g)}
        if run_dir is not None:
            found.update({p.pid: p for p in marked(run_dir, name)})
        return list(found.values())

    left = alive()
    if not left:
        return []
    _signal_all(pgids, left, sig)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        left = alive()
        if not left:
            return []
        time.sleep(0.1)
    for _ in range(3):
        _signal_all(pgids, left, signal.SIGKILL)
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline:
            left = alive()
            if not left:
                return []
            time.sleep(0.05)
    return [p.pid for p in left]


def stop_groups(*procs: subprocess.Popen[Any], grace: float = 10.0,
                sig: int = signal.SIGTERM) -> list[int]:
    """Stop processes started with `start_new_session=True` and everything in their groups
    (vLLM's engine core, a child that outlived its parent): `sig` to each group, SIGKILL
    what is left after `grace`, then reap `procs`. `sig=SIGKILL` is a crash, not a stop.

    Returns the pids still alive afterwards (empty on success).
    """
    left = terminate([p.pid for p in procs], None, grace=grace, reap=procs, sig=sig)
    for p in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(5)  # a leader that exited as the group emptied is not reaped yet
    return left
