"""The run directory's state file: what is running, where, and how it has fared.

Written by the supervisor (`supervisor.Bundle`) on every change, read by `status`, `down` and a
detached `up` waiting for its daemon. Atomic writes (rename), so readers never see half.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, ValidationError

STATE_FILE = "state.json"
CONFIG_FILE = "config.json"
SUPERVISOR_LOG = "supervisor.log"
LOG_DIR = "logs"

ProcStatus = Literal[
    "pending",  # not launched yet (the router waits for the nodes)
    "starting",  # launched, /health not 200 yet
    "healthy",  # /health answered 200
    "restarting",  # exited unexpectedly; relaunch scheduled
    "failed",  # exited and out of restarts, or never became healthy
    "stopped",  # stopped on purpose
]
Phase = Literal["starting", "running", "stopping", "stopped", "failed"]


class ProcState(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str
    role: str
    url: str
    health_url: str
    port: int
    side_channel_port: int | None = None
    engine_id: str | None = None
    cpu_bind: str | None = None
    cuda_device: str | None = None
    log: str
    status: ProcStatus = "pending"
    pid: int | None = None
    pid_create_time: float | None = None
    restarts: int = 0
    exit_code: int | None = None
    started_at: float | None = None
    healthy_at: float | None = None
    last_event: str | None = None


class RunState(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str
    run_dir: str
    device: str
    topology: str = "pd"  # state files written before topologies existed ran P/D
    topology_reason: str = ""
    phase: Phase = "starting"
    supervisor_pid: int
    supervisor_create_time: float | None = None
    started_at: float
    updated_at: float
    router_url: str | None = None
    model: str
    error: str | None = None
    processes: list[ProcState]

    def proc(self, name: str) -> ProcState:
        for p in self.processes:
            if p.name == name:
                return p
        raise KeyError(name)


def restart_delay(restarts_so_far: int, limit: int) -> float | None:
    """Seconds to wait before relaunching a process that exited, or None to give up.

    Backoff 1, 2, 4 … 30 s keeps a crash-looping node from hogging the machine.
    """
    if restarts_so_far >= limit:
        return None
    return float(min(2**restarts_so_far, 30))


def save_state(run_dir: Path, state: RunState) -> None:
    state.updated_at = time.time()
    run_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".state-", dir=run_dir)
    with os.fdopen(fd, "w") as f:
        f.write(state.model_dump_json(indent=2))
    os.replace(tmp, run_dir / STATE_FILE)


def load_state(run_dir: Path) -> RunState | None:
    """The state in `run_dir`, or None when there is none (or it is unreadable)."""
    try:
        return RunState.model_validate(json.loads((run_dir / STATE_FILE).read_text()))
    except (OSError, ValueError, ValidationError):
        return None
