"""What of a node's error message a client may see: an allow-list, not a deny-list.

A node's 4xx message can name its engine id, its side-channel host and port, or echo the
router's own fields back (pydantic's `input_value=...`). Only messages of the shapes below,
vLLM's own validation messages about the client's request, reach the client; anything
else becomes a generic message with the node's status.
"""

from __future__ import annotations

import re

GENERIC = "the model server rejected the request"
MAX_LEN = 400

#: vLLM's messages about the client's request that name nothing internal. Each matches the
#: whole message, and only from a narrow alphabet (no `/`, no `@`, no quotes but `'`).
_ALLOWED = tuple(re.compile(p, re.ASCII) for p in (
    r"This model's maximum context length is \d+ tokens\.[\w ,.()'-]*",
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


def client_message(message: object) -> str:
    """`message` when it is one of vLLM's known messages naming nothing internal, else
    the generic one."""
    if not isinstance(message, str) or not message or len(message) > MAX_LEN:
        return GENERIC
    if _INTERNAL.search(message):
        return GENERIC
    if any(p.fullmatch(message) for p in _ALLOWED):
        return message
    return GENERIC


_PARAM = re.compile(r"[A-Za-z_][\w.\[\]]{0,63}", re.ASCII)


def client_param(param: object) -> str | None:
    """The node's `param` when it names a request field (and nothing internal)."""
    if isinstance(param, str) and _PARAM.fullmatch(param) and not _INTERNAL.search(param):
        return param
    return None


_TYPE = re.compile(r"[A-Za-z][A-Za-z ]{0,47}", re.ASCII)


def client_type(type_: object) -> str:
    """The node's error `type` (vLLM's class-like names, e.g. `BadRequestError`,
    `NotFoundError`), so the client sees what vLLM itself would send; OpenAI's
    `invalid_request_error` when it is anything else."""
    if isinstance(type_, str) and _TYPE.fullmatch(type_) and not _INTERNAL.search(type_):
        return type_
    return "invalid_request_error"
