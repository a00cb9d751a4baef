"""Retry policy: what is retried, how often, how long, and never after the first byte."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime

import httpx
import pytest
from kvagent import (
    APITimeoutError,
    AsyncSession,
    BadRequestError,
    InternalServerError,
    RateLimitError,
    RetryPolicy,
    Session,
    StreamInterrupted,
)
from kvagent._retry import backoff, parse_retry_after
from sdk_helpers import BASE_URL, MODEL, FakeServer, error_response, sse, stream_response

FAST = {"initial_backoff": 0.001, "max_backoff": 0.002}


def policy(waits: list, **kw) -> RetryPolicy:
    return RetryPolicy(**{**FAST, **kw}, on_retry=lambda n, wait, exc: waits.append(
        (n, round(wait, 3), type(exc).__name__)))


@pytest.mark.parametrize("status", [408, 409, 429, 500, 502, 503, 504])
def test_retryable_statuses_are_retried_until_success(status: int) -> None:
    waits: list = []
    server = FakeServer(error_response(status, "busy"), error_response(status, "busy"),
                        stream_response(sse("vllm_text.sse")))
    s = Session(BASE_URL, MODEL, transport=server.transport, retry=policy(waits))
    assert s.send("hi").text
    assert len(server.requests) == 3 and [w[0] for w in waits] == [1, 2]
    assert server.requests[0].content == server.requests[2].content


def test_gives_up_after_max_retries_with_the_last_error() -> None:
    waits: list = []
    server = FakeServer(*[error_response(503, "overloaded")] * 3)
    s = Session(BASE_URL, MODEL, transport=server.transport, retry=policy(waits, max_retries=1))
    with pytest.raises(InternalServerError, match="HTTP 503 .*overloaded") as info:
        s.send("hi")
    assert info.value.status_code == 503 and len(server.requests) == 2


@pytest.mark.parametrize("status", [400, 401, 403, 404, 422])
def test_client_errors_are_not_retried(status: int) -> None:
    server = FakeServer(error_response(status, "no"))
    s = Session(BASE_URL, MODEL, transport=server.transport, retry=policy([]))
    with pytest.raises(Exception) as info:
        s.send("hi")
    assert info.value.status_code == status and len(server.requests) == 1
    if status == 400:
        assert isinstance(info.value, BadRequestError)


def test_retry_after_header_is_honoured() -> None:
    waits: list = []
    server = FakeServer(error_response(429, "slow down", headers={"Retry-After": "0.3"}),
                        stream_response(sse("vllm_text.sse")))
    s = Session(BASE_URL, MODEL, transport=server.transport, retry=policy(waits))
    started = time.monotonic()
    s.send("hi")
    assert time.monotonic() - started >= 0.3
    assert waits == [(1, 0.3, "RateLimitError")]


def test_retry_after_longer_than_allowed_falls_back_to_backoff() -> None:
    waits: list = []
    server = FakeServer(error_response(429, "x", headers={"Retry-After": "3600"}),
                        stream_response(sse("vllm_text.sse")))
    Session(BASE_URL, MODEL, transport=server.transport,
            retry=policy(waits, max_retry_after=5)).send("hi")
    assert waits[0][1] <= FAST["initial_backoff"]


def test_connection_errors_and_timeouts_are_retried() -> None:
    waits: list = []
    server = FakeServer(httpx.ConnectError("refused"), httpx.ReadTimeout("slow"),
                        stream_response(sse("vllm_text.sse")))
    Session(BASE_URL, MODEL, transport=server.transport, retry=policy(waits)).send("hi")
    assert [w[2] for w in waits] == ["APIConnectionError", "APITimeoutError"]


def test_timeout_after_retries_raises_timeout_error() -> None:
    server = FakeServer(*[httpx.ConnectTimeout("t")] * 2)
    s = Session(BASE_URL, MODEL, transport=server.transport, retry=policy([], max_retries=1))
    with pytest.raises(APITimeoutError, match="timed out talking to"):
        s.send("hi")


def test_never_retried_once_the_stream_started() -> None:
    body = sse("router_text.sse")
    server = FakeServer(stream_response(body[:300], fail=httpx.ReadError("reset")),
                        stream_response(body))
    s = Session(BASE_URL, MODEL, transport=server.transport, retry=policy([], max_retries=5))
    with pytest.raises(StreamInterrupted):
        s.send("hi")
    assert len(server.requests) == 1


async def test_async_retries_the_same_way() -> None:
    waits: list = []
    server = FakeServer(error_response(429, "x", headers={"retry-after-ms": "50"}),
                        stream_response(sse("vllm_text.sse")))
    async with AsyncSession(BASE_URL, MODEL, transport=server.transport,
                            retry=policy(waits)) as s:
        await s.send("hi")
    assert waits == [(1, 0.05, "RateLimitError")]


def test_rate_limit_error_exposes_retry_after() -> None:
    server = FakeServer(error_response(429, "x", headers={"Retry-After": "2"}))
    s = Session(BASE_URL, MODEL, transport=server.transport, max_retries=0)
    with pytest.raises(RateLimitError) as info:
        s.send("hi")
    assert info.value.retry_after == 2.0


def test_backoff_is_exponential_capped_and_jittered() -> None:
    p = RetryPolicy(initial_backoff=0.5, max_backoff=4.0, jitter=0.25)
    assert [backoff(p, n, None, rand=0.0) for n in (1, 2, 3, 4, 5)] == [0.5, 1, 2, 4, 4]
    assert backoff(p, 2, None, rand=1.0) == 0.75  # at most a quarter shaved off
    assert backoff(p, 1, RateLimitError.__new__(RateLimitError), rand=0.0) == 0.5


def test_parse_retry_after_forms() -> None:
    now = datetime(2026, 1, 1, tzinfo=UTC)
    date = format_datetime(now + timedelta(seconds=30), usegmt=True)
    assert parse_retry_after({"Retry-After": "7"}) == 7.0
    assert parse_retry_after({"retry-after-ms": "250", "retry-after": "9"}) == 0.25
    assert parse_retry_after({"Retry-After": date}, now=now.timestamp()) == 30.0
    assert parse_retry_after({"Retry-After": "soon"}) is None
    assert parse_retry_after({}) is None


def test_invalid_policies_are_rejected() -> None:
    with pytest.raises(ValueError):
        RetryPolicy(max_retries=-1)
    with pytest.raises(ValueError):
        Session(BASE_URL, MODEL, retry=RetryPolicy(), max_retries=1)
