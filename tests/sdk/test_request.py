"""Request building and wire mapping: pure functions of the history and options."""

from __future__ import annotations

import json

import pytest
from kvagent import AssistantMessage, SystemMessage, ToolCall, ToolResultMessage, UserMessage, tool
from kvagent._request import build_chat_request
from kvagent._wire import messages_to_wire, tool_choice_to_wire, tool_to_wire
from kvagent.protocol import CACHE_TOKEN_HEADER, SESSION_HEADER


def build(**kw):
    args = {"base_url": "http://h:1/v1/", "model": "m", "messages": [{"role": "user",
            "content": "hi"}], "session_id": "conv-1", "cache_token": None}
    args.update(kw)
    return build_chat_request(**args)


def test_streaming_body_always_asks_for_usage() -> None:
    req = build(extra_body={"stream_options": {"continuous_usage_stats": True}})
    assert req.url == "http://h:1/v1/chat/completions"
    assert req.json["stream"] is True
    assert req.json["stream_options"] == {"continuous_usage_stats": True, "include_usage": True}
    assert list(req.json)[:2] == ["model", "messages"]  # prefix-stable layout
    assert json.loads(req.body) == req.json


def test_body_is_compact_deterministic_utf8() -> None:
    req = build(messages=[{"role": "user", "content": "18°C"}])
    assert req.body.startswith(b'{"model":"m","messages":[{"role":"user","content":"18\xc2\xb0C"}]')
    assert build(messages=[{"role": "user", "content": "18°C"}]).body == req.body


def test_headers_carry_session_token_and_key() -> None:
    req = build(cache_token="kva1.abc.def", api_key="sk-1", headers={"X-Extra": "1"})
    assert req.headers[SESSION_HEADER] == "conv-1"
    assert req.headers[CACHE_TOKEN_HEADER] == "kva1.abc.def"
    assert req.headers["Authorization"] == "Bearer sk-1"
    assert req.headers["X-Extra"] == "1"
    assert CACHE_TOKEN_HEADER not in build().headers


def test_sampling_params_drop_none_and_extra_body_wins() -> None:
    req = build(params={"temperature": 0.0, "max_tokens": None, "seed": 7},
                extra_body={"top_k": 5, "seed": 8})
    assert req.json["temperature"] == 0.0 and "max_tokens" not in req.json
    assert req.json["seed"] == 8 and req.json["top_k"] == 5


@pytest.mark.parametrize("field", ["messages", "stream"])
def test_extra_body_cannot_replace_session_fields(field: str) -> None:
    with pytest.raises(ValueError, match=field):
        build(extra_body={field: []})


def test_tool_choice_without_tools_is_an_error_except_none() -> None:
    with pytest.raises(ValueError, match="needs tools"):
        build(tool_choice="required")
    assert "tool_choice" not in build(tool_choice="none").json


def test_messages_map_to_openai_wire_format() -> None:
    call = ToolCall(id="c1", name="get_time", arguments='{"tz": "UTC"}')
    wire = messages_to_wire([
        SystemMessage(content="sys"), UserMessage(content="u"),
        AssistantMessage(tool_calls=(call,), cache_token="kva1.x.y", finish_reason="tool_calls"),
        ToolResultMessage(tool_call_id="c1", name="get_time", content="12:00"),
        AssistantMessage(content="done"),
    ])
    assert wire == [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "u"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "get_time", "arguments": '{"tz": "UTC"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "12:00"},
        {"role": "assistant", "content": "done"},
    ]


@pytest.mark.parametrize("raw", ["{not json", "[1, 2]", ""])
def test_junk_tool_arguments_are_sent_back_as_empty_object(raw: str) -> None:
    wire = messages_to_wire([AssistantMessage(tool_calls=(ToolCall(id="c", name="f",
                                                                   arguments=raw),))])
    assert wire[0]["tool_calls"][0]["function"]["arguments"] == "{}"


def test_tool_and_tool_choice_wire_forms() -> None:
    @tool
    def ping(host: str) -> str:
        """Ping a host."""
        return host

    assert tool_to_wire(ping) == {"type": "function", "function": {
        "name": "ping", "description": "Ping a host.", "parameters": {
            "type": "object", "properties": {"host": {"type": "string"}},
            "required": ["host"], "additionalProperties": False}}}
    assert ping.to_wire() == tool_to_wire(ping)  # the public spelling of the same mapping
    assert tool_choice_to_wire(ping) == {"type": "function", "function": {"name": "ping"}}
    assert tool_choice_to_wire("required") == "required"
    assert tool_choice_to_wire({"type": "function", "function": {"name": "x"}})["type"] == \
        "function"
