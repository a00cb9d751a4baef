"""Spans with GenAI semantic-convention attributes, captured by the OpenTelemetry SDK."""

from __future__ import annotations

import pytest
from kvagent import NotFoundError, Session, tool
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode
from sdk_helpers import BASE_URL, MODEL, FakeServer, error_response, sse, stream_response

_EXPORTER = InMemorySpanExporter()
_PROVIDER = TracerProvider()
_PROVIDER.add_span_processor(SimpleSpanProcessor(_EXPORTER))


@pytest.fixture
def spans(monkeypatch: pytest.MonkeyPatch) -> InMemorySpanExporter:
    # The global provider can be set once per process; route kvagent's tracer to ours.
    monkeypatch.setattr(trace, "get_tracer", lambda name, *a, **k: _PROVIDER.get_tracer(name))
    _EXPORTER.clear()
    return _EXPORTER


@tool
def get_weather(city: str, unit: str = "c") -> str:
    return f"sunny in {city}"


@tool
def get_time(timezone: str) -> str:
    raise RuntimeError("clock broken")


def test_one_chat_span_per_turn_with_gen_ai_attributes(spans: InMemorySpanExporter) -> None:
    server = FakeServer(stream_response(sse("router_text.sse")))
    Session(BASE_URL, MODEL, transport=server.transport, session_id="conv-1",
            max_tokens=16, temperature=0.0).send("hi")
    (span,) = spans.get_finished_spans()
    attrs = dict(span.attributes)
    assert span.name == f"chat {MODEL}" and span.kind == trace.SpanKind.CLIENT
    assert attrs["gen_ai.operation.name"] == "chat"
    assert attrs["gen_ai.conversation.id"] == "conv-1"
    assert attrs["gen_ai.request.model"] == MODEL
    assert attrs["gen_ai.request.max_tokens"] == 16 and attrs["gen_ai.request.temperature"] == 0
    assert attrs["gen_ai.usage.input_tokens"] == 42
    assert attrs["gen_ai.usage.output_tokens"] == 8
    assert attrs["gen_ai.usage.cache_read.input_tokens"] == 32
    assert attrs["gen_ai.response.time_to_first_chunk"] >= 0
    assert attrs["gen_ai.response.finish_reasons"] == ("stop",)
    assert attrs["kvagent.reused_tokens"] == 32 and attrs["kvagent.path"] == "pd_reuse"
    assert attrs["kvagent.cache_token.received"] is True
    assert attrs["kvagent.cache_token.sent"] is False
    assert attrs["server.address"] == "kvagent.test"


def test_tool_loop_nests_chat_and_tool_spans(spans: InMemorySpanExporter) -> None:
    server = FakeServer(stream_response(sse("router_parallel_tools.sse")),
                        stream_response(sse("router_final_answer.sse")))
    Session(BASE_URL, MODEL, transport=server.transport,
            tools=[get_weather, get_time]).run("go")
    finished = spans.get_finished_spans()
    by_name = {s.name: s for s in finished}
    root = by_name["invoke_agent"]
    assert sorted(s.name for s in finished) == sorted([
        "invoke_agent", f"chat {MODEL}", f"chat {MODEL}", "execute_tool get_weather",
        "execute_tool get_time"])
    for span in finished:
        if span is not root:
            assert span.parent is not None and span.parent.span_id == root.context.span_id
    weather, clock = by_name["execute_tool get_weather"], by_name["execute_tool get_time"]
    assert weather.attributes["gen_ai.tool.call.id"] == "chatcmpl-tool-a1b2c3"
    assert weather.attributes["gen_ai.operation.name"] == "execute_tool"
    assert weather.status.status_code == StatusCode.UNSET
    assert clock.status.status_code == StatusCode.ERROR


def test_failed_turn_span_records_the_error(spans: InMemorySpanExporter) -> None:
    server = FakeServer(error_response(404, "no such model"))
    with pytest.raises(NotFoundError):
        Session(BASE_URL, MODEL, transport=server.transport).send("hi")
    (span,) = spans.get_finished_spans()
    assert span.status.status_code == StatusCode.ERROR
    assert span.attributes["error.type"] == "NotFoundError"
    assert span.events[0].name == "exception"


def test_no_sdk_configured_means_no_op() -> None:
    server = FakeServer(stream_response(sse("vllm_text.sse")))
    assert Session(BASE_URL, MODEL, transport=server.transport).send("hi").text


def test_every_gen_ai_and_server_name_exists_in_the_semantic_conventions() -> None:
    """The SDK writes attribute names as strings (the conventions package is not a runtime
    dependency: its GenAI names live in an ``_incubating`` module that moves between
    releases). This keeps them honest against the package the dev extra installs."""
    import re
    from pathlib import Path

    import kvagent._telemetry as module
    from opentelemetry.semconv._incubating.attributes import (
        error_attributes,
        gen_ai_attributes,
        server_attributes,
    )

    known = {value for mod in (gen_ai_attributes, server_attributes, error_attributes)
             for name, value in vars(mod).items() if name.isupper() and isinstance(value, str)}
    source = Path(module.__file__).read_text()
    used = set(re.findall(r'"((?:gen_ai|server|error)\.[a-z_.]+)"', source))
    assert len(used) >= 20
    assert used <= known, sorted(used - known)
