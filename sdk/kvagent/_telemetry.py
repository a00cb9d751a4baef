"""OpenTelemetry spans with GenAI semantic-convention names, via ``opentelemetry-api`` only.

Without an SDK configured by the application every call here is a no-op. One ``chat`` span
per turn, one ``execute_tool <name>`` span per tool call, both under an ``invoke_agent``
span when they happen inside ``run()``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any
from urllib.parse import urlsplit

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from .results import TurnResult

__all__ = ["end_turn", "fail_turn", "run_span", "start_turn", "tool_span"]

_TRACER_NAME = "kvagent"
_PROVIDER = "openai"  # the wire protocol spoken; kvagent-specific facts go under kvagent.*

_REQUEST_PARAMS = {
    "max_tokens": "gen_ai.request.max_tokens",
    "temperature": "gen_ai.request.temperature",
    "top_p": "gen_ai.request.top_p",
    "seed": "gen_ai.request.seed",
}


def _tracer() -> trace.Tracer:
    return trace.get_tracer(_TRACER_NAME)


def _server_attributes(url: str) -> dict[str, Any]:
    parts = urlsplit(url)
    out: dict[str, Any] = {}
    if parts.hostname:
        out["server.address"] = parts.hostname
    if parts.port:
        out["server.port"] = parts.port
    return out


def start_turn(*, model: str, session_id: str, url: str, body: Mapping[str, Any],
               sent_token: bool) -> Span:
    """Open the span of one chat turn (not made current: it lives across generator yields)."""
    attributes: dict[str, Any] = {
        "gen_ai.operation.name": "chat",
        "gen_ai.provider.name": _PROVIDER,
        "gen_ai.request.model": model,
        "gen_ai.conversation.id": session_id,
        "gen_ai.request.stream": True,
        "kvagent.cache_token.sent": sent_token,
        **_server_attributes(url),
    }
    for key, name in _REQUEST_PARAMS.items():
        value = body.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool):
            attributes[name] = value
    return _tracer().start_span(f"chat {model}", kind=SpanKind.CLIENT, attributes=attributes)


def end_turn(span: Span, result: TurnResult) -> None:
    attributes: dict[str, Any] = {"kvagent.cache_token.received": result.cache_token_received}
    if result.response_id:
        attributes["gen_ai.response.id"] = result.response_id
    if result.model:
        attributes["gen_ai.response.model"] = result.model
    if result.finish_reason:
        attributes["gen_ai.response.finish_reasons"] = (result.finish_reason,)
    if result.usage is not None:
        attributes["gen_ai.usage.input_tokens"] = result.usage.prompt_tokens
        attributes["gen_ai.usage.output_tokens"] = result.usage.completion_tokens
        attributes["gen_ai.usage.cache_read.input_tokens"] = result.usage.cached_tokens
    if result.time_to_first_chunk is not None:
        attributes["gen_ai.response.time_to_first_chunk"] = result.time_to_first_chunk
    if result.reused_tokens is not None:
        attributes["kvagent.reused_tokens"] = result.reused_tokens
    if result.path:
        attributes["kvagent.path"] = result.path
    span.set_attributes(attributes)
    span.end()


def fail_turn(span: Span, exc: BaseException) -> None:
    if isinstance(exc, GeneratorExit):
        span.set_attribute("kvagent.cancelled", True)  # caller stopped reading: not an error
    else:
        span.record_exception(exc)
        span.set_attribute("error.type", type(exc).__name__)
        span.set_status(Status(StatusCode.ERROR, str(exc)[:500]))
    span.end()


@contextmanager
def run_span(*, model: str, session_id: str) -> Iterator[Span]:
    """The parent of a tool loop's chat and tool spans; made current for its duration."""
    with _tracer().start_as_current_span(
        "invoke_agent", kind=SpanKind.INTERNAL,
        attributes={"gen_ai.operation.name": "invoke_agent", "gen_ai.provider.name": _PROVIDER,
                    "gen_ai.request.model": model, "gen_ai.conversation.id": session_id},
    ) as span:
        yield span


@contextmanager
def tool_span(name: str, call_id: str, parent: otel_context.Context | None = None
              ) -> Iterator[Span]:
    """``execute_tool <name>``; pass ``parent`` when running in a worker thread."""
    with _tracer().start_as_current_span(
        f"execute_tool {name}", context=parent, kind=SpanKind.INTERNAL,
        attributes={"gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": name,
                    "gen_ai.tool.call.id": call_id, "gen_ai.tool.type": "function"},
    ) as span:
        yield span


def mark_tool_error(span: Span, error_text: str) -> None:
    """A tool failure the model was told about: an error on the span, not an exception."""
    span.set_attribute("error.type", "tool_error")
    span.set_status(Status(StatusCode.ERROR, error_text[:500]))


def current_context() -> otel_context.Context:
    return otel_context.get_current()
