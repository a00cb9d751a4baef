"""Fixtures for the bundle launcher tests: free ports and configs that run the fake node."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from kvagent_server.render import HostFacts, ModelSource, PlanInputs
from support import free_ports

FAKE_NODE = Path(__file__).with_name("fake_node.py")



def fake_inputs(cores: tuple[int, ...] = (0, 1), gpus: int = 0) -> PlanInputs:
    return PlanInputs(host=HostFacts(cpu_cores=cores, gpu_count=gpus),
                      model=ModelSource(model="/models/m", served_name="m"),
                      python=sys.executable)


@pytest.fixture
def fake_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """A 1 P + 1 D + router bundle config whose processes are the fake node, free ports.

    Every fake process records its argv and environment under `tmp_path/records`.
    """
    p, d, ps, ds, r = free_ports(5)
    record = tmp_path / "records"
    record.mkdir()
    monkeypatch.setenv("FAKE_RECORD_DIR", str(record))
    fake = [sys.executable, str(FAKE_NODE)]
    return {
        "name": "fake",
        "model": "/models/fake",  # never loaded: keeps the CLI from building the demo model
        "run_dir": str(tmp_path / "run"),
        "engine_command": fake,
        "router_command": fake,
        "prefill": {"ports": [p], "side_channel_ports": [ps], "extra_env": {}},
        "decode": {"ports": [d], "side_channel_ports": [ds], "extra_env": {}},
        "router": {"port": r},
        "stop_grace_s": 2.0,
        "startup_timeout_s": 30.0,
    }


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


@pytest.fixture
def no_leftovers(tmp_path: Path) -> Iterator[None]:
    """Fail the test if any process mentioning its tmp dir is alive at the end (and kill it)."""
    yield
    left = processes_mentioning(str(tmp_path))
    for proc in left:
        try:
            proc.kill()
        except psutil.Error:
            pass
    assert not left, f"processes left behind: {[p.info['cmdline'] for p in left]}"
