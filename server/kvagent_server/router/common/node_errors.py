"""What of a node's error message a client may see: vLLM's own words, unless they name
something internal.

vLLM's 4xx messages are about the client's request (a context-length overflow, an unknown
model with the names it serves, a field out of range), and a client served by stock vLLM
reads them as they are: so does a client of the router. What a node's message must never
carry to a client is the deployment behind the router: a node's address or side-channel
port, a URL, a file path, an engine's id, a traceback, or the router's own fields echoed
back (`kv_transfer_params`, `cache_salt`, pydantic's `input_value=...`). A message that
shows any of those becomes a generic one with the node's status, whole: it is never cut
or redacted, so nothing half-hidden leaks. An error event in a streamed answer is rebuilt
from the same parts (`client_error_event`).
"""

from __future__ import annotations

import re
from typing import Any

GENERIC = "the model server rejected the request"
#: For an error a node reports in the middle of a streamed answer.
STREAM_GENERIC = "the model server failed while answering"
MAX_LEN = 1000

#: Shapes that are never a client's business: addresses and ports, URLs, absolute paths,
#: engine ids and long hex ids, tracebacks, and the fields only the router sets.
_INTERNAL = re.compile(
    r"\d{1,3}(\.\d{1,3}){3}|\[[0-9a-f:]*:[0-9a-f:]*\]|:\d{2,5}\b|[a-z][a-z0-9+.-]*://"
    r"|(^|[\s'\"`(=:,])(/|~/|[A-Za-z]:\\)[\w.~-]+[/\\]|\.py\b|traceback"
    r"|engine(?:[-_:]|\s?id\b|core)|remote_|kv_transfer|ec_transfer|do_remote|side_channel"
    r"|nixl|cache_salt|input_value|request_id|[0-9a-f]{12,}", re.IGNORECASE)


def client_message(message: object, default: str = GENERIC) -> str:
    """`message` as vLLM wrote it when it names nothing internal, else `default`."""
    if not isinstance(message, str) or not message.strip() or len(message) > MAX_LEN:
        return default
    if _INTERNAL.search(message) or any(ord(c) < 32 and c not in "\n\t" for c in message):
        return default
    return message


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
    if (isinstance(type_, str) and _TYPE.fullmatch(type_) and not _INTERNAL.search(type_)
            and "engine" not in type_.lower()):
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
