"""The cache token as it rides on a framework's assistant message, and back.

A framework keeps the conversation in its own message objects and resends all of it on
every call, so the token cannot live in a ``Session``: it is written into the assistant
message's metadata under one key, ``"kvagent"``, together with the session id it is bound
to. On the next call the adapter reads it back from the last assistant message and picks
the session id: the one configured on the adapter, else the carrier's, else a new one.
Pure functions over plain data; both adapters share them.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from .. import protocol as proto
from ..messages import ToolCall
from ..results import TurnResult, Usage

__all__ = [
    "METADATA_KEY",
    "Carrier",
    "carrier_metadata",
    "choose_session",
    "new_session_id",
    "read_carrier",
    "tool_call_arguments",
    "usage_counts",
]

#: The key under which adapters store the carrier in a message's metadata dict.
METADATA_KEY = "kvagent"


@dataclass(frozen=True, slots=True)
class Carrier:
    """What an assistant message must remember for the next call to reuse its KV."""

    session_id: str
    cache_token: str | None
    cache_token_expires_at: datetime | None = None


def new_session_id() -> str:
    return f"kva-{uuid.uuid4().hex}"


def carrier_metadata(result: TurnResult, session_id: str) -> dict[str, Any]:
    """The ``"kvagent"`` metadata entry for the message ``result`` produced.

    Plain JSON types only, so framework serialisers (LangGraph checkpoints, LlamaIndex
    memory stores) keep it intact.
    """
    message = result.message
    expires = message.cache_token_expires_at
    return {
        "session_id": session_id,
        "cache_token": message.cache_token,
        "cache_token_expires_at": expires.isoformat() if expires else None,
        "reused_tokens": result.reused_tokens,
        "path": result.path,
    }


def read_carrier(*metadata: Mapping[str, Any] | None) -> Carrier | None:
    """The carrier found in the first metadata dict that holds a valid one, else None.

    Anything malformed is ignored (a stale or foreign token only costs a recompute).
    """
    for meta in metadata:
        if not isinstance(meta, Mapping):
            continue
        raw = meta.get(METADATA_KEY)
        if not isinstance(raw, Mapping):
            continue
        session_id = raw.get("session_id")
        if not isinstance(session_id, str) or not proto.valid_session_id(session_id):
            continue
        token = raw.get("cache_token")
        if not proto.valid_cache_token(token):
            token = None
        expires: datetime | None = None
        if token and isinstance(raw.get("cache_token_expires_at"), str):
            try:
                expires = datetime.fromisoformat(raw["cache_token_expires_at"])
            except ValueError:
                expires = None
        return Carrier(session_id=session_id, cache_token=token, cache_token_expires_at=expires)
    return None


def choose_session(configured: str | None, last: Carrier | None) -> tuple[str, Carrier | None]:
    """The session id for this call, and the carrier whose token it may send.

    A token is bound to the session that received it: under another session id the router
    would reject it, so it is dropped here rather than sent.
    """
    if configured:
        if last is not None and last.session_id == configured:
            return configured, last
        return configured, None
    if last is not None:
        return last.session_id, last
    return new_session_id(), None


def attach_token(history: list[Any], index: int | None, carrier: Carrier | None) -> list[Any]:
    """Put the carried token back on the assistant message at `index`, the one it came with,
    so the session sends it on the next turn."""
    if index is not None and carrier is not None and carrier.cache_token:
        history[index] = history[index].model_copy(update={
            "cache_token": carrier.cache_token,
            "cache_token_expires_at": carrier.cache_token_expires_at})
    return history


def usage_counts(usage: Usage | None) -> dict[str, int] | None:
    """Usage as (input, output, total, cached) counts, or None when the server sent none."""
    if usage is None:
        return None
    return {"input": usage.prompt_tokens, "output": usage.completion_tokens,
            "total": usage.total_tokens, "cached": usage.cached_tokens}


def tool_call_arguments(call: ToolCall) -> tuple[dict[str, Any] | None, str | None]:
    """``(parsed arguments, None)``, or ``(None, error)`` when the model wrote no JSON object."""
    try:
        value = json.loads(call.arguments or "{}")
    except ValueError as exc:
        return None, f"arguments are not JSON: {exc}"
    if not isinstance(value, dict):
        return None, "arguments are not a JSON object"
    return value, None
