"""Every error the SDK raises, in one place.

Catch ``KVAgentError`` for everything; the leaves say what went wrong and whether a retry
could help::

    KVAgentError
    ├── APIError                      the server or the network failed the request
    │   ├── APIConnectionError        could not connect / connection dropped before a response
    │   │   └── APITimeoutError       connect or read timed out before a response
    │   └── APIStatusError            the server answered 4xx/5xx (``status_code``, ``body``)
    │       ├── BadRequestError              400
    │       ├── AuthenticationError          401
    │       ├── PermissionDeniedError        403
    │       ├── NotFoundError                404 (names the model: usually a wrong model name)
    │       ├── ConflictError                409
    │       ├── UnprocessableEntityError     422
    │       ├── RateLimitError               429
    │       └── InternalServerError          5xx
    ├── StreamError                   a 2xx stream went wrong after it started (never retried)
    │   ├── StreamInterrupted         cut before the answer ended; ``partial_text`` holds what came
    │   └── MalformedStream           bytes that are not an OpenAI event stream
    └── ToolError                     declaring or running tools
        └── ToolSchemaError           a function cannot be described as a JSON-schema tool

Retried automatically (before the first byte of a response only): ``APIConnectionError``,
``APITimeoutError`` and ``APIStatusError`` with status 408, 409, 429 or 5xx.
"""

from __future__ import annotations

from typing import Any

import httpx

__all__ = [
    "APIConnectionError",
    "APIError",
    "APIStatusError",
    "APITimeoutError",
    "AuthenticationError",
    "BadRequestError",
    "ConflictError",
    "InternalServerError",
    "KVAgentError",
    "MalformedStream",
    "NotFoundError",
    "PermissionDeniedError",
    "RateLimitError",
    "StreamError",
    "StreamInterrupted",
    "ToolError",
    "ToolSchemaError",
    "UnprocessableEntityError",
]


class KVAgentError(Exception):
    """Base of every error raised by the SDK."""


class APIError(KVAgentError):
    """The request did not produce a usable response."""

    def __init__(self, message: str, *, request: httpx.Request | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.request = request


class APIConnectionError(APIError):
    """No response arrived: refused, unreachable, reset before the status line."""


class APITimeoutError(APIConnectionError):
    """Connecting or waiting for the response head took longer than the timeout."""


class APIStatusError(APIError):
    """The server answered with an error status; ``body`` is its parsed JSON (or text)."""

    def __init__(self, message: str, *, response: httpx.Response, body: Any = None,
                 retry_after: float | None = None, request_id: str | None = None) -> None:
        super().__init__(message, request=response.request)
        self.response = response
        self.status_code = response.status_code
        self.body = body
        #: Seconds the server asked us to wait (``Retry-After``), when it said so.
        self.retry_after = retry_after
        #: The server's id of the failed request (``x-request-id``), when it sent one.
        self.request_id = request_id
        #: The response's headers, e.g. for rate-limit details.
        self.headers = response.headers


class BadRequestError(APIStatusError):
    """400: the server rejected the request body (e.g. context too long, bad tool schema)."""


class AuthenticationError(APIStatusError):
    """401: missing or wrong API key."""


class PermissionDeniedError(APIStatusError):
    """403: the key is valid but may not do this."""


class NotFoundError(APIStatusError):
    """404: usually a model name the server does not serve, or a wrong ``base_url``."""


class ConflictError(APIStatusError):
    """409: a conflicting request is in flight; retried."""


class UnprocessableEntityError(APIStatusError):
    """422: the body was well-formed JSON but not a valid request."""


class RateLimitError(APIStatusError):
    """429: too many requests; retried, honouring ``Retry-After``."""


class InternalServerError(APIStatusError):
    """5xx: the server failed; retried."""


class StreamError(KVAgentError):
    """A response stream started and then went wrong. Never retried: tokens were spent."""

    def __init__(self, message: str, *, partial_text: str = "") -> None:
        super().__init__(message)
        self.message = message
        #: Assistant text received before the failure (not added to the history).
        self.partial_text = partial_text


class StreamInterrupted(StreamError):
    """The stream ended or failed before the answer was complete (no ``[DONE]`` and a choice
    without ``finish_reason``); history and cache token are unchanged."""


class MalformedStream(StreamError):
    """The server sent something that is not an OpenAI chat-completion event stream."""


class ToolError(KVAgentError):
    """Declaring or running a tool failed in a way the model cannot be told about."""


class ToolSchemaError(ToolError, TypeError):
    """A Python function cannot be turned into a JSON-schema tool (raised at declaration)."""


_STATUS_CLASSES: dict[int, type[APIStatusError]] = {
    400: BadRequestError,
    401: AuthenticationError,
    403: PermissionDeniedError,
    404: NotFoundError,
    409: ConflictError,
    422: UnprocessableEntityError,
    429: RateLimitError,
}


def status_error_class(status_code: int) -> type[APIStatusError]:
    """The most specific error class for an HTTP error status."""
    if status_code >= 500:
        return InternalServerError
    return _STATUS_CLASSES.get(status_code, APIStatusError)
