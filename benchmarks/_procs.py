"""Process helpers shared by the benchmarks that start their own servers."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from collections.abc import Callable

import httpx
from kvagent_server.ports import free_ports  # noqa: F401 - re-exported for the benchmarks


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM the process group, SIGKILL it after 10 s."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


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
