"""Process helpers shared by the benchmarks that start their own servers."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
from kvagent_server.common.ports import free_port, free_ports  # noqa: F401 - re-exported


def signal_until_gone(find: Callable[[], list[int]], *, grace_s: float,
                      say: Callable[[str], None] | None = None) -> list[int]:
    """SIGTERM the processes `find` lists, wait up to `grace_s` for them to go, then SIGKILL
    what is left (5 s); returns the pids `find` still lists at the end."""
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        pids = find()
        if not pids:
            return []
        if say is not None:
            say(f"cleanup: {signal.Signals(sig).name} {pids}")
        for pid in pids:
            try:
                os.kill(pid, sig)
            except OSError:  # gone already, or not ours to signal
                pass
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and find():
            time.sleep(0.1)
    return find()


async def wait_ready(url: str, timeout: float = 60, interval: float = 0.1) -> None:
    """Poll `url` until it answers 200, or raise after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient() as c:
        while time.monotonic() < deadline:
            try:
                if (await c.get(url, timeout=2)).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            await asyncio.sleep(interval)
    raise RuntimeError(f"{url} not ready")


@contextlib.contextmanager
def router_over(prefill: Sequence[str], decode: Sequence[str], settings: dict[str, Any],
                config_path: Path, *, timeout_s: float = 60) -> Iterator[str]:
    """A router (`python -m kvagent_server.router`) in front of running nodes, with its own
    `settings` (written to `config_path`) and store; yields its URL once it is ready, and
    stops it on exit."""
    from kvagent_server.bundle.supervisor import probe

    config_path.write_text(json.dumps({"router": settings}))
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvagent_server.router", "--port", str(port),
         "--prefill", *prefill, "--decode", *decode, "--settings", str(config_path),
         "--log-level", "warning"])
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while not probe(f"{url}/ready"):
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError(f"the router on {url} did not start")
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
