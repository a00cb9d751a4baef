"""The `x-request-id` every response carries (ASGI middleware)."""

from __future__ import annotations

import uuid

from starlette.types import ASGIApp, Message, Receive, Scope, Send

REQUEST_ID_HEADER = b"x-request-id"


class RequestIdHeader:
    """Every response carries `x-request-id`, as vLLM's server's does when started with
    `--enable-request-id-headers` (its `XRequestIdMiddleware`): the request's own
    `X-Request-Id` echoed, else a fresh uuid4 hex. So `result.request_id` (SDK) and
    openai-python's `_request_id` are set through the router.

    Only the client sees it: the nodes are sent no request id and name each request
    themselves (see `http.request.CLIENT_DROPPED`). Inside `HeaderLimit`, so a 431 for an
    oversized head echoes nothing back.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = next((v for k, v in scope.get("headers") or () if k == REQUEST_ID_HEADER),
                   None) or uuid.uuid4().hex.encode()

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*(message.get("headers") or ()), (REQUEST_ID_HEADER, rid)]
            await send(message)

        await self.app(scope, receive, send_with_id)
