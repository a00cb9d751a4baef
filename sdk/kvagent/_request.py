"""Builds the HTTP request for one turn: URL, headers (session id, cache token) and body."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from . import protocol as proto

__all__ = ["RESERVED_BODY_FIELDS", "ChatRequest", "build_chat_request", "encode_body"]

#: Fields the session owns; extra_body may not replace them (the history would lie).
RESERVED_BODY_FIELDS = frozenset({"messages", "stream"})


@dataclass(frozen=True, slots=True)
class ChatRequest:
    """Everything needed to send one turn, ready for any HTTP client."""

    url: str
    headers: dict[str, str]
    body: bytes
    json: dict[str, Any]


def encode_body(body: Mapping[str, Any]) -> bytes:
    """Compact, deterministic JSON: the same history always gives the same bytes."""
    return json.dumps(body, ensure_ascii=False, separators=(",", ":"),
                      allow_nan=False).encode("utf-8")


def build_chat_request(
    *,
    base_url: str,
    model: str,
    messages: list[dict[str, Any]],
    session_id: str,
    cache_token: str | None,
    tools: list[dict[str, Any]] | None = None,
    tool_choice: str | dict[str, Any] | None = None,
    params: Mapping[str, Any] | None = None,
    extra_body: Mapping[str, Any] | None = None,
    api_key: str | None = None,
    headers: Mapping[str, str] | None = None,
    user_agent: str = "kvagent-python",
) -> ChatRequest:
    """A streaming ``POST {base_url}/chat/completions``.

    ``model`` and ``messages`` come first in the body so each turn's body starts with the
    previous turn's bytes up to the end of its last message.
    """
    body: dict[str, Any] = {"model": model, "messages": messages}
    if tools:
        body["tools"] = tools
        if tool_choice is not None:
            body["tool_choice"] = tool_choice
    elif tool_choice is not None and tool_choice != "none":
        raise ValueError(f"tool_choice={tool_choice!r} needs tools; declare tools on the session")
    for key, value in (params or {}).items():
        if value is not None:
            body[key] = value
    body["stream"] = True
    for key, value in (extra_body or {}).items():
        if key in RESERVED_BODY_FIELDS:
            raise ValueError(f"extra_body may not set {key!r}: the session manages it")
        body[key] = value
    stream_options = body.get("stream_options")
    body["stream_options"] = {**(stream_options if isinstance(stream_options, Mapping) else {}),
                              "include_usage": True}
    out_headers = {
        "Content-Type": "application/json",
        "Accept": "text/event-stream",
        "User-Agent": user_agent,
        proto.SESSION_HEADER: session_id,
    }
    if cache_token:
        out_headers[proto.CACHE_TOKEN_HEADER] = cache_token
    if api_key:
        out_headers["Authorization"] = f"Bearer {api_key}"
    out_headers.update(headers or {})
    return ChatRequest(url=f"{base_url.rstrip('/')}/chat/completions", headers=out_headers,
                       body=encode_body(body), json=body)
