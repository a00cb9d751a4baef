"""The Anthropic Messages translation: requests to chat bodies, chat answers to messages.

Pure: what vLLM's own `/v1/messages` does with the same input is checked against a real
node in tests/integrations/test_messages_vs_vllm.py.
"""

from __future__ import annotations

import importlib
import json
from typing import Any

import httpx
import pytest
from kvagent_server.router.apis.anthropic import (
    ApiError,
    MessageStream,
    count_tokens_chat,
    error_body,
    error_type,
    message_from_chat,
    to_chat,
)

MODEL = "kvagent-demo"
TOOL = {"name": "get_metrics", "description": "Metrics of a service.",
        "input_schema": {"type": "object", "properties": {"service": {"type": "string"}}}}


def req(**fields: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 16,
                            "messages": [{"role": "user", "content": "Hi"}]}
    body.update(fields)
    return body


def events(raw: list[bytes]) -> list[tuple[str, dict[str, Any]]]:
    """(event name, data) of each SSE event."""
    out = []
    for event in raw:
        name, data = event.decode().rstrip("\n").split("\n")
        assert name.startswith("event: ") and data.startswith("data: ")
        out.append((name[7:], json.loads(data[6:])))
    return out


def run_stream(chunks: list[dict[str, Any] | None]) -> list[tuple[str, dict[str, Any]]]:
    stream = MessageStream(model=MODEL)
    return events([e for c in chunks for e in stream.feed(c)])


def chunk(delta: dict[str, Any] | None = None, finish: str | None = None,
          **extra: Any) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0, "delta": delta or {}, "finish_reason": finish}
    choice.update(extra)
    return {"id": "chatcmpl-abc", "object": "chat.completion.chunk", "model": MODEL,
            "choices": [choice]}


ROLE = chunk({"role": "assistant", "content": ""})


def usage_chunk(prompt: int = 10, completion: int = 3, cached: int | None = 4,
                **extra: Any) -> dict[str, Any]:
    usage: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": completion,
                             "total_tokens": prompt + completion}
    if cached is not None:
        usage["prompt_tokens_details"] = {"cached_tokens": cached}
    return {"id": "chatcmpl-abc", "choices": [], "usage": usage, **extra}


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize(("status", "kind"), [
    (400, "invalid_request_error"), (401, "authentication_error"), (403, "permission_error"),
    (404, "not_found_error"), (413, "request_too_large"), (422, "invalid_request_error"),
    (429, "rate_limit_error"), (500, "api_error"), (502, "api_error"), (503, "api_error"),
    (529, "overloaded_error")])
def test_error_type(status: int, kind: str) -> None:
    assert error_type(status) == kind


def test_error_body_and_api_error() -> None:
    assert error_body("not_found_error", "no") == {
        "type": "error", "error": {"type": "not_found_error", "message": "no"}}
    err = ApiError(413, "too big", type_="request_too_large")
    assert (err.status, err.type, err.message, str(err)) == (
        413, "request_too_large", "too big", "too big")
    assert ApiError(400, "x").type == "invalid_request_error"


# --------------------------------------------------------------------------- to_chat


