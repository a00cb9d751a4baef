"""Turns what came back over HTTP into typed errors, before any byte of an answer is read."""

from __future__ import annotations

import json
import re
from typing import Any

import httpx

from ._exceptions import (
    APIConnectionError,
    APIStatusError,
    APITimeoutError,
    MalformedStream,
    NotFoundError,
    status_error_class,
)
from ._retry import parse_retry_after

__all__ = ["check_event_stream", "connection_error", "context_length", "error_detail",
           "request_id", "status_error"]

#: How vLLM ("This model's maximum context length is 16384 tokens. However, your prompt
#: contains ...", "Input length (N) exceeds model's maximum context length (16384).") and
#: OpenAI say that a prompt does not fit the model's context; the group is that length.
_CONTEXT_LENGTH = re.compile(r"maximum context length (?:is |\()(\d+)")

#: Where servers put the id of a request: OpenAI and vLLM (``--enable-request-id-headers``).
_REQUEST_ID_HEADERS = ("x-request-id", "request-id")


def request_id(headers: httpx.Headers) -> str | None:
    """The server's id of this request, for bug reports and log correlation."""
    for name in _REQUEST_ID_HEADERS:
        value = headers.get(name)
        if value:
            return str(value)
    return None


def connection_error(exc: httpx.TransportError, url: str) -> APIConnectionError:
    """No response at all: a timeout or a connection failure, naming the URL."""
    if isinstance(exc, httpx.TimeoutException):
        return APITimeoutError(f"timed out talking to {url}: {exc or type(exc).__name__}")
    return APIConnectionError(f"could not reach {url}: {exc or type(exc).__name__}")


def context_length(status_code: int, detail: str | None) -> int | None:
    """The model's context length, when a 400's message says the prompt does not fit it."""
    if status_code != 400 or not detail:
        return None
    m = _CONTEXT_LENGTH.search(detail)
    return int(m[1]) if m else None


def status_error(response: httpx.Response, raw: bytes, *, model: str, base_url: str,
                 last_answer_cut: bool = False) -> APIStatusError:
    """The most specific ``APIStatusError`` for an error response, keeping the server's words.

    A 404 almost always means a model name the server does not serve, so it says so. A 400
    saying the prompt exceeds the model's context says what to do about it; with
    ``last_answer_cut`` (the history's last answer stopped at its length limit) it names
    that answer as the likely cause.
    """
    body: Any
    try:
        body = json.loads(raw) if raw else None
    except ValueError:
        body = raw.decode("utf-8", errors="replace")
    detail = error_detail(body) or response.reason_phrase or "no details"
    cls = status_error_class(response.status_code)
    if cls is NotFoundError:
        message = (f"model {model!r} was not found at {base_url} (HTTP 404: {detail}). "
                   f"Check the model name (GET {base_url}/models lists the served models) "
                   "and the base_url.")
    else:
        message = f"HTTP {response.status_code} from {response.request.url}: {detail}"
        limit = context_length(response.status_code, detail)
        if limit is not None:
            message += context_hint(limit, last_answer_cut=last_answer_cut)
    return cls(message, response=response, body=body,
               retry_after=parse_retry_after(response.headers),
               request_id=request_id(response.headers))


def context_hint(limit: int, *, last_answer_cut: bool) -> str:
    """What to do when the conversation no longer fits the model's context of ``limit``."""
    hint = (f" The conversation no longer fits the model's context of {limit} tokens (the "
            "prompt is the whole history: system prompt, messages, answers, tool schemas).")
    if last_answer_cut:
        hint += (" The last answer in the history stopped at its length limit (finish_reason "
                 "'length'): a request without max_tokens lets an answer run to the end of "
                 "the context, leaving no room for the next turn.")
    return hint + (" Bound answers with max_tokens= (per session or per turn) and shorten the "
                   "history (truncate(), or a new session).")


def check_event_stream(response: httpx.Response) -> None:
    """A 2xx that is not an event stream (a proxy's HTML page, a JSON body) is malformed."""
    content_type = response.headers.get("content-type", "")
    if content_type and "text/event-stream" not in content_type:
        raise MalformedStream(f"expected an event stream (text/event-stream) from "
                              f"{response.request.url}, got {content_type!r}")


def error_detail(body: Any) -> str | None:
    """The message of an OpenAI (``{"error": {...}}``), older vLLM or FastAPI error body."""
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])
        if isinstance(error, str):
            return error
        for key in ("message", "detail"):
            if body.get(key):
                return str(body[key])
        return None
    if isinstance(body, str) and body.strip():
        return body.strip()[:500]
    return None
