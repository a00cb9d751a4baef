"""The detached supervisor: start it, find out how it is doing, stop it and its bundle.

`kvagent-server up --detach` runs the supervisor (`python -m kvagent_server.bundle.supervisor`) as
a daemon in its own session; `down` stops it and anything left of the bundle. The daemon
reports through the run directory's state file (`runstate`); processes are found by the
markers every bundle process carries (`processes`), so a stop never misses a child.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from kvagent_server.bundle import processes
from kvagent_server.bundle.runstate import (
    CONFIG_FILE,
    SUPERVISOR_LOG,
    RunState,
    load_state,
    save_state,
)
from kvagent_server.bundle.supervisor import write_private
from kvagent_server.config import BundleConfig, dump_config


def start(cfg: BundleConfig) -> subprocess.Popen[bytes]:
    """Write the config (owner-only: it may hold keys) and start the supervisor daemon."""
    run_dir = cfg.resolved_run_dir()
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg_path = run_dir / CONFIG_FILE
    write_private(cfg_path, json.dumps(dump_config(cfg), indent=2))
    with open(run_dir / SUPERVISOR_LOG, "ab") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "kvagent_server.bundle.supervisor", "--config", str(cfg_path)],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True, close_fds=True,
        )


def state_of(run_dir: Path, daemon: subprocess.Popen[bytes]) -> RunState | None:
    """The run's state, if it is this daemon's (not a previous run's leftover file)."""
    state = load_state(run_dir)
    return state if state is not None and state.supervisor_pid == daemon.pid else None


def log_tail(run_dir: Path, lines: int = 15) -> list[str]:
    """The last lines of the supervisor's log (for a failed start)."""
    return (run_dir / SUPERVISOR_LOG).read_text(errors="replace").splitlines()[-lines:]


def stop_supervisor(pid: int, created: float | None, grace: float) -> bool:
    """SIGTERM the supervisor and wait for it to stop its processes; True if it exited."""
    if not processes.is_alive(pid, created):
        return True
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return True
    deadline = time.monotonic() + grace * 4 + 30
    while time.monotonic() < deadline:
        if not processes.is_alive(pid, created):
            return True
        time.sleep(0.2)
    return False


def stop_bundle(run_dir: Path, grace: float) -> list[int] | None:
    """Stop the supervisor, then every process group and marked process left; mark the
    state stopped. Returns the pids that survived, or None when nothing was running."""
    state = load_state(run_dir)
    leftovers = processes.marked(run_dir)
    if state is None and not leftovers:
        return None
    if state is not None:
        stop_supervisor(state.supervisor_pid, state.supervisor_create_time, grace)
    pgids = [p.pid for p in (state.processes if state else []) if p.pid]
    survivors = processes.terminate(pgids, run_dir, grace=grace)
    state = load_state(run_dir)
    if state is not None and state.phase != "stopped":
        state.phase = "stopped"
        for p in state.processes:
            if p.status != "pending":
                p.status = "stopped"
        save_state(run_dir, state)
    return survivors
