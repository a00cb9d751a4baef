"""One measured streaming request: raw httpx, so every timestamp is the benchmark's own.

`StreamMeter` is the I/O-free part (fed parsed chunks with their arrival times);
`stream_chat` only sends the request and feeds it lines.
"""

from __future__ import annotations

import itertools
import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
from kvagent.protocol import BODY_FIELD, CACHE_TOKEN_HEADER, SESSION_HEADER
from kvagent_server.router.telemetry.budget import parse_server_timing


@dataclass
class StreamMeter:
    """Accumulates one streamed chat completion. Times are seconds since the request was
    sent (the caller's clock)."""

    first_chunk_s: float | None = None
    first_choice_s: float | None = None  # first chunk carrying a choice (role/empty too)
    first_token_s: float | None = None  # first content, reasoning or tool-call delta
    token_times: list[float] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    usage: dict[str, Any] | None = None
    kvagent: dict[str, Any] | None = None
    done: bool = False
    error: str | None = None

    def feed_line(self, line: str, t: float) -> None:
        """One SSE line (`data: ...`); comments, blank and other fields are ignored."""
        if not line.startswith("data:"):
            return
        data = line[5:].strip()
        if data == "[DONE]":
            self.done = True
            return
        try:
            chunk = json.loads(data)
        except json.JSONDecodeError:
            self.error = f"malformed chunk: {data[:200]}"
            return
        self.feed_chunk(chunk, t)

    def feed_chunk(self, chunk: dict[str, Any], t: float) -> None:
        if self.first_chunk_s is None:
            self.first_chunk_s = t
        if "error" in chunk and not chunk.get("choices"):
            err = chunk["error"]
            self.error = err.get("message", str(err)) if isinstance(err, dict) else str(err)
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        if isinstance(chunk.get(BODY_FIELD), dict):
            self.kvagent = chunk[BODY_FIELD]
        choices = chunk.get("choices") or []
        if choices and self.first_choice_s is None:
            self.first_choice_s = t
        carried = False
        for choice in choices:
            delta = choice.get("delta") or {}
            content = delta.get("content")
            if content:
                self.text.append(content)
                carried = True
            if delta.get("tool_calls") or delta.get("reasoning_content") or delta.get(
                    "reasoning"):
                carried = True
        if carried:
            if self.first_token_s is None:
                self.first_token_s = t
            self.token_times.append(t)

    @property
    def ttft_s(self) -> float | None:
        """First token-bearing delta; a stream whose answer is empty counts its first choice."""
        return self.first_token_s if self.first_token_s is not None else self.first_choice_s

    @property
    def itl_s(self) -> list[float]:
        ts = self.token_times
        return [b - a for a, b in itertools.pairwise(ts)]

    def tpot_s(self, completion_tokens: int | None) -> float | None:
        ts = self.token_times
        if not ts or not completion_tokens or completion_tokens < 2:
            return None
        return (ts[-1] - ts[0]) / (completion_tokens - 1)

    @property
    def answer(self) -> str:
        return "".join(self.text)

    def cached_tokens(self) -> int | None:
        details = (self.usage or {}).get("prompt_tokens_details") or {}
        value = details.get("cached_tokens")
        return int(value) if value is not None else None


@dataclass
class TurnResult:
    meter: StreamMeter
    e2e_s: float
    status: int | None
    error: str | None
    headers_s: float | None = None  # response headers received
    #: The router's `Server-Timing` stages (seconds; empty: no router or the header is off).
    stages_s: dict[str, float] = field(default_factory=dict)


def chat_body(model: str, messages: list[dict], tools: list[dict], max_tokens: int
              ) -> dict[str, Any]:
    """The request every configuration gets: greedy, short, streamed with usage."""
    body: dict[str, Any] = {
        "model": model, "messages": messages, "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": max_tokens, "temperature": 0.0,
    }
    if tools:
        body["tools"] = tools
    return body


def session_headers(session_id: str, cache_token: str | None) -> dict[str, str]:
    headers = {SESSION_HEADER: session_id}
    if cache_token:
        headers[CACHE_TOKEN_HEADER] = cache_token
    return headers


async def stream_chat(client: httpx.AsyncClient, url: str, body: dict[str, Any],
                      headers: dict[str, str]) -> TurnResult:
    """Send one streamed request and time it; errors are returned, not raised."""
    meter = StreamMeter()
    t0 = time.perf_counter()
    status = None
    headers_s: float | None = None
    stages: dict[str, float] = {}
    try:
        async with client.stream("POST", url, json=body, headers=headers) as resp:
            headers_s = time.perf_counter() - t0
            stages = parse_server_timing(resp.headers.get("server-timing"))
            status = resp.status_code
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                return TurnResult(meter, time.perf_counter() - t0, status,
                                  f"HTTP {resp.status_code}: {text[:500]}")
            async for line in resp.aiter_lines():
                meter.feed_line(line, time.perf_counter() - t0)
    except httpx.HTTPError as exc:
        return TurnResult(meter, time.perf_counter() - t0, status,
                          f"{type(exc).__name__}: {exc}")
    e2e = time.perf_counter() - t0
    error = meter.error
    if error is None and not meter.done:
        error = "stream ended without [DONE]"
    return TurnResult(meter, e2e, status, error, headers_s, stages)
