"""The wire contract between the SDK and the kvagent router (see docs/protocol.md).

One place for every name that crosses the wire, so the SDK and the router cannot drift.
"""

from __future__ import annotations

import re
from typing import Final

SESSION_HEADER: Final = "X-Session-ID"
CACHE_TOKEN_HEADER: Final = "X-KVAgent-Cache-Token"

#: Top-level body object carrying session id and token for body-only clients, and the
#: top-level response object carrying the next token.
BODY_FIELD: Final = "kvagent"
BODY_SESSION_ID: Final = "session_id"
BODY_CACHE_TOKEN: Final = "cache_token"

#: vLLM's multi-turn benchmark and reference proxy send this; an alias of the session id.
CONVERSATION_ID_ALIAS: Final = "conversation_id"

RESPONSE_CACHE_TOKEN: Final = "cache_token"
RESPONSE_REUSED_TOKENS: Final = "reused_tokens"
RESPONSE_EXPIRES_IN: Final = "expires_in"
RESPONSE_PATH: Final = "path"

#: How a turn was served (the `path` field).
PATHS: Final = ("pd_fresh", "pd_reuse", "d_direct", "d_fresh", "d_pull", "recompute",
                 "decode_only")

MAX_TOKEN_BYTES: Final = 2048
SESSION_ID_RE: Final = re.compile(r"^[A-Za-z0-9._:-]{1,128}\Z")


def valid_session_id(value: str) -> bool:
    """True when `value` is an acceptable session id."""
    return bool(SESSION_ID_RE.match(value))


#: A token is opaque, but it must fit a header: URL-safe base64 alphabet, `.` and `=`.
CACHE_TOKEN_RE: Final = re.compile(r"^[A-Za-z0-9_\-.=]+\Z")


def valid_cache_token(value: object) -> bool:
    """True when `value` can be sent back as `X-KVAgent-Cache-Token`."""
    return (isinstance(value, str) and 0 < len(value) <= MAX_TOKEN_BYTES
            and bool(CACHE_TOKEN_RE.match(value)))
