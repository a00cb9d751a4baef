"""What of a node's error message a client may see: an allow-list, not a deny-list.

A node's 4xx message can name its engine id, its side-channel host and port, or echo the
router's own fields back (pydantic's `input_value=...`). Only messages of the shapes below,
vLLM's own validation messages about the client's request, reach the client; anything
else becomes a generic message with the node's status. An error event in a streamed
answer is rebuilt from the same parts (`client_error_event`).
"""

from __future__ import annotations

import re
from typing import Any

GENERIC = "the model server rejected the request"
#: For an error a node reports in the middle of a streamed answer.
STREAM_GENERIC = "the model server failed while answering"
MAX_LEN = 400

#: vLLM's messages about the client's request that name nothing internal. Each matches the
#: whole message, and only from a narrow alphabet (no `/`, no `@`, no quotes but `'`).
_ALLOWED = tuple(re.compile(p, re.ASCII) for p in (
    # vLLM 0.32 ends it with "(parameter=input_tokens, value=16385)": hence `=`.
    r"This model's maximum context length is \d+ tokens\.[\w ,.()'=-]*",
    r"'?(max_tokens|max_completion_tokens)'? [\w ,.()'<>=-]*",
    r"[A-Za-z_]{1,40} must be [\w ,.()'<>=+-]{1,120}",
    r"[A-Za-z_]{1,40} is not (supported|allowed)[\w ,.()'-]*",
    r"The model `[\w.-]{1,128}` does not exist\.",
    r"Expected [\w ,.()'<>=-]{1,160}",
))
#: Shapes that are never a client's business even inside an allowed sentence.
_INTERNAL = re.compile(
    r"\d{1,3}(\.\d{1,3}){3}|:\d{2,5}\b|https?:|engine|remote_|kv_transfer|do_remote"
    r"|cache_salt|input_value|request_id|[0-9a-f]{12,}", re.IGNORECASE)


def client_message(message: object, default: str = GENERIC) -> str:
    """`message` when it is one of vLLM's known messages naming nothing internal, else
    `default`."""
    if not isinstance(message, str) or not message or len(message) > MAX_LEN:
        return default
    if _INTERNAL.search(message):
        return default
    if any(p.fullmatch(message) for p in _ALLOWED):
        return message
    return default


_PARAM = re.compile(r"[A-Za-z_][\w.\[\]]{0,63}", re.ASCII)


def client_param(param: object) -> str | None:
    """The node's `param` when it names a request field (and nothing internal)."""
    if isinstance(param, str) and _PARAM.fullmatch(param) and not _INTERNAL.search(param):
        return param
    return None


_TYPE = re.compile(r"[A-Za-z][A-Za-z ]{0,47}", re.ASCII)


def client_type(type_: object, default: str = "invalid_request_error") -> str:
    """The node's error `type` (vLLM's class-like names, e.g. `BadRequestError`,
    `NotFoundError`), so the client sees what vLLM itself would send; `default` (OpenAI's
    name) when it is anything else."""
    if isinstance(type_, str) and _TYPE.fullmatch(type_) and not _INTERNAL.search(type_):
        return type_
    return default


_CODE = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,47}", re.ASCII)


def client_code(code: object) -> int | str | None:
    """The node's error `code` when it is an HTTP status or a plain identifier."""
    if isinstance(code, int) and not isinstance(code, bool) and 100 <= code <= 599:
        return code
    if isinstance(code, str) and _CODE.fullmatch(code) and not _INTERNAL.search(code):
        return code
    return None


def _safe_error(err: dict[str, Any]) -> dict[str, Any]:
    return {"message": client_message(err.get("message"), STREAM_GENERIC),
            "type": client_type(err.get("type"), "server_error"),
            "param": client_param(err.get("param")), "code": client_code(err.get("code"))}


def client_error_event(obj: dict[str, Any]) -> dict[str, Any] | None:
    """A streamed error event (`{"error": {...}}`, or vLLM's older top-level
    `{"object": "error", "message": ...}`) rebuilt from allow-listed parts only; None when
    `obj` is not an error event. Nothing else of the node's event is kept."""
    if "error" in obj:
        err = obj["error"]
        return {"error": _safe_error(err if isinstance(err, dict) else {"message": err})}
    if obj.get("object") == "error":
        return {"object": "error", **_safe_error(obj)}
    return None
