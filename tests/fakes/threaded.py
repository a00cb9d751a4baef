"""The router with fake P/D nodes (`fakes.nodes`), served from a background thread.

For tests whose code under test is synchronous (the SDK's `Session`, the framework
adapters, the documentation's examples): the stack's event loop runs in its own thread
while the test calls it over real HTTP on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from fakes.nodes import Stack, router_stack

MODEL = "fake-model"


@contextmanager
def threaded_router_stack(**kwargs: Any) -> Iterator[Stack]:
    """`router_stack(**kwargs)` running in a thread; yields the `Stack` (`.url`)."""
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    box: dict[str, Any] = {}
    stop = asyncio.Event()

    async def main() -> None:
        try:
            async with router_stack(**kwargs) as stack:
                box["stack"] = stack
                ready.set()
                await stop.wait()
        except BaseException as exc:  # noqa: BLE001 - reported to the waiting test
            box["error"] = exc
            ready.set()

    thread = threading.Thread(target=loop.run_until_complete, args=(main(),),
                              name="fake-router-stack", daemon=True)
    thread.start()
    try:
        if not ready.wait(60):
            raise TimeoutError("the fake router stack did not start in 60 s")
        if "error" in box:
            raise box["error"]
        yield box["stack"]
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(30)
        if not thread.is_alive():
            loop.close()
