"""A task that runs one round every few seconds and outlives any failed round."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any


class Periodic:
    """Runs `round()` every `interval_s` between `start()` and `stop()`.

    A round that raises is logged (on `log`, as `what`) and the next one runs on time: a
    health checker or a retention guard must not die of one bad reading."""

    def __init__(self, round_: Callable[[], Awaitable[Any]], *, interval_s: float,
                 name: str, log: logging.Logger, what: str) -> None:
        self._round = round_
        self.interval_s = interval_s
        self._name, self._log, self._what = name, log, what
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._loop(), name=self._name)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _loop(self) -> None:
        while True:
            try:
                await self._round()
            except Exception:  # noqa: BLE001 - see the class docstring
                self._log.exception("%s failed", self._what)
            await asyncio.sleep(self.interval_s)
