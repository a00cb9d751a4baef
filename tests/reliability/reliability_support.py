"""Helpers shared by the reliability tests (leak scan, error shape, hypothesis bridge)."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from fakes import Stack

T = TypeVar("T")

#: Field names and markers that are internal to P/D and must never reach a client.
INTERNAL_NEEDLES = ("kv_transfer_params", "remote_", "do_remote", "prompt_token_ids",
                    "engine-", "transfer_mode", "cache_salt", "ec_transfer_params",
                    "127.0.0.1", "10.66.")


def leaks(stack: Stack, raw: bytes | str, *, allow_token_ids: bool = False) -> list[str]:
    """Internal strings found in `raw` (every byte the client received)."""
    text = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw
    # The fields vLLM itself writes as `null` when nothing was asked or transferred.
    text = re.sub(r'"(kv_transfer_params|ec_transfer_params|prompt_token_ids|token_ids)":'
                  r"\s*null", "", text)
    found = [n for n in INTERNAL_NEEDLES if n in text]
    if not allow_token_ids and "token_ids" in text:
        found.append("token_ids")
    for secret in stack.internal_strings():
        if re.search(rf"(?<![0-9A-Za-z]){re.escape(secret)}(?![0-9A-Za-z])", text):
            found.append(secret)
    return found


def is_openai_error(body: Any) -> bool:
    """`{"error": {"message": str, "type": str, "param": ..., "code": ...}}`."""
    err = body.get("error") if isinstance(body, dict) else None
    return (isinstance(err, dict) and isinstance(err.get("message"), str)
            and bool(err["message"]) and isinstance(err.get("type"), str)
            and "code" in err and "param" in err)


class LoopBridge:
    """Runs a synchronous hypothesis test body in a worker thread while the test's event
    loop keeps serving the stack; `bridge(coro)` hands each example's coroutine back to
    that loop and waits for it. (One stack for all examples: starting uvicorn servers per
    example would dominate the run.)"""

    loop: asyncio.AbstractEventLoop

    def __call__(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(120)

    async def start(self, fn: Callable[[], None]) -> None:
        self.loop = asyncio.get_running_loop()
        await asyncio.to_thread(fn)
