"""When and how long to retry: openai-python's policy on tenacity.

Only the opening of a request is ever retried (connection errors, timeouts, 408/409/429/5xx);
once a 2xx stream has begun, a failure surfaces as ``StreamInterrupted`` and is never
retried, because the server already spent the tokens and the caller may have shown them.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from email.utils import parsedate_to_datetime

import tenacity

from ._exceptions import APIConnectionError, APIStatusError
from ._logs import logger

__all__ = ["RetryPolicy", "async_retrying", "backoff", "is_retryable", "parse_retry_after",
           "retrying"]

RETRYABLE_STATUS = frozenset({408, 409, 429})


@dataclass(frozen=True)
class RetryPolicy:
    """``max_retries`` extra attempts; exponential backoff with up to ``jitter`` (fraction)
    shaved off; a server's ``Retry-After`` wins when it is at most ``max_retry_after``."""

    max_retries: int = 2
    initial_backoff: float = 0.5
    max_backoff: float = 8.0
    jitter: float = 0.25
    max_retry_after: float = 60.0
    #: Called before each retry sleep with (retry number, seconds, the error): metrics, logs.
    on_retry: Callable[[int, float, BaseException], None] | None = None

    def __post_init__(self) -> None:
        if self.max_retries < 0:
            raise ValueError("max_retries must be >= 0")
        if self.initial_backoff < 0 or self.max_backoff < 0 or not 0 <= self.jitter <= 1:
            raise ValueError("backoffs must be >= 0 and jitter within [0, 1]")


def is_retryable(exc: BaseException) -> bool:
    """Connection errors, timeouts and 408/409/429/5xx; nothing else."""
    if isinstance(exc, APIStatusError):
        return exc.status_code in RETRYABLE_STATUS or exc.status_code >= 500
    return isinstance(exc, APIConnectionError)


def backoff(policy: RetryPolicy, retry_number: int, exc: BaseException | None,
            rand: float | None = None) -> float:
    """Seconds to wait before retry ``retry_number`` (1-based)."""
    retry_after = getattr(exc, "retry_after", None)
    if retry_after is not None and 0 <= retry_after <= policy.max_retry_after:
        return retry_after
    base = min(policy.max_backoff, policy.initial_backoff * 2 ** (retry_number - 1))
    return base * (1 - policy.jitter * (random.random() if rand is None else rand))


def parse_retry_after(headers: Mapping[str, str], now: float | None = None) -> float | None:
    """``retry-after-ms``, ``retry-after`` seconds, or ``retry-after`` HTTP date, in seconds."""
    lowered = {k.lower(): v for k, v in headers.items()}
    raw_ms = lowered.get("retry-after-ms")
    if raw_ms is not None:
        try:
            return max(0.0, float(raw_ms) / 1000)
        except ValueError:
            pass
    raw = lowered.get("retry-after")
    if raw is None:
        return None
    try:
        return max(0.0, float(raw))
    except ValueError:
        pass
    try:
        when = parsedate_to_datetime(raw)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - (time.time() if now is None else now))


def _wait(policy: RetryPolicy):
    def wait(state: tenacity.RetryCallState) -> float:
        exc = state.outcome.exception() if state.outcome else None
        return backoff(policy, state.attempt_number, exc)
    return wait


def _before_sleep(policy: RetryPolicy):
    def log(state: tenacity.RetryCallState) -> None:
        exc = state.outcome.exception() if state.outcome else None
        logger.info("retrying in %.2fs (attempt %d failed: %s)",
                    state.upcoming_sleep, state.attempt_number, exc)
        if policy.on_retry is not None and exc is not None:
            policy.on_retry(state.attempt_number, state.upcoming_sleep, exc)
    return log


def _kwargs(policy: RetryPolicy) -> dict:
    return {"stop": tenacity.stop_after_attempt(policy.max_retries + 1), "wait": _wait(policy),
                "retry": tenacity.retry_if_exception(is_retryable), "reraise": True,
                "before_sleep": _before_sleep(policy)}


def retrying(policy: RetryPolicy) -> tenacity.Retrying:
    return tenacity.Retrying(**_kwargs(policy))


def async_retrying(policy: RetryPolicy) -> tenacity.AsyncRetrying:
    return tenacity.AsyncRetrying(**_kwargs(policy))