def test_minimal_request() -> None:
    assert to_chat(req()) == {
        "model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 16, "max_completion_tokens": 16, "stream": False}


def test_system_string_and_blocks_without_billing_header() -> None:
    assert to_chat(req(system="Be terse."))["messages"][0] == {
        "role": "system", "content": "Be terse."}
    blocks = [{"type": "text", "text": "x-anthropic-billing-header: cc_version=1; cch=9"},
              {"type": "text", "text": "You are Claude Code.",
               "cache_control": {"type": "ephemeral"}},
              {"type": "text", "text": " Be terse."}]
    assert to_chat(req(system=blocks))["messages"][:2] == [
        {"role": "system", "content": "You are Claude Code. Be terse."},
        {"role": "user", "content": "Hi"}]
    only_header = [{"type": "text", "text": "x-anthropic-billing-header: x"}]
    assert to_chat(req(system=only_header))["messages"] == [{"role": "user", "content": "Hi"}]


def test_inline_system_messages_kept_or_merged() -> None:
    body = req(system="S.", messages=[
        {"role": "user", "content": "a"},
        {"role": "system", "content": [{"type": "text", "text": "Reminder."}]},
        {"role": "system", "content": "x-anthropic-billing-header: y"},
        {"role": "user", "content": "b"}])
    assert to_chat(body)["messages"] == [
        {"role": "system", "content": "S."}, {"role": "user", "content": "a"},
        {"role": "system", "content": "Reminder."}, {"role": "user", "content": "b"}]
    assert to_chat(body, merge_inline_system=True)["messages"] == [
        {"role": "system", "content": "S.Reminder."}, {"role": "user", "content": "a"},
        {"role": "user", "content": "b"}]


def test_tool_turns() -> None:
    body = req(tools=[TOOL], messages=[
        {"role": "user", "content": "Check the api."},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "Use the tool.", "signature": "s"},
            {"type": "redacted_thinking", "data": "opaque"},
            {"type": "text", "text": "Checking."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_metrics",
             "input": {"service": "api", "n": [1, "é"]}},
            {"type": "tool_use", "id": "toolu_2", "name": "get_metrics", "input": {}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "p99 120ms",
             "cache_control": {"type": "ephemeral"}},
            {"type": "tool_result", "tool_use_id": "toolu_2", "is_error": True,
             "content": [{"type": "text", "text": "failed"}, {"type": "text", "text": "twice"}]},
            {"type": "text", "text": "Summarise."}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_3"}]}])
    assert to_chat(body)["messages"] == [
        {"role": "user", "content": "Check the api."},
        {"role": "assistant", "reasoning": "Use the tool.", "content": "Checking.",
         "tool_calls": [
             {"id": "toolu_1", "type": "function", "function": {
                 "name": "get_metrics",
                 "arguments": '{"service": "api", "n": [1, "\\u00e9"]}'}},
             {"id": "toolu_2", "type": "function",
              "function": {"name": "get_metrics", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "p99 120ms"},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "failed\ntwice"},
        {"role": "user", "content": "Summarise."},
        {"role": "tool", "tool_call_id": "toolu_3", "content": ""}]


def test_assistant_without_content_and_tool_result_from_assistant() -> None:
    body = req(messages=[
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": [{"type": "text", "text": ""}]},
        {"role": "assistant", "content": [
            {"type": "tool_result", "tool_use_id": "t", "content": [{"type": "text", "text": "r"}]},
            {"type": "tool_use", "name": "f"}]}])
    assert to_chat(body)["messages"][1:] == [
        {"role": "assistant"},
        {"role": "assistant", "content": "Tool result: [{'type': 'text', 'text': 'r'}]",
         "tool_calls": [{"id": "call_2_1", "type": "function",
                         "function": {"name": "f", "arguments": "{}"}}]}]


def test_images() -> None:
    png = {"type": "base64", "media_type": "image/png", "data": "AAAA"}
    body = req(messages=[
        {"role": "user", "content": [
            {"type": "image", "source": png},
            {"type": "image", "source": {"type": "url", "url": "https://x/y.jpg"}},
            {"type": "text", "text": "What is this?"}]},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f",
                                           "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [
            {"type": "text", "text": "shot"},
            {"type": "image", "source": {"type": "base64", "data": "BBBB"}},
            {"type": "tool_reference", "tool_name": "g"}]}]}])
    assert to_chat(body)["messages"] == [
        {"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
            {"type": "image_url", "image_url": {"url": "https://x/y.jpg"}},
            {"type": "text", "text": "What is this?"}]},
        {"role": "assistant", "tool_calls": [
            {"id": "t", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "t", "content": "shot"},
        {"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/jpeg;base64,BBBB"}}]},
        {"role": "tool", "tool_call_id": "t",
         "content": [{"type": "tool_reference", "name": "g"}]}]


