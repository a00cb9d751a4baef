"""Anthropic's errors: `ApiError`, a client error answered in Anthropic's error shape, the
error body its clients parse, and the error type for an HTTP status."""

from __future__ import annotations

from typing import Any


class ApiError(Exception):
    """A client error, answered in Anthropic's error shape."""

    def __init__(self, status: int, message: str, *,
                 type_: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status = status
        self.type = type_
        self.message = message


def error_body(type_: str, message: str) -> dict[str, Any]:
    """Anthropic's error object (the body of an error answer and of a streamed `error`)."""
    return {"type": "error", "error": {"type": type_, "message": message}}


_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                402: "billing_error", 403: "permission_error", 404: "not_found_error",
                413: "request_too_large", 429: "rate_limit_error", 504: "timeout_error",
                529: "overloaded_error"}


def error_type(status: int) -> str:
    """Anthropic's error type for an HTTP status, so clients retry (or not) as they would
    against Anthropic: other 4xx are invalid requests, other 5xx `api_error`."""
    if status in _ERROR_TYPES:
        return _ERROR_TYPES[status]
    return "invalid_request_error" if 400 <= status < 500 else "api_error"


def bad(path: str, message: str) -> ApiError:
    return ApiError(400, f"{path}: {message}")
