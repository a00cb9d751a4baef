"""Where the third-party client tests point: the router before fake P/D nodes (fast,
always), or the suite's real bundle (`vllm`). Shared by the modules that drive clients
nobody here wrote, so each gets both targets from one `bundle` fixture."""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

_ROUTER_TESTS = os.path.join(os.path.dirname(os.path.dirname(__file__)), "router")
if _ROUTER_TESTS not in sys.path:  # the fake P/D nodes (tests/router/fakes.py)
    sys.path.insert(0, _ROUTER_TESTS)


@dataclass(frozen=True)
class Target:
    base_url: str  # ends in /v1
    router_url: str
    model: str
    real: bool


@contextlib.contextmanager
def fake_router() -> Iterator[Target]:
    """The router in front of fake P/D nodes, on its own loop in a thread (so that sync
    clients can call it)."""
    from fakes import router_stack

    loop = asyncio.new_event_loop()
    ready = threading.Event()
    box: dict[str, Any] = {}

    async def main() -> None:
        async with router_stack() as st:
            box["url"], box["stop"] = st.url, asyncio.Event()
            ready.set()
            await box["stop"].wait()

    thread = threading.Thread(target=loop.run_until_complete, args=(main(),), daemon=True)
    thread.start()
    try:
        assert ready.wait(60), "fake router did not start"
        yield Target(f"{box['url']}/v1", box["url"], "fake-model", real=False)
    finally:
        if "stop" in box:
            loop.call_soon_threadsafe(box["stop"].set)
        thread.join(30)
        loop.close()


@pytest.fixture(name="bundle", scope="module", params=[
    "fake", pytest.param("real", marks=[pytest.mark.vllm, pytest.mark.slow])])
def client_bundle(request: pytest.FixtureRequest) -> Iterator[Target]:
    """The router to drive: before fake nodes, or the suite's real bundle."""
    if request.param == "real":
        real = request.getfixturevalue("kvagent_bundle")
        if not real.available:
            pytest.skip(real.reason)
        yield Target(real.base_url, real.router_url, real.model, real=True)
        return
    with fake_router() as target:
        yield target


def reuse_hits(router_url: str) -> float:
    text = httpx.get(f"{router_url}/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith("kvagent_router_reuse_hits_total "):
            return float(line.split()[1])
    return 0.0


def cached_tokens(router_url: str) -> float:
    """Prompt tokens the router served from retained KV so far (all turns)."""
    text = httpx.get(f"{router_url}/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith("kvagent_router_reused_tokens_total "):
            return float(line.split()[1])
    return 0.0


