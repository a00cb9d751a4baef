"""Fixtures for the bundle launcher tests: free ports and configs that run the fake node."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from support import FAKE_NODE, free_ports

from .bundle_helpers import processes_mentioning


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
        "topology": "pd",
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
