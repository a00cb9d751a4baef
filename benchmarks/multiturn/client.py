"""One measured streaming request: raw httpx, so every timestamp is the benchmark's own.

The meters are the I/O-free part, one per API's stream (fed parsed events with their
arrival times): `StreamMeter` (chat completions), `MessagesMeter` (Anthropic Messages),
`ResponsesMeter` (OpenAI Responses). Each gives the same readings (first token, token
times, answer text, usage, the `kvagent` report), so every API is recorded alike.
`stream_request` only sends the request and feeds the meter lines.
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


def _int(value: Any) -> int | None:
    return int(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


@dataclass
class Meter:
    """What every API's stream measures. Times are seconds since the request was sent
    (the caller's clock)."""

    #: What a stream that stops early lacks (the error then recorded).
    END = "stream ended without [DONE]"

    first_chunk_s: float | None = None
    first_choice_s: float | None = None  # the answer started (a choice, message, response)
    first_token_s: float | None = None  # first content, reasoning or tool-call delta
    token_times: list[float] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    usage: dict[str, Any] | None = None
    kvagent: dict[str, Any] | None = None
    response_id: str | None = None  # Responses only: what the next turn chains on
    done: bool = False
    error: str | None = None

    def feed_line(self, line: str, t: float) -> None:
        """One SSE line (`data: ...`); comments, blank and other fields (`event:`: every
        data object names its own type) are ignored."""
        if not line.startswith("data:"):
            return
        data = line[5:].strip()
        if data == "[DONE]":
            self.done = True
            return
        try:
            event = json.loads(data)
        except json.JSONDecodeError:
            self.error = f"malformed chunk: {data[:200]}"
            return
        if isinstance(event, dict):
            if self.first_chunk_s is None:
                self.first_chunk_s = t
            self.feed(event, t)

    def feed(self, event: dict[str, Any], t: float) -> None:
        raise NotImplementedError

    def _token(self, t: float, text: str | None = None) -> None:
        if text:
            self.text.append(text)
        if self.first_token_s is None:
            self.first_token_s = t
        self.token_times.append(t)

    def _started(self, t: float) -> None:
        if self.first_choice_s is None:
            self.first_choice_s = t

    @property
    def ttft_s(self) -> float | None:
        """First token-bearing delta; a stream whose answer is empty counts its start."""
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

    def prompt_tokens(self) -> int | None:
        return _int((self.usage or {}).get("prompt_tokens"))

    def completion_tokens(self) -> int | None:
        return _int((self.usage or {}).get("completion_tokens"))

    def cached_tokens(self) -> int | None:
        details = (self.usage or {}).get("prompt_tokens_details") or {}
        return _int(details.get("cached_tokens"))


@dataclass
class StreamMeter(Meter):
    """One streamed chat completion (`data:` chunks, then `[DONE]`)."""

    def feed_chunk(self, chunk: dict[str, Any], t: float) -> None:
        if self.first_chunk_s is None:
            self.first_chunk_s = t
        self.feed(chunk, t)

    def feed(self, event: dict[str, Any], t: float) -> None:
        chunk = event
        if "error" in chunk and not chunk.get("choices"):
            err = chunk["error"]
            self.error = err.get("message", str(err)) if isinstance(err, dict) else str(err)
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        if isinstance(chunk.get(BODY_FIELD), dict):
            self.kvagent = chunk[BODY_FIELD]
        choices = chunk.get("choices") or []
        if choices:
            self._started(t)
        carried = False
        texts: list[str] = []
        for choice in choices:
            delta = choice.get("delta") or {}
            content = delta.get("content")
            if content:
                texts.append(content)
                carried = True
            if delta.get("tool_calls") or delta.get("reasoning_content") or delta.get(
                    "reasoning"):
                carried = True
        if carried:
            self._token(t, "".join(texts))


@dataclass
class MessagesMeter(Meter):
    """One streamed Anthropic Messages answer: `message_start`, content blocks (a
    `tool_use` block's start carries the call's name, like chat's first tool-call delta),
    `message_delta` with the final usage and the `kvagent` report, `message_stop`."""

    END = "stream ended without message_stop"

    def feed(self, event: dict[str, Any], t: float) -> None:
        kind = event.get("type")
        if kind == "message_start":
            self._started(t)
        elif kind == "content_block_start":
            if (event.get("content_block") or {}).get("type") == "tool_use":
                self._token(t)
        elif kind == "content_block_delta":
            delta = event.get("delta") or {}
            dkind = delta.get("type")
            if dkind == "text_delta" and delta.get("text"):
                self._token(t, delta["text"])
            elif dkind in ("input_json_delta", "thinking_delta"):
                self._token(t)
        elif kind == "message_delta":
            if isinstance(event.get("usage"), dict):
                self.usage = event["usage"]
            if isinstance(event.get(BODY_FIELD), dict):
                self.kvagent = event[BODY_FIELD]
        elif kind == "message_stop":
            self.done = True
        elif kind == "error":
            err = event.get("error")
            self.error = err.get("message", str(err)) if isinstance(err, dict) else str(err)

    def prompt_tokens(self) -> int | None:
        """Anthropic's `input_tokens` leaves out the cached tokens: the prompt is the sum."""
        u = self.usage or {}
        parts = [_int(u.get(k)) for k in ("input_tokens", "cache_read_input_tokens",
                                          "cache_creation_input_tokens")]
        return None if parts[0] is None else sum(p or 0 for p in parts)

    def completion_tokens(self) -> int | None:
        return _int((self.usage or {}).get("output_tokens"))

    def cached_tokens(self) -> int | None:
        return _int((self.usage or {}).get("cache_read_input_tokens"))


@dataclass
class ResponsesMeter(Meter):
    """One streamed OpenAI Response: `response.created` (its id), output item and delta
    events, then `response.completed` whose `response` has the usage and the `kvagent`
    report."""

    END = "stream ended without response.completed"
    _FINAL = ("response.completed", "response.incomplete", "response.failed")

    def feed(self, event: dict[str, Any], t: float) -> None:
        kind = event.get("type")
        if kind == "response.created":
            self._started(t)
            self._response(event.get("response"))
        elif kind == "response.output_text.delta":
            if event.get("delta"):
                self._token(t, event["delta"])
        elif kind in ("response.function_call_arguments.delta",
                      "response.reasoning_text.delta"):
            if event.get("delta"):
                self._token(t)
        elif kind == "response.output_item.added":
            if (event.get("item") or {}).get("type") == "function_call":
                self._token(t)
        elif kind in self._FINAL:
            response = event.get("response") or {}
            self._response(response)
            if isinstance(response.get("usage"), dict):
                self.usage = response["usage"]
            if isinstance(response.get(BODY_FIELD), dict):
                self.kvagent = response[BODY_FIELD]
            self.done = True
            if kind == "response.failed":
                self.error = str((response.get("error") or {}).get("message") or "failed")
        elif kind == "error":
            self.error = str(event.get("message") or event)

    def _response(self, response: Any) -> None:
        if isinstance(response, dict) and isinstance(response.get("id"), str):
            self.response_id = response["id"]

    def prompt_tokens(self) -> int | None:
        return _int((self.usage or {}).get("input_tokens"))

    def completion_tokens(self) -> int | None:
        return _int((self.usage or {}).get("output_tokens"))

    def cached_tokens(self) -> int | None:
        details = (self.usage or {}).get("input_tokens_details") or {}
        return _int(details.get("cached_tokens"))


def meter_for(api: str) -> Meter:
    """A fresh meter for one request of `api` (see `apis.APIS`)."""
    if api == "messages":
        return MessagesMeter()
    if api in ("responses", "responses-full"):
        return ResponsesMeter()
    return StreamMeter()


@dataclass
class TurnResult:
    meter: Meter
    e2e_s: float
    status: int | None
    error: str | None
    headers_s: float | None = None  # response headers received
    #: The router's `Server-Timing` stages (seconds; empty: no router or the header is off).
    stages_s: dict[str, float] = field(default_factory=dict)


def chat_body(model: str, messages: list[dict[str, Any]], tools: list[dict[str, Any]],
              max_tokens: int) -> dict[str, Any]:
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
    """Send one streamed chat request and time it; errors are returned, not raised."""
    return await stream_request(client, url, body, headers, StreamMeter())


async def stream_request(client: httpx.AsyncClient, url: str, body: dict[str, Any],
                         headers: dict[str, str], meter: Meter) -> TurnResult:
    """Send one streamed request of any API and time it into `meter`; errors are returned,
    not raised."""
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
        error = meter.END
    return TurnResult(meter, e2e, status, error, headers_s, stages)
