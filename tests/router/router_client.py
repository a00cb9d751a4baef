"""A client's view of the router in tests: request bodies, one streamed turn, SSE events,
and the checks every turn gets (no internal field reaches the client, no wrong KV)."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import httpx
from fakes import Stack

MODEL = "fake-model"


LONG = "Please summarise the following text carefully. " * 6


def chat_body(messages: list[dict[str, Any]], *, stream: bool = True, **extra: Any) -> dict:
    body: dict[str, Any] = {"model": MODEL, "messages": messages, "stream": stream, **extra}
    if stream:
        body.setdefault("stream_options", {"include_usage": True})
    return body


def assert_clean(stack: Stack, raw: bytes | str) -> None:
    """No internal field, host, port, engine id or block id reaches the client."""
    text = raw.decode() if isinstance(raw, bytes) else raw
    # The fields vLLM itself writes as `null` when nothing was asked or transferred.
    text = re.sub(r'"(kv_transfer_params|ec_transfer_params|prompt_token_ids|token_ids)":'
                  r"\s*null", "", text)
    for needle in ("kv_transfer_params", "remote_", "do_remote", "prompt_token_ids",
                   "token_ids", "engine-", "transfer_mode", "cache_salt"):
        assert needle not in text, needle
    for secret in stack.internal_strings():
        assert not re.search(rf"(?<![0-9A-Za-z]){re.escape(secret)}(?![0-9A-Za-z])", text), secret


def events(text: str) -> list[Any]:
    out: list[Any] = []
    for line in text.splitlines():
        if line.startswith("data: "):
            out.append("[DONE]" if line == "data: [DONE]" else json.loads(line[6:]))
    return out


def content_of(evs: list[Any]) -> str:
    return "".join((e["choices"][0].get("delta") or {}).get("content") or ""
                   for e in evs if isinstance(e, dict) and e.get("choices"))


async def turn(stack: Stack, messages: list[dict[str, Any]], *, session: str | None = "s1",
               token: str | None = None, headers: dict[str, str] | None = None,
               **extra: Any) -> tuple[dict[str, Any], str, list[Any]]:
    """One streamed turn; returns (kvagent object, assistant text, events)."""
    h = dict(headers or {})
    if session is not None:
        h["X-Session-ID"] = session
    if token is not None:
        h["X-KVAgent-Cache-Token"] = token
    r = await stack.client.post("/v1/chat/completions", json=chat_body(messages, **extra),
                                headers=h)
    assert r.status_code == 200, r.text
    assert_clean(stack, r.content)
    evs = events(r.text)
    assert evs[-1] == "[DONE]"
    return evs[-2]["kvagent"], content_of(evs), evs


def no_wrong_kv(stack: Stack) -> None:
    assert not stack.cluster.events_of("wrong_kv"), stack.cluster.events
    assert not stack.cluster.open_leases(), "a P leg was left orphaned"


FIRST = [{"role": "user", "content": LONG}]


def second(answer: str, text: str = "Now shorter, and in French please.") -> list[dict]:
    return [*FIRST, {"role": "assistant", "content": answer}, {"role": "user", "content": text}]


async def wait_ready(client: httpx.AsyncClient, *, tries: int = 300,
                     interval_s: float = 0.1) -> None:
    """Poll a router started as a process until `/ready` answers 200 (its first turn may
    still find a node unhealthy otherwise); the caller's next request says if it never did."""
    for _ in range(tries):
        try:
            if (await client.get("/ready")).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        await asyncio.sleep(interval_s)
