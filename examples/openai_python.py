"""Plain openai-python against the kvagent router: reuse with no kvagent import at all.

The router speaks OpenAI's protocol; reuse needs only two things from the client: a stable
session id on every request and the cache token of the previous answer on the next one.
openai-python can send both as headers (``default_headers`` / ``extra_headers``) or, where
only the body can be changed, in a top-level ``kvagent`` object (``extra_body``).

Run against a bundle started with ``kvagent-server up``::

    python examples/openai_python.py

Needs ``pip install openai`` (not a kvagent dependency).
"""

from __future__ import annotations

import os
import uuid
from typing import Any

import httpx
from openai import OpenAI

BASE_URL = os.environ.get("KVAGENT_BASE_URL", "http://127.0.0.1:8000/v1")
MODEL = os.environ.get("KVAGENT_MODEL", "kvagent-demo")


# --8<-- [start:helpers]
def kvagent_info(obj: Any) -> dict[str, Any]:
    """The router's top-level ``kvagent`` object of a response or chunk ({} if absent).

    openai-python keeps fields it does not know in ``model_extra``.
    """
    return (getattr(obj, "model_extra", None) or {}).get("kvagent") or {}


def cached_tokens(usage: Any) -> int:
    details = getattr(usage, "prompt_tokens_details", None)
    return (getattr(details, "cached_tokens", None) or 0) if details else 0
# --8<-- [end:helpers]


# --8<-- [start:streamed]
def streamed_turn(client: OpenAI, model: str, messages: list[dict[str, Any]],
                  token: str | None) -> tuple[str, str | None, int]:
    """One streamed turn with the token as a header; returns (text, next token, cached)."""
    stream = client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=32,
        stream=True,
        stream_options={"include_usage": True},  # the final chunk then carries usage
        extra_headers={"X-KVAgent-Cache-Token": token} if token else None,
    )
    text, next_token, cached = [], token, 0
    for chunk in stream:
        for choice in chunk.choices:
            text.append(choice.delta.content or "")
        if chunk.usage is not None:
            cached = cached_tokens(chunk.usage)
        # The last data chunk before [DONE] carries the next token.
        next_token = kvagent_info(chunk).get("cache_token", next_token)
    return "".join(text), next_token, cached
# --8<-- [end:streamed]


# --8<-- [start:body]
def body_only_turn(client: OpenAI, model: str, messages: list[dict[str, Any]],
                   session_id: str, token: str | None) -> tuple[str, str | None, int]:
    """The same turn, non-streamed, with session id and token in the body (``extra_body``)."""
    kvagent: dict[str, str] = {"session_id": session_id}
    if token:
        kvagent["cache_token"] = token
    response = client.chat.completions.create(
        model=model, messages=messages, max_tokens=32, extra_body={"kvagent": kvagent},
    )
    text = response.choices[0].message.content or ""
    return text, kvagent_info(response).get("cache_token", token), cached_tokens(response.usage)
# --8<-- [end:body]


def main(base_url: str = BASE_URL, model: str = MODEL,
         http_client: httpx.Client | None = None) -> list[int]:
    """Four turns of one conversation; returns the cached prompt tokens of each turn."""
    # --8<-- [start:client]
    session_id = f"openai-example-{uuid.uuid4().hex[:12]}"
    # The session id never changes within a conversation: set it once for the client.
    client = OpenAI(base_url=base_url, api_key=os.environ.get("KVAGENT_API_KEY", "none"),
                    default_headers={"X-Session-ID": session_id}, http_client=http_client)
    # --8<-- [end:client]
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a terse assistant. " * 20},
    ]
    token: str | None = None
    cached_per_turn: list[int] = []
    for turn, question in enumerate(["What is KV reuse?", "Why does it help agents?",
                                     "And on CPU?", "Summarise."]):
        messages.append({"role": "user", "content": question})
        if turn < 2:
            text, token, cached = streamed_turn(client, model, messages, token)
        else:
            text, token, cached = body_only_turn(client, model, messages, session_id, token)
        # Append the answer exactly as received: an edited history costs reuse.
        messages.append({"role": "assistant", "content": text})
        cached_per_turn.append(cached)
        print(f"turn {turn + 1}: cached_tokens={cached} text={text[:40]!r}")
    return cached_per_turn


if __name__ == "__main__":
    main()
