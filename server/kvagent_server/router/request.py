"""The client's request: parsing, validation, session and token, OpenAI-shaped errors.

Everything here runs before any node is contacted; a request that fails here never
reaches vLLM.
"""

from __future__ import annotations

import json
from typing import Any

from kvagent._protocol import (
    BODY_CACHE_TOKEN,
    BODY_FIELD,
    BODY_SESSION_ID,
    CACHE_TOKEN_HEADER,
    CONVERSATION_ID_ALIAS,
    MAX_TOKEN_BYTES,
    SESSION_HEADER,
    valid_session_id,
)
from starlette.requests import Request
from starlette.responses import JSONResponse

#: Body fields a client must not set: they would make a node pull or push KV blocks the
#: router did not vet (another tenant's, say). `cache_salt` is always the tenant's.
CLIENT_FORBIDDEN = ("kv_transfer_params", "ec_transfer_params")

class HTTPError(Exception):
    """An error answered to the client in OpenAI's error format."""

    def __init__(self, status: int, message: str, *, type_: str = "invalid_request_error",
                 code: str | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = (
            status, message, type_, code, param)

    def response(self) -> JSONResponse:
        resp = error_response(self.status, self.message, type_=self.type, code=self.code,
                              param=self.param)
        if self.status == 429:
            resp.headers["Retry-After"] = "1"
        return resp


def error_response(status: int, message: str, *, type_: str = "invalid_request_error",
                   code: str | None = None, param: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": type_, "param": param,
                                   "code": code if code is not None else status}},
                        status_code=status)


class ClientGone(Exception):
    """The client disconnected before its response started."""


async def read_json(request: Request, limit: int) -> dict[str, Any]:
    """The request body as a JSON object: 413 over `limit` bytes, 400 when malformed."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise HTTPError(413, f"request body exceeds {limit} bytes", code="body_too_large")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise HTTPError(413, f"request body exceeds {limit} bytes", code="body_too_large")
        chunks.append(chunk)
    try:
        body = json.loads(b"".join(chunks))
    except (ValueError, UnicodeDecodeError) as exc:
        raise HTTPError(400, f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise HTTPError(400, "request body must be a JSON object")
    return body


def validate(body: dict[str, Any], *, chat: bool) -> None:
    """The checks the router itself needs; vLLM validates the rest and answers 400."""
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise HTTPError(400, "'messages' must be a non-empty list", param="messages")
        if not all(isinstance(m, dict) for m in messages):
            raise HTTPError(400, "every message must be an object", param="messages")
    elif "prompt" not in body:
        raise HTTPError(400, "'prompt' is required", param="prompt")
    if "stream" in body and not isinstance(body["stream"], bool | None):
        raise HTTPError(400, "'stream' must be a boolean", param="stream")
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise HTTPError(400, "'stream_options' must be an object", param="stream_options")
    for name in ("n", "max_tokens", "max_completion_tokens"):
        value = body.get(name)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                  or value < (0 if name != "n" else 1)):
            raise HTTPError(400, f"'{name}' must be a positive integer", param=name)


def session_and_token(headers: Any, body: dict[str, Any]) -> tuple[str | None, str | None]:
    """Session id and cache token: headers, then the body `kvagent` object, then
    `conversation_id`. The body forms are removed from `body` (vLLM must not see them)."""
    extra = body.pop(BODY_FIELD, None)
    alias = body.pop(CONVERSATION_ID_ALIAS, None)
    if extra is not None and not isinstance(extra, dict):
        raise HTTPError(400, f"'{BODY_FIELD}' must be an object", param=BODY_FIELD)
    extra = extra or {}
    session = (headers.get(SESSION_HEADER) or extra.get(BODY_SESSION_ID)
               or (alias if alias is not None else None))
    token = headers.get(CACHE_TOKEN_HEADER) or extra.get(BODY_CACHE_TOKEN)
    if session is not None and (not isinstance(session, str) or not valid_session_id(session)):
        raise HTTPError(400, "session id must be 1-128 characters of [A-Za-z0-9._:-]",
                        param=SESSION_HEADER)
    if token is not None and (not isinstance(token, str) or not token):
        token = None
    if token is not None and len(token.encode()) > MAX_TOKEN_BYTES:
        token = "x"  # over-long: rejected as malformed, the turn is recomputed
    return session, token
