"""Error responses become typed errors that keep the server's own words."""

from __future__ import annotations

import httpx
import pytest
from kvagent import (
    AuthenticationError,
    BadRequestError,
    InternalServerError,
    NotFoundError,
    PermissionDeniedError,
    RateLimitError,
    UnprocessableEntityError,
)
from kvagent._exceptions import APIStatusError, ConflictError
from kvagent._response import error_detail, status_error


def response(status: int, **kw) -> httpx.Response:
    return httpx.Response(status, request=httpx.Request("POST", "http://h/v1/chat/completions"),
                          **kw)


@pytest.mark.parametrize(("body", "expected"), [
    ({"error": {"message": "context too long", "type": "BadRequestError"}}, "context too long"),
    ({"object": "error", "message": "old vLLM shape", "code": 400}, "old vLLM shape"),
    ({"detail": "Not Found"}, "Not Found"),
    ({"error": "plain string"}, "plain string"),
    ("<html>bad gateway</html>", "<html>bad gateway</html>"),
    ({"unrelated": 1}, None),
    (None, None),
])
def test_error_detail_reads_every_common_shape(body: object, expected: str | None) -> None:
    assert error_detail(body) == expected


@pytest.mark.parametrize(("status", "cls"), [
    (400, BadRequestError), (401, AuthenticationError), (403, PermissionDeniedError),
    (404, NotFoundError), (409, ConflictError), (422, UnprocessableEntityError),
    (429, RateLimitError), (500, InternalServerError), (503, InternalServerError),
    (418, APIStatusError),
])
def test_status_maps_to_the_most_specific_class(status: int, cls: type) -> None:
    error = status_error(response(status), b'{"error": {"message": "m"}}', model="x",
                         base_url="http://h/v1")
    assert type(error) is cls and error.status_code == status and error.body["error"]


def test_non_json_error_body_is_kept_as_text() -> None:
    error = status_error(response(502), b"upstream connect error", model="x",
                         base_url="http://h/v1")
    assert "upstream connect error" in str(error) and error.body == "upstream connect error"


def test_empty_body_falls_back_to_the_reason_phrase() -> None:
    error = status_error(response(503), b"", model="x", base_url="http://h/v1")
    assert str(error) == "HTTP 503 from http://h/v1/chat/completions: Service Unavailable"