def test_sampling_fields_and_dropped_fields() -> None:
    body = req(temperature=0, top_p=0.9, top_k=5, stop_sequences=["END"],
               metadata={"user_id": "u1"}, cache_salt="s", kv_transfer_params={"x": 1},
               ec_transfer_params={"y": 1}, service_tier="auto",
               chat_template_kwargs={"foo": 1}, vllm_xargs={"a": 1})
    assert to_chat(body) == {
        "model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 16,
        "max_completion_tokens": 16, "stop": ["END"], "temperature": 0, "top_p": 0.9,
        "top_k": 5, "vllm_xargs": {"a": 1}, "chat_template_kwargs": {"foo": 1},
        "stream": False}


def test_stream_options() -> None:
    assert to_chat(req(stream=True))["stream_options"] == {"include_usage": True}
    assert to_chat(req(stream=True), continuous_usage=True)["stream_options"] == {
        "include_usage": True, "continuous_usage_stats": True}
    assert "stream_options" not in to_chat(req(stream=False))


@pytest.mark.parametrize(("choice", "expected"), [
    (None, {"tool_choice": "auto"}),
    ({"type": "auto"}, {"tool_choice": "auto", "parallel_tool_calls": True}),
    ({"type": "any", "disable_parallel_tool_use": True},
     {"tool_choice": "required", "parallel_tool_calls": False}),
    ({"type": "none"}, {"tool_choice": "none", "parallel_tool_calls": True}),
    ({"type": "tool", "name": "get_metrics"},
     {"tool_choice": {"type": "function", "function": {"name": "get_metrics"}},
      "parallel_tool_calls": True}),
])
def test_tools_and_tool_choice(choice: dict[str, Any] | None,
                               expected: dict[str, Any]) -> None:
    body = req(tools=[TOOL, {"name": "ping", "input_schema": {"properties": {}},
                             "strict": True, "cache_control": {"type": "ephemeral"}}])
    if choice is not None:
        body["tool_choice"] = choice
    chat = to_chat(body)
    assert chat["tools"] == [
        {"type": "function", "function": {
            "name": "get_metrics", "description": "Metrics of a service.",
            "parameters": TOOL["input_schema"]}},
        {"type": "function", "function": {
            "name": "ping", "parameters": {"properties": {}, "type": "object"},
            "strict": True}}]
    assert {k: chat[k] for k in expected} == expected
    assert ("parallel_tool_calls" in chat) == (choice is not None)
    assert body["tools"][1]["input_schema"] == {"properties": {}}  # not mutated


def test_tool_choice_without_tools() -> None:
    assert "tool_choice" not in to_chat(req(tool_choice={"type": "auto"}))
    assert to_chat(req(tool_choice={"type": "none"}))["tool_choice"] == "none"
    assert "tools" not in to_chat(req(tools=[]))
    # vLLM answers "any" without tools (its chat rendering drops the choice): so do we.
    chat = to_chat(req(tool_choice={"type": "any"}))
    assert "tool_choice" not in chat and "tools" not in chat
    with pytest.raises(ApiError, match="^tool_choice.name: no tool named 'nope'"):
        to_chat(req(tools=[TOOL], tool_choice={"type": "tool", "name": "nope"}))


def test_tool_addition_and_removal() -> None:
    ping = {"name": "ping", "input_schema": {"type": "object"}, "defer_loading": True}
    body = req(tools=[TOOL, ping], messages=[
        {"role": "system", "content": [
            {"type": "tool_removal", "tool": {"type": "tool_reference", "name": "get_metrics"}},
            {"type": "tool_addition", "tool": {"type": "tool_reference", "name": "ping"}},
            {"type": "tool_addition", "tool": {"type": "tool_definition", "definition": {
                "name": "new", "input_schema": {}}}}]},
        {"role": "user", "content": "Hi"}])
    chat = to_chat(body)
    assert [t["function"] for t in chat["tools"]] == [
        {"name": "ping", "parameters": {"type": "object"}},
        {"name": "new", "parameters": {"type": "object"}}]
    assert chat["messages"] == [{"role": "user", "content": "Hi"}]
    body["messages"][0]["content"][1]["tool"]["name"] = "ghost"
    with pytest.raises(ApiError, match="^messages.0.content.1.tool.name: tool_addition "
                                       "references tool 'ghost'"):
        to_chat(body)


