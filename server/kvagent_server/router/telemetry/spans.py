"""OpenTelemetry spans: one per turn, one per leg (a no-op unless an SDK is installed).

Attribute names follow the GenAI semantic conventions where they exist
(`gen_ai.conversation.id`, `gen_ai.request.model`, `gen_ai.usage.*`); the rest are
`kvagent.*`. Never internal addresses: node names (`p0`, `d1`) only.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import Span, Status, StatusCode

_tracer = trace.get_tracer("kvagent.router")


def start_turn(*, endpoint: str, model: str | None, session: str | None,
               tenant: str, arrived: float | None = None) -> Span:
    """The turn's span, from the request's arrival (`arrived`, a `time.perf_counter()`) so
    that it covers the receive stage. Not made current: a streamed turn ends in another
    task, where detaching a context attached here would fail; leg spans name it as parent
    instead."""
    attrs: dict[str, Any] = {"gen_ai.operation.name": "chat" if "chat" in endpoint
                             else "text_completion", "kvagent.tenant": tenant,
                             "http.route": endpoint}
    if model:
        attrs["gen_ai.request.model"] = model
    if session:
        attrs["gen_ai.conversation.id"] = session
    start_ns = None if arrived is None else \
        time.time_ns() - int((time.perf_counter() - arrived) * 1e9)
    return _tracer.start_span("kvagent.turn", attributes=attrs, start_time=start_ns)


@contextmanager
def leg_span(parent: Span | None, leg: str) -> Iterator[Span]:
    """A child span of the turn for one leg; set `kvagent.node` once the node is known."""
    context = trace.set_span_in_context(parent) if parent is not None else None
    span = _tracer.start_span(f"kvagent.{leg}_leg", context=context)
    try:
        yield span
    except BaseException as exc:
        span.set_status(Status(StatusCode.ERROR, type(exc).__name__))
        raise
    finally:
        span.end()


def record_outcome(span: Span, *, path: str, reused: int, prompt_tokens: int | None,
                   completion_tokens: int | None, reason: str | None) -> None:
    span.set_attribute("kvagent.path", path)
    span.set_attribute("kvagent.reused_tokens", reused)
    if reason:
        span.set_attribute("kvagent.reuse_miss_reason", reason)
    if prompt_tokens is not None:
        span.set_attribute("gen_ai.usage.input_tokens", prompt_tokens)
    if completion_tokens is not None:
        span.set_attribute("gen_ai.usage.output_tokens", completion_tokens)


def record_error(span: Span, message: str) -> None:
    span.set_status(Status(StatusCode.ERROR, message))
