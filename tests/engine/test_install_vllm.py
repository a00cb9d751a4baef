"""`kvagent_server.engine.install` with the CPU engine already installed does nothing."""

from __future__ import annotations

import subprocess
import sys

import pytest
from kvagent_server.engine import install


@pytest.mark.vllm
def test_installed_engine_is_a_fast_noop() -> None:
    if install.problems("cpu"):
        pytest.skip(f"the CPU engine is not (fully) installed: {install.problems('cpu')}")
    proc = subprocess.run([sys.executable, "-m", "kvagent_server.engine.install"], check=False,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "nothing to do" in proc.stdout
    assert "pip" not in proc.stdout  # no pip run at all
