"""Helpers for the SDK tests: recorded SSE fixtures served through ``httpx.MockTransport``.

(Not named conftest: tests/ has no packages, and module names must be unique.)
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx

DATA = Path(__file__).parent / "data"
BASE_URL = "http://kvagent.test/v1"
MODEL = "kvagent-demo"


def sse(name: str) -> bytes:
    """The bytes of a recorded stream under tests/sdk/data/."""
    return (DATA / name).read_bytes()


class Chunks(httpx.SyncByteStream, httpx.AsyncByteStream):
    """A response body delivered in the given pieces, optionally failing after them."""

    def __init__(self, pieces: list[bytes], fail: Exception | None = None) -> None:
        self.pieces = pieces
        self.fail = fail
        self.closed = False

    def __iter__(self) -> Iterator[bytes]:
        yield from self.pieces
        if self.fail is not None:
            raise self.fail

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for piece in self.pieces:
            yield piece
        if self.fail is not None:
            raise self.fail

    def close(self) -> None:
        self.closed = True

    async def aclose(self) -> None:
        self.closed = True


def stream_response(body: bytes, *, split: int | None = None, fail: Exception | None = None,
                    headers: dict[str, str] | None = None) -> httpx.Response:
    """A 200 event stream; ``split`` cuts the bytes into pieces of that size."""
    pieces = [body[i:i + split] for i in range(0, len(body), split)] if split else [body]
    return httpx.Response(200, headers={"content-type": "text/event-stream", **(headers or {})},
                          stream=Chunks(pieces, fail))


def error_response(status: int, message: str, headers: dict[str, str] | None = None
                   ) -> httpx.Response:
    body = {"error": {"message": message, "type": "Error", "param": None, "code": status}}
    return httpx.Response(status, json=body, headers=headers)


Reply = httpx.Response | Exception | Callable[[httpx.Request], httpx.Response]


class FakeServer:
    """Replays queued replies in order and records every request it saw."""

    def __init__(self, *replies: Reply) -> None:
        self.replies: deque[Reply] = deque(replies)
        self.requests: list[httpx.Request] = []

    def queue(self, *replies: Reply) -> None:
        self.replies.extend(replies)

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        if not self.replies:
            raise AssertionError(f"unexpected request {request.method} {request.url}")
        reply = self.replies.popleft()
        if isinstance(reply, Exception):
            raise reply
        if callable(reply) and not isinstance(reply, httpx.Response):
            return reply(request)
        return reply

    @property
    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self)

    def body(self, index: int = -1) -> dict[str, Any]:
        return json.loads(self.requests[index].content)


def messages_prefix(body: bytes) -> bytes:
    """The body bytes up to, not including, the closing bracket of the messages list."""
    parsed = json.loads(body)
    head = b'{"model":' + json.dumps(parsed["model"]).encode() + b',"messages":'
    listed = json.dumps(parsed["messages"], ensure_ascii=False, separators=(",", ":")).encode()
    assert body.startswith(head + listed)
    return head + listed[:-1]
