"""Limits that protect the router and the nodes from hostile or broken clients.

Two ASGI-level guards the route handlers cannot express themselves, and the handlers'
own admission count (`Admission`):

- `HeaderLimit`: a request whose request line and headers exceed `max_header_bytes` (or
  `max_header_count` lines) gets a 431 before any handler runs. The router's own server
  (`http.server`) enforces both while the head arrives; this is the second line, for any
  other ASGI server the app is run under.
- `GuardedStream`: a streamed response whose client stops reading. Writes block once the
  socket's buffers are full; after `write_timeout_s` without progress the stream is
  abandoned and its body iterator closed, which closes the decode leg (vLLM aborts the
  request) so a stalled reader never holds a node.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from typing import Any

from starlette.responses import StreamingResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger("kvagent.router.limits")


class SlowClient(Exception):
    """The client accepted no bytes for the write timeout."""


class HeaderLimit:
    """Answer 431 (OpenAI error body) to requests with oversized request lines or headers."""

    def __init__(self, app: ASGIApp, max_header_bytes: int,
                 max_header_count: int | None = None) -> None:
        self.app = app
        self.max_header_bytes = max_header_bytes
        self.max_header_count = max_header_count

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            size = len(scope.get("raw_path") or b"") + len(scope.get("query_string") or b"")
            size += sum(len(k) + len(v) + 4 for k, v in scope.get("headers") or ())
            if size > self.max_header_bytes:
                await _error(send, 431, f"request headers exceed {self.max_header_bytes} bytes",
                             "headers_too_large")
                return
            count = self.max_header_count
            if count is not None and len(scope.get("headers") or ()) > count:
                await _error(send, 431, f"more than {count} headers", "too_many_headers")
                return
        await self.app(scope, receive, send)


async def _error(send: Send, status: int, message: str, code: str) -> None:
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error",
                                 "param": None, "code": code}}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})


class GuardedStream(StreamingResponse):
    """A `StreamingResponse` whose every write must complete within `write_timeout_s`.

    On a stalled write the body iterator is closed (its `finally` releases the legs) and
    `on_stall` runs; the connection is then left for the server to close. uvicorn logs
    "ASGI callable returned without completing response" for it: the response was cut.
    """

    def __init__(self, *args: Any, write_timeout_s: float,
                 on_stall: Callable[[], None] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.write_timeout_s = write_timeout_s
        self.on_stall = on_stall

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """starlette's ASGI < 2.4 behaviour (stream, and stop at the client's disconnect)
        in plain asyncio: one watcher task that cancels this one, instead of an anyio task
        group and its cancel scopes on every request."""
        if scope["type"] != "http":
            await super().__call__(scope, receive, send)
            return
        current = asyncio.current_task()
        assert current is not None
        gone = False

        async def watch() -> None:
            nonlocal gone
            await self.listen_for_disconnect(receive)
            gone = True
            current.cancel()

        watcher = asyncio.ensure_future(watch())
        try:
            await self.stream_response(send)
        except asyncio.CancelledError:
            if not gone or current.uncancel() > 0:
                raise  # cancelled from outside (shutdown), not by the disconnect
        finally:
            if not watcher.done():
                watcher.cancel()
        if self.background is not None:
            await self.background()

    async def stream_response(self, send: Send) -> None:
        async def timed_send(message: Message) -> None:
            # `asyncio.timeout` (a timer, no task per chunk): cheap enough for every chunk.
            try:
                async with asyncio.timeout(self.write_timeout_s):
                    await send(message)
            except TimeoutError:
                raise SlowClient from None

        try:
            await super().stream_response(timed_send)
        except SlowClient:
            log.warning("client stopped reading for %.1f s: stream cut, legs released",
                        self.write_timeout_s)
            if self.on_stall is not None:
                self.on_stall()
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()


class Admission:
    """Requests in flight per tenant (each tenant's `max_concurrent_streams`) and per
    client address (`max_streams_per_client`). Two separate counts, so a tenant named
    like an address never shares one's slots."""

    def __init__(self, max_per_client: int) -> None:
        self.max_per_client = max_per_client
        self.tenants: dict[str, int] = {}
        #: Addresses with requests in flight only (an idle one has no entry).
        self.clients: dict[str, int] = {}

    def admit(self, tenant: str, tenant_cap: int, client: str) -> AdmissionSlot:
        """A slot for one request, or `Refused` naming which cap is full."""
        if self.tenants.get(tenant, 0) >= tenant_cap:
            raise Refused(f"tenant has {tenant_cap} requests in flight; retry later")
        if self.clients.get(client, 0) >= self.max_per_client:
            raise Refused(f"this client has {self.max_per_client} requests in flight; "
                          "retry later")
        self.tenants[tenant] = self.tenants.get(tenant, 0) + 1
        self.clients[client] = self.clients.get(client, 0) + 1
        return AdmissionSlot(self, tenant, client)


class Refused(Exception):
    """A request over its tenant's or its client's cap (HTTP 429)."""


class AdmissionSlot:
    """One admitted request; `release` (idempotent) frees its slots."""

    def __init__(self, admission: Admission, tenant: str, client: str) -> None:
        self._admission: Admission | None = admission
        self.tenant = tenant
        self.client = client

    def release(self) -> bool:
        """Whether this call freed the slots (False: an earlier one did)."""
        a, self._admission = self._admission, None
        if a is None:
            return False
        a.tenants[self.tenant] -= 1
        if a.clients[self.client] <= 1:
            del a.clients[self.client]
        else:
            a.clients[self.client] -= 1
        return True
