"""Which conversation a request continues, from what clients already send. Pure.

kvagent's own `X-Session-ID` comes first; then the ids agent clients put on the wire
without being asked (docs/agents/index.md lists them, with the clients' versions):

1. `X-Session-ID` header, body `kvagent.session_id` (kvagent's SDK, any client told to)
2. Claude Code: `X-Claude-Code-Session-Id`; a subagent's `X-Claude-Code-Agent-Id` is its
   own branch, so a subagent never claims the main agent's handle, nor a sibling's
3. Codex: `session-id` (`session_id` before 0.131) with `thread-id` (`thread_id`) as the
   branch and `x-codex-window-id` as its epoch; a compaction, memory or prewarm request
   (`x-codex-turn-metadata.request_kind`) is a branch of its own
4. OpenCode and clients like it: `x-session-affinity`
5. body `prompt_cache_key` (OpenAI's cache-affinity key; Codex sets it too)
6. body `metadata.user_id`'s session part (Claude Code's JSON form or its legacy string)
7. body `conversation_id` (vLLM's name for kvagent's session id)

None of these is trusted: the router still verifies every reuse at token level, and the
store scopes every key by the caller's API key (`Tenant.session_key`). Only kvagent's own
id is a client-chosen name the client may read back; the others are digested here, so a
raw agent id never reaches the store, a log or a node.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

Source = Literal["kvagent", "claude_code", "codex", "opencode", "prompt_cache_key",
                 "metadata_user_id", "conversation_id", "previous_response", "content"]

#: Codex request kinds that are not a turn of the thread: never its handle's claimant.
CODEX_SIDE_KINDS = frozenset({"compaction", "memory", "prewarm"})
#: Claude Code's legacy `metadata.user_id`: `user_<hash>_account_<id>_session_<uuid>`.
_LEGACY_USER_ID = re.compile(r"_session_([0-9A-Za-z-]{1,64})\Z")


@dataclass(frozen=True)
class Conversation:
    """A request's conversation: `key` names it to the store (before the caller's scope)."""

    key: str
    source: Source


def digest(*parts: str) -> str:
    """A short, fixed-length name for client-supplied parts (never stored raw)."""
    h = hashlib.blake2b(digest_size=16)
    for part in parts:
        h.update(part.encode("utf-8", "surrogatepass"))
        h.update(b"\x00")
    return h.hexdigest()


def _header(headers: Mapping[str, str], *names: str) -> str | None:
    for name in names:
        value = headers.get(name)
        if value and value.strip():
            return value.strip()
    return None


def _claude_code(headers: Mapping[str, str]) -> Conversation | None:
    session = _header(headers, "x-claude-code-session-id")
    if session is None:
        return None
    agent = _header(headers, "x-claude-code-agent-id")
    parts = (session, "agent", agent) if agent else (session,)
    return Conversation(f"cc-{digest(*parts)}", "claude_code")


def _codex_kind(raw: str | None) -> str | None:
    """`request_kind` from `x-codex-turn-metadata` (JSON); None when absent or unreadable."""
    if not raw:
        return None
    try:
        meta = json.loads(raw)
    except ValueError:
        return None
    kind = meta.get("request_kind") if isinstance(meta, dict) else None
    return kind if isinstance(kind, str) else None


def _codex(headers: Mapping[str, str]) -> Conversation | None:
    session = _header(headers, "session-id", "session_id")
    if session is None:
        return None
    thread = _header(headers, "thread-id", "thread_id") or session
    window = _header(headers, "x-codex-window-id") or ""
    kind = _codex_kind(headers.get("x-codex-turn-metadata"))
    parts = [session, thread, window]
    if kind in CODEX_SIDE_KINDS:
        parts += ["kind", kind]
    return Conversation(f"cx-{digest(*parts)}", "codex")


def _metadata_session(body: Mapping[str, Any]) -> str | None:
    """The session part of `metadata.user_id`: Claude Code's JSON string
    (`{"session_id": ...}`) or its legacy `..._session_<uuid>` form. A user id without one
    names a person, not a conversation, and is no key."""
    meta = body.get("metadata")
    user = meta.get("user_id") if isinstance(meta, dict) else None
    if not isinstance(user, str) or not user:
        return None
    if user.startswith("{"):
        try:
            parsed = json.loads(user)
        except ValueError:
            return None
        session = parsed.get("session_id") if isinstance(parsed, dict) else None
        return session if isinstance(session, str) and session else None
    found = _LEGACY_USER_ID.search(user)
    return found.group(1) if found else None


def from_agents(headers: Mapping[str, str], body: Mapping[str, Any]) -> Conversation | None:
    """The conversation named by an agent's own headers or body fields (2-7 above), or
    None. kvagent's own id (1) is read by `request.session_and_token`, which validates it."""
    for found in (_claude_code(headers), _codex(headers)):
        if found is not None:
            return found
    affinity = _header(headers, "x-session-affinity")
    if affinity is not None:
        return Conversation(f"oc-{digest(affinity)}", "opencode")
    key = body.get("prompt_cache_key")
    if isinstance(key, str) and key:
        return Conversation(f"pck-{digest(key)}", "prompt_cache_key")
    session = _metadata_session(body)
    if session is not None:
        return Conversation(f"mu-{digest(session)}", "metadata_user_id")
    return None
