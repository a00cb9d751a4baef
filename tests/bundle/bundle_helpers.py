"""Helpers for the bundle launcher tests (fixtures live in conftest.py)."""

from __future__ import annotations

import sys

import psutil
from kvagent_server.bundle.render import HostFacts, ModelSource, PlanInputs


def fake_inputs(cores: tuple[int, ...] = (0, 1), gpus: int = 0) -> PlanInputs:
    return PlanInputs(host=HostFacts(cpu_cores=cores, gpu_count=gpus),
                      model=ModelSource(model="/models/m", served_name="m"),
                      python=sys.executable)


def processes_mentioning(text: str) -> list[psutil.Process]:
    """Live processes whose command line or environment mentions `text`."""
    out = []
    for proc in psutil.process_iter(["pid", "cmdline", "status"]):
        if proc.info["status"] == psutil.STATUS_ZOMBIE:
            continue
        try:
            blob = " ".join(proc.info["cmdline"] or [])
            if text in blob or any(text in v for v in proc.environ().values()):
                out.append(proc)
        except psutil.Error:
            continue
    return out