def test_thinking_and_output_config() -> None:
    assert to_chat(req(thinking={"type": "disabled"}))["reasoning_effort"] == "low"
    assert to_chat(req(thinking={"type": "disabled"}),
                   disabled_thinking_effort="none")["reasoning_effort"] == "none"
    enabled = to_chat(req(max_tokens=2048, thinking={"type": "enabled",
                                                      "budget_tokens": 1024}))
    assert enabled["thinking_token_budget"] == 1024 and "reasoning_effort" not in enabled
    adaptive = to_chat(req(thinking={"type": "adaptive", "display": "omitted"},
                           output_config={"effort": "high"}))
    assert adaptive["reasoning_effort"] == "high" and "thinking_token_budget" not in adaptive
    schema = {"type": "object", "properties": {"a": {"type": "string"}}}
    fmt = to_chat(req(output_config={"format": {"type": "json_schema", "schema": schema}}))
    assert fmt["response_format"] == {"type": "json_schema", "json_schema": {
        "name": "json_schema", "schema": schema}}
    with pytest.raises(ValueError, match="disabled_thinking_effort"):
        to_chat(req(), disabled_thinking_effort="lots")


@pytest.mark.parametrize(("body", "message"), [
    ({"max_tokens": 4, "messages": [{"role": "user", "content": "x"}]}, "model: is required"),
    (req(model=""), "model: must be a non-empty string"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}]},
     "max_tokens: is required"),
    (req(max_tokens=0), "max_tokens: must be a positive integer"),
    (req(max_tokens="many"), "max_tokens: must be a positive integer"),
    (req(max_tokens=4.5), "max_tokens: must be a positive integer"),
    ({"model": MODEL, "max_tokens": 4}, "messages: is required"),
    (req(messages=[]), "messages: must be a non-empty list"),
    (req(messages=["hi"]), "messages.0: must be an object"),
    (req(messages=[{"role": "tool", "content": "x"}]), "messages.0.role: must be"),
    (req(messages=[{"role": "user"}]), "messages.0.content: is required"),
    (req(messages=[{"role": "user", "content": 3}]), "messages.0.content: must be"),
    (req(messages=[{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                   {"role": "user", "content": [{"type": "document", "source": {}}]}]),
     "messages.2.content.0.type: unsupported content block type 'document'"),
    (req(messages=[{"role": "user", "content": [{"text": "x"}]}]),
     "messages.0.content.0.type: is required"),
    (req(messages=[{"role": "user", "content": [{"type": "text", "text": 1}]}]),
     "messages.0.content.0.text: must be a string"),
    (req(messages=[{"role": "assistant", "content": [
        {"type": "tool_use", "id": "t", "name": "f", "input": "{}"}]}]),
     "messages.0.content.0.input: must be an object"),
    (req(messages=[{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t", "content": 5}]}]),
     "messages.0.content.0.content: must be a string or a list"),
    (req(messages=[{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t", "is_error": "yes"}]}]),
     "messages.0.content.0.is_error: must be a bool"),
    (req(messages=[{"role": "user", "content": [
        {"type": "tool_removal", "tool": {"type": "tool_reference", "name": "f"}}]}]),
     "messages.0.content.0.type: tool_removal blocks are only allowed"),
    (req(system=[{"type": "image_url"}]), "system.0.type: unsupported"),
    (req(tools=[{"name": "f"}]), "tools.0.input_schema: is required"),
    (req(tools={"name": "f"}), "tools: must be a list"),
    (req(tools=[TOOL], tool_choice={"type": "tool"}), "tool_choice.name: is required"),
    (req(tool_choice={"type": "sometimes"}), "tool_choice.type: must be"),
    (req(stop_sequences="END"), "stop_sequences: must be a list"),
    (req(stop_sequences=["a", 1]), "stop_sequences.1: must be a string"),
    (req(temperature="hot"), "temperature: must be a number"),
    (req(top_k=1.5), "top_k: must be an int"),
    (req(stream="sometimes"), "stream: must be a bool"),
    (req(thinking={"type": "enabled", "budget_tokens": 100}),
     "thinking.budget_tokens: must be an integer of at least 1024"),
    (req(max_tokens=1024, thinking={"type": "enabled", "budget_tokens": 1024}),
     "thinking.budget_tokens: must be less than max_tokens"),
    (req(thinking={"type": "maybe"}), "thinking.type: must be"),
    (req(output_config={"effort": "extreme"}), "output_config.effort: must be one of"),
    (req(metadata="u1"), "metadata: must be an object"),
])
def test_invalid_requests(body: dict[str, Any], message: str) -> None:
    with pytest.raises(ApiError) as info:
        to_chat(body)
    assert info.value.status == 400 and info.value.type == "invalid_request_error"
    assert info.value.message.startswith(message), info.value.message


# --------------------------------------------------------------------------- count_tokens


def test_count_tokens_chat() -> None:
    body = {"model": MODEL, "system": "S.", "messages": [{"role": "user", "content": "Hi"}],
            "tools": [TOOL], "tool_choice": {"type": "any"}}
    assert count_tokens_chat(body) == {
        "model": MODEL, "add_generation_prompt": True,
        "messages": [{"role": "system", "content": "S."}, {"role": "user", "content": "Hi"}],
        "tools": [{"type": "function", "function": {
            "name": "get_metrics", "description": "Metrics of a service.",
            "parameters": TOOL["input_schema"]}}]}
    thinking = count_tokens_chat({**body, "thinking": {"type": "disabled"},
                                  "chat_template_kwargs": {"x": 1}})
    assert thinking["chat_template_kwargs"] == {"x": 1, "enable_thinking": True,
                                                "reasoning_effort": "low"}
    off = count_tokens_chat({**body, "thinking": {"type": "disabled"}},
                            disabled_thinking_effort="none")
    assert off["chat_template_kwargs"] == {"enable_thinking": False, "reasoning_effort": "none"}
    with pytest.raises(ApiError, match="^messages: is required"):
        count_tokens_chat({"model": MODEL})


# --------------------------------------------------------------------------- whole answers


def chat_answer(message: dict[str, Any], finish: str = "stop", stop_reason: Any = None,
                usage: dict[str, Any] | None = None, **extra: Any) -> dict[str, Any]:
    return {"id": "chatcmpl-abc123", "object": "chat.completion", "model": MODEL,
            "choices": [{"index": 0, "message": {"role": "assistant", **message},
                         "finish_reason": finish, "stop_reason": stop_reason}],
            "usage": usage or {"prompt_tokens": 12, "completion_tokens": 3,
                               "total_tokens": 15}, **extra}


def test_message_from_chat_text() -> None:
    assert message_from_chat(chat_answer({"content": "Hello."}), model="claude-x") == {
        "id": "msg_abc123", "type": "message", "role": "assistant", "model": "claude-x",
        "content": [{"type": "text", "text": "Hello."}], "stop_reason": "end_turn",
        "usage": {"input_tokens": 12, "output_tokens": 3}}  # null fields left out, as vLLM


def test_message_from_chat_tools_reasoning_usage_and_kvagent() -> None:
    kva = {"cache_token": "kva1.x", "reused_tokens": 64, "path": "pd_reuse"}
    chat = chat_answer(
        {"content": "Let me check.", "reasoning": "Think.", "tool_calls": [
            {"id": "chatcmpl-tool-1", "type": "function",
             "function": {"name": "get_metrics", "arguments": '{"service": "api"}'}},
            {"id": "chatcmpl-tool-2", "type": "function",
             "function": {"name": "get_metrics", "arguments": "not json"}}]},
        finish="tool_calls",
        usage={"prompt_tokens": 100, "completion_tokens": 9, "total_tokens": 109,
               "prompt_tokens_details": {"cached_tokens": 64}}, kvagent=kva)
    msg = message_from_chat(chat, model=MODEL)
    thinking, text, call, bad = msg["content"]
    assert thinking["type"] == "thinking" and thinking["thinking"] == "Think."
    assert len(thinking["signature"]) == 32
    assert text == {"type": "text", "text": "Let me check."}
    assert call == {"type": "tool_use", "id": "chatcmpl-tool-1", "name": "get_metrics",
                    "input": {"service": "api"}}
    assert bad["input"] == {}
    assert msg["stop_reason"] == "tool_use"
    assert msg["usage"] == {"input_tokens": 36, "output_tokens": 9,
                            "cache_read_input_tokens": 64}
    assert msg["kvagent"] == kva
    legacy = message_from_chat(chat_answer({"content": None, "reasoning_content": "R"}),
                               model=MODEL)
    assert [b["type"] for b in legacy["content"]] == ["thinking"]


@pytest.mark.parametrize(("finish", "stop", "calls", "expected"), [
    ("length", None, False, ("max_tokens", None)),
    ("length", "END", True, ("max_tokens", None)),
    ("stop", None, False, ("end_turn", None)),
    ("stop", 151645, False, ("end_turn", None)),
    ("stop", "END", False, ("stop_sequence", "END")),
    ("stop", None, True, ("tool_use", None)),  # a named tool's call finishes with "stop"
    ("tool_calls", None, True, ("tool_use", None)),
    ("abort", None, False, (None, None)),
])
def test_stop_reasons(finish: str, stop: Any, calls: bool,
                      expected: tuple[str | None, str | None]) -> None:
    message: dict[str, Any] = {"content": "x"}
    if calls:
        message["tool_calls"] = [{"id": "c", "type": "function",
                                  "function": {"name": "f", "arguments": "{}"}}]
    msg = message_from_chat(chat_answer(message, finish=finish, stop_reason=stop), model=MODEL)
    assert (msg.get("stop_reason"), msg.get("stop_sequence")) == expected


def test_empty_answer_has_one_empty_text_block() -> None:
    msg = message_from_chat(chat_answer({"content": ""}), model=MODEL)
    assert msg["content"] == [{"type": "text", "text": ""}]
    assert message_from_chat({"choices": []}, model=MODEL)["content"] == [
        {"type": "text", "text": ""}]


# --------------------------------------------------------------------------- streams


def test_stream_text() -> None:
    kva = {"cache_token": None, "reused_tokens": 0, "path": "fresh"}
    got = run_stream([ROLE, chunk({"content": "Hel"}), chunk({"content": "lo"}),
                      chunk({"content": ""}, finish="stop", stop_reason=None),
                      usage_chunk(kvagent=kva), None])
    assert got == [
        ("message_start", {"type": "message_start", "message": {
            "id": "msg_abc", "type": "message", "role": "assistant", "content": [],
            "model": MODEL, "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": 0, "output_tokens": 0}}}),
        ("content_block_start", {"type": "content_block_start", "index": 0,
                                 "content_block": {"type": "text", "text": ""}}),
        ("content_block_delta", {"type": "content_block_delta", "index": 0,
                                 "delta": {"type": "text_delta", "text": "Hel"}}),
        ("content_block_delta", {"type": "content_block_delta", "index": 0,
                                 "delta": {"type": "text_delta", "text": "lo"}}),
        ("content_block_stop", {"type": "content_block_stop", "index": 0}),
        ("message_delta", {"type": "message_delta",
                           "delta": {"stop_reason": "end_turn", "stop_sequence": None},
                           "usage": {"input_tokens": 6, "output_tokens": 3,
                                     "cache_read_input_tokens": 4},
                           "kvagent": kva}),
        ("message_stop", {"type": "message_stop"})]


def test_stream_message_start_usage_from_continuous_usage() -> None:
    first = {**ROLE, "usage": {"prompt_tokens": 9, "completion_tokens": 0, "total_tokens": 9}}
    got = run_stream([first])
    assert got[0][1]["message"]["usage"] == {"input_tokens": 9, "output_tokens": 0}


def test_stream_stop_sequence_and_length() -> None:
    got = run_stream([ROLE, chunk({"content": "a"}, finish="stop", stop_reason="END"),
                      usage_chunk(cached=None), None])
    assert got[-2][1]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "END"}
    assert got[-2][1]["usage"] == {"input_tokens": 10, "output_tokens": 3}
    got = run_stream([ROLE, chunk({"content": "a"}, finish="length"), usage_chunk(), None])
    assert got[-2][1]["delta"]["stop_reason"] == "max_tokens"


def tool_chunks(call_id: str, name: str, args: list[str], index: int = 0) -> list[dict[str, Any]]:
    first = chunk({"tool_calls": [{"index": index, "id": call_id, "type": "function",
                                   "function": {"name": name, "arguments": ""}}]})
    return [first, *(chunk({"tool_calls": [{"index": index, "function": {"arguments": a}}]})
                     for a in args)]


def test_stream_text_then_tool_calls_with_held_text() -> None:
    got = run_stream([
        ROLE, chunk({"content": "Checking."}),
        *tool_chunks("call_1", "get_metrics", ['{"service"', ': "api"}']),
        chunk({"content": " trailing"}),
        *tool_chunks("call_2", "ping", ["{}"], index=1),
        chunk({}, finish="tool_calls"), usage_chunk(), None])
    shape = [(name, data.get("index"), (data.get("content_block") or data.get("delta") or {})
              .get("type")) for name, data in got]
    assert shape == [
        ("message_start", None, None),
        ("content_block_start", 0, "text"), ("content_block_delta", 0, "text_delta"),
        ("content_block_stop", 0, None),
        ("content_block_start", 1, "tool_use"),
        ("content_block_delta", 1, "input_json_delta"),
        ("content_block_delta", 1, "input_json_delta"),
        ("content_block_stop", 1, None),
        # text that came while the tool call's block was open, as its own block
        ("content_block_start", 2, "text"), ("content_block_delta", 2, "text_delta"),
        ("content_block_stop", 2, None),
        ("content_block_start", 3, "tool_use"),
        ("content_block_delta", 3, "input_json_delta"),
        ("content_block_stop", 3, None),
        ("message_delta", None, None), ("message_stop", None, None)]
    assert got[4][1]["content_block"] == {"type": "tool_use", "id": "call_1",
                                          "name": "get_metrics", "input": {}}
    assert "".join(d["delta"]["partial_json"] for n, d in got[5:7]) == '{"service": "api"}'
    assert got[9][1]["delta"]["text"] == " trailing"
    assert got[-2][1]["delta"]["stop_reason"] == "tool_use"


def test_stream_tool_call_cut_by_stop_string() -> None:
    got = run_stream([ROLE, *tool_chunks("c", "f", ['{"a": ']),
                      chunk({}, finish="stop", stop_reason="}"), usage_chunk(), None])
    assert got[-2][1]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "}"}
    got = run_stream([ROLE, *tool_chunks("c", "f", ['{"a": 1}']),
                      chunk({}, finish="stop", stop_reason="}"), usage_chunk(), None])
    assert got[-2][1]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}


def test_stream_reasoning_then_text() -> None:
    got = run_stream([ROLE, chunk({"reasoning": "Hmm"}), chunk({"reasoning_content": "."}),
                      chunk({"content": "Yes."}, finish="stop"), usage_chunk(), None])
    names = [(n, d.get("index"), (d.get("delta") or d.get("content_block") or {}).get("type"))
             for n, d in got[1:6]]
    assert names == [("content_block_start", 0, "thinking"),
                     ("content_block_delta", 0, "thinking_delta"),
                     ("content_block_delta", 0, "thinking_delta"),
                     ("content_block_delta", 0, "signature_delta"),
                     ("content_block_stop", 0, None)]
    assert got[1][1]["content_block"] == {"type": "thinking", "thinking": ""}
    assert got[6][1]["content_block"] == {"type": "text", "text": ""}


def test_stream_error_and_after() -> None:
    stream = MessageStream(model=MODEL)
    stream.feed(ROLE)
    err = events(stream.feed({"error": {"message": "engine died", "type": "InternalServerError",
                                        "code": 500}}))
    assert err == [("error", {"type": "error", "error": {"type": "api_error",
                                                         "message": "engine died"}})]
    assert stream.feed(None) == []
    first = run_stream([{"error": {"message": "busy", "code": 429}}])
    assert first == [("error", {"type": "error", "error": {"type": "rate_limit_error",
                                                           "message": "busy"}})]


def test_stream_done_without_usage_chunk() -> None:
    got = run_stream([ROLE, chunk({"content": "a"}, finish="stop"), None])
    assert [n for n, _ in got][-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert got[-2][1]["delta"]["stop_reason"] == "end_turn"


# --------------------------------------------------------------------------- the SDK reads it


def test_anthropic_sdk_reads_messages_and_streams() -> None:
    """The `anthropic` client parses the translated answers, whole and streamed."""
    anthropic = pytest.importorskip("anthropic")
    # The SDK's own HTTP package: httpx2 since anthropic 2.x (it rejects httpx objects).
    uses_httpx2 = hasattr(anthropic._base_client, "_reject_httpx_object")
    http = importlib.import_module("httpx2") if uses_httpx2 else httpx
    stream_chunks = [ROLE, chunk({"content": "Checking."}),
                     *tool_chunks("call_1", "get_metrics", ['{"service"', ': "api"}']),
                     chunk({}, finish="tool_calls"),
                     usage_chunk(kvagent={"path": "fresh"}), None]

    def answer(request: Any) -> Any:
        body = json.loads(request.content)
        assert to_chat(body)["model"] == MODEL
        if body.get("stream"):
            stream = MessageStream(model=body["model"])
            raw = b"".join(e for c in stream_chunks for e in stream.feed(c))
            return http.Response(200, content=raw,
                                 headers={"content-type": "text/event-stream"})
        chat = chat_answer({"content": "Hi.", "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "get_metrics", "arguments": '{"service": "db"}'}}]},
            finish="tool_calls")
        return http.Response(200, json=message_from_chat(chat, model=body["model"]))

    client = anthropic.Anthropic(api_key="k", base_url="http://router",
                                 http_client=http.Client(transport=http.MockTransport(answer)))
    kwargs: dict[str, Any] = {"model": MODEL, "max_tokens": 16, "tools": [TOOL],
                              "messages": [{"role": "user", "content": "Check."}]}
    whole = client.messages.create(**kwargs)
    assert [b.type for b in whole.content] == ["text", "tool_use"]
    assert whole.content[1].input == {"service": "db"} and whole.stop_reason == "tool_use"
    with client.messages.stream(**kwargs) as stream:
        final = stream.get_final_message()
    assert [b.type for b in final.content] == ["text", "tool_use"]
    assert final.content[1].input == {"service": "api"}
    assert final.stop_reason == "tool_use"
    assert final.usage.output_tokens == 3 and final.usage.input_tokens == 6
    assert final.usage.cache_read_input_tokens == 4


@pytest.mark.parametrize(("field", "sent", "served"), [
    ("max_tokens", "4", 4), ("max_tokens", 4.0, 4), ("top_k", "5", 5),
    ("temperature", "0.5", 0.5), ("stream", "yes", True), ("stream", "false", False)])
def test_typed_fields_are_converted_as_vllm_converts_them(field: str, sent: Any,
                                                          served: Any) -> None:
    chat = to_chat(req(**{field: sent}))
    assert chat[field] == served and type(chat[field]) is type(served)
