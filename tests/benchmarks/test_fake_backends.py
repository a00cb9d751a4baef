"""The benchmarks' fake P/D backends run as modules from the repository root and reach
`tests/fakes/nodes.py` through `benchmarks/_fakes.py` alone (no `sys.path` edit)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from kvagent_server.bundle.processes import stop_groups
from kvagent_server.common.ports import free_port

from benchmarks.api import wait_ready

ROOT = Path(__file__).resolve().parents[2]
#: The interpreter's path as `./dev` sets it up: the two packages, not the tests' folders.
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "sdk"), str(ROOT / "server")])}


def test_the_fakes_are_one_module_with_the_tests() -> None:
    code = ("import sys; from benchmarks._fakes import FakeCluster; import fakes; "
            "assert fakes.FakeCluster is FakeCluster, 'two modules'; "
            "assert not any(p.endswith('router') for p in sys.path), sys.path")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=ENV, check=True, timeout=60)


@pytest.mark.parametrize("module", ["tools.attack.backend", "benchmarks.load.backend",
                                    "benchmarks.router_overhead.fake_backend"])
def test_backend_serves_both_nodes(module: str, tmp_path: Path) -> None:
    p_port, d_port = free_port(), free_port()
    log = tmp_path / "backend.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", module, str(p_port), str(d_port)],
                                cwd=ROOT, env=ENV, start_new_session=True, stdout=out,
                                stderr=subprocess.STDOUT)
    try:
        for port in (p_port, d_port):
            asyncio.run(wait_ready(f"http://127.0.0.1:{port}/health", timeout=60))
        models = httpx.get(f"http://127.0.0.1:{d_port}/v1/models", timeout=10).json()
        assert models["data"], models
    except Exception as exc:
        raise AssertionError(log.read_text()[-3000:]) from exc
    finally:
        stop_groups(proc)
