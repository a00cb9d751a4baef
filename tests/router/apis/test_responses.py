"""The Responses translation: requests as the chat bodies vLLM renders, answers and streams
back in vLLM's Responses shape (pure; no nodes)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from kvagent_server.router.apis.responses import (
    ApiError,
    ResponseStream,
    history,
    response_from_chat,
    to_chat,
)

WEATHER = {"type": "function", "name": "get_weather", "description": "Weather for a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}


def _events(raw: list[bytes]) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for event in raw:
        head, data = event.decode().rstrip("\n").split("\n")
        assert head.startswith("event: ") and data.startswith("data: ")
        body = json.loads(data[6:])
        assert body["type"] == head[7:]
        out.append((head[7:], body))
    return out


def _chunk(delta: dict[str, Any] | None = None, finish: str | None = None) -> dict[str, Any]:
    return {"id": "chatcmpl-1", "object": "chat.completion.chunk", "model": "m",
            "choices": [{"index": 0, "delta": delta or {}, "finish_reason": finish}]}


USAGE_CHUNK = {"id": "chatcmpl-1", "model": "m", "choices": [],
               "usage": {"prompt_tokens": 20, "completion_tokens": 3, "total_tokens": 23,
                         "prompt_tokens_details": {"cached_tokens": 16}},
               "kvagent": {"reused_tokens": 16}}


# ------------------------------------------------------------------------ to_chat

def test_string_input_with_instructions_is_a_system_and_a_user_message() -> None:
    chat = to_chat({"model": "m", "input": "hi", "instructions": "Be terse.",
                    "max_output_tokens": 8, "temperature": 0, "top_p": 0.5})
    assert chat == {"model": "m", "temperature": 0, "top_p": 0.5, "max_tokens": 8,
                    "messages": [{"role": "system", "content": "Be terse."},
                                 {"role": "user", "content": "hi"}]}


def test_fields_the_chat_leg_must_not_see_are_dropped() -> None:
    chat = to_chat({"input": "hi", "store": True, "previous_response_id": "resp_1",
                    "prompt_cache_key": "k", "include": ["reasoning.encrypted_content"],
                    "metadata": {"a": "b"}, "user": "u", "truncation": "auto",
                    "service_tier": "auto", "text": {"format": {"type": "text"}},
                    "tool_choice": "auto"})
    assert chat == {"messages": [{"role": "user", "content": "hi"}]}


def test_stream_asks_for_usage() -> None:
    chat = to_chat({"input": "hi", "stream": True})
    assert chat["stream"] is True and chat["stream_options"] == {"include_usage": True}


def test_message_items_keep_their_roles_and_parts_become_text_parts() -> None:
    chat = to_chat({"input": [
        {"role": "developer", "content": "dev rules"},
        {"type": "message", "role": "system", "content": [{"type": "input_text", "text": "s"}]},
        {"type": "message", "role": "user",
         "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"},
                     {"type": "input_image", "image_url": "data:image/png;base64,AA"}]},
    ]})
    assert chat["messages"] == [
        {"role": "developer", "content": "dev rules"},
        {"role": "system", "content": [{"type": "text", "text": "s"}]},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"},
                                     {"type": "image_url",
                                      "image_url": {"url": "data:image/png;base64,AA"}}]},
    ]


def test_assistant_items_replay_only_their_first_part() -> None:
    chat = to_chat({"input": [
        {"role": "user", "content": "q"},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "first", "annotations": []},
                     {"type": "output_text", "text": "second", "annotations": []}]},
        {"role": "assistant", "content": "plain"},
    ]})
    assert chat["messages"][1:] == [{"role": "assistant", "content": "first"},
                                    {"role": "assistant", "content": "plain"}]


def test_reasoning_message_and_calls_of_one_turn_merge_into_one_assistant_message() -> None:
    chat = to_chat({"input": [
        {"role": "user", "content": "weather in paris and rome?"},
        {"type": "reasoning", "id": "rs_1", "summary": [],
         "content": [{"type": "reasoning_text", "text": "two calls"}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather",
         "arguments": '{"city":"paris"}'},
        {"type": "function_call", "call_id": "c2", "name": "get_weather",
         "arguments": '{"city":"rome"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "c2",
         "output": [{"type": "input_text", "text": "rain"}]},
    ], "tools": [WEATHER]})
    assert chat["messages"][1:] == [
        {"role": "assistant", "reasoning": "two calls", "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city":"paris"}'}},
            {"id": "c2", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city":"rome"}'}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "c1"},
        {"role": "tool", "content": [{"type": "text", "text": "rain"}], "tool_call_id": "c2"},
    ]


def test_reasoning_after_assistant_text_merges_but_a_second_one_does_not() -> None:
    chat = to_chat({"input": [
        {"role": "assistant", "content": "text"},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "from summary"}]},
        {"type": "reasoning", "summary": []},
    ]})
    assert chat["messages"] == [
        {"role": "assistant", "content": "text", "reasoning": "from summary"},
        {"role": "assistant", "reasoning": ""},
    ]


def test_encrypted_reasoning_is_refused_as_vllm_refuses_it() -> None:
    with pytest.raises(ApiError) as err:
        to_chat({"input": [{"role": "user", "content": "hi"},
                           {"type": "reasoning", "id": "rs_1", "summary": [],
                            "encrypted_content": "gAAAA"}]})
    assert (err.value.status, err.value.param) == (400, "input")
    assert "Encrypted content" in err.value.message
    # A null encrypted_content (what vLLM's own output items carry) is fine.
    chat = to_chat({"input": [{"type": "reasoning", "summary": [], "encrypted_content": None}]})
    assert chat["messages"] == [{"role": "assistant", "reasoning": ""}]


def test_function_tools_become_chat_tools_and_tool_choice_maps() -> None:
    strict = {**WEATHER, "strict": True}
    chat = to_chat({"input": "hi", "tools": [strict, {"type": "function", "name": "noop"}],
                    "tool_choice": {"type": "function", "name": "get_weather"},
                    "parallel_tool_calls": False})
    assert chat["tools"] == [
        {"type": "function", "function": {"name": "get_weather",
                                          "description": "Weather for a city",
                                          "parameters": WEATHER["parameters"], "strict": True}},
        {"type": "function", "function": {"name": "noop", "description": None,
                                          "parameters": None}}]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert chat["parallel_tool_calls"] is False
    for choice in ("auto", "none", "required"):
        assert to_chat({"input": "hi", "tools": [WEATHER], "tool_choice": choice}
                       )["tool_choice"] == choice


def test_namespaced_tools_are_flattened_as_vllm_shows_them() -> None:
    body = {"input": [{"type": "function_call", "call_id": "c", "name": "read",
                       "namespace": "fs", "arguments": "{}"}],
            "tools": [{"type": "namespace", "name": "fs", "description": "files",
                       "tools": [{"type": "function", "name": "read", "parameters": None}]}],
            "tool_choice": {"type": "function", "name": "read"}}
    chat = to_chat(body)
    assert chat["tools"][0]["function"]["name"] == "fs__read"
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "fs__read"}}
    assert chat["messages"][0]["tool_calls"][0]["function"]["name"] == "fs__read"


@pytest.mark.parametrize(("body", "param"), [
    ({"input": "hi", "background": True}, "background"),
    ({"input": "hi", "prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"input": "hi", "tools": [{"type": "function"}]}, "tools[0].name"),
    ({"input": "hi", "tools": [{"type": "gizmo"}]}, "tools[0].type"),
    ({"input": "hi", "tools": [{"type": "custom", "name": "patch",
                                "format": {"type": "grammar", "syntax": "lark"}}]}, "tools"),
    ({"input": "hi", "tools": [{"type": "web_search"}], "tool_choice": "required"},
     "tool_choice"),
    ({"input": "hi", "max_output_tokens": "many"}, "max_output_tokens"),
    ({"input": "hi", "max_output_tokens": 4.5}, "max_output_tokens"),
    ({"input": "hi", "metadata": "x"}, "metadata"),
    ({"input": "hi", "metadata": {"a": {"b": "c"}}}, "metadata.a"),
    ({"input": "hi", "metadata": {"a": 1}}, "metadata.a"),
    ({"input": "hi", "metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
    ({"input": "hi", "metadata": {"k" * 65: "v"}}, "metadata"),
    ({"input": "hi", "metadata": {"k": "v" * 513}}, "metadata.k"),
    ({"input": "hi", "tool_choice": "required"}, "tool_choice"),
    ({"input": "hi", "tool_choice": {"type": "function", "name": "x"}}, "tool_choice"),
    ({"input": "hi", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "x"}},
     "tool_choice"),
    ({"input": "hi", "tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({}, "input"),
    ({"input": 3}, "input"),
    ({"input": []}, "input"),
    ({"input": ["hi"]}, "input[0]"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]},
     "input[0].call_id"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
     "input[0].content[0].type"),
    ({"input": "hi", "instructions": ["x"]}, "instructions"),
    ({"input": "hi", "text": {"format": {"type": "grammar"}}}, "text.format.type"),
])
def test_bad_or_unserved_requests_get_a_400_naming_the_field(body: dict[str, Any],
                                                             param: str) -> None:
    with pytest.raises(ApiError) as err:
        to_chat(body)
    assert err.value.status == 400
    assert err.value.param == param
    assert err.value.message


def test_reasoning_effort_and_text_format_map_as_vllm_maps_them() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    chat = to_chat({"input": "hi", "reasoning": {"effort": "low", "summary": "auto"},
                    "text": {"format": {"type": "json_schema", "name": "x", "schema": schema}}})
    assert chat["reasoning_effort"] == "low"
    assert chat["structured_outputs"] == {"json": schema}
    assert "response_format" not in chat
    chat = to_chat({"input": "hi", "text": {"format": {"type": "json_object"}}})
    assert chat["structured_outputs"] == {"json_object": True}


def test_vllm_sampling_extras_pass_through() -> None:
    chat = to_chat({"input": "hi", "top_k": 5, "seed": 7, "stop": ["x"], "min_p": 0.1,
                    "chat_template_kwargs": {"enable_thinking": False}})
    assert {k: chat[k] for k in ("top_k", "seed", "stop", "min_p", "chat_template_kwargs")} == {
        "top_k": 5, "seed": 7, "stop": ["x"], "min_p": 0.1,
        "chat_template_kwargs": {"enable_thinking": False}}


def test_an_incomplete_last_assistant_item_is_continued() -> None:
    chat = to_chat({"input": [{"role": "user", "content": "q"},
                              {"type": "message", "role": "assistant", "status": "incomplete",
                               "content": [{"type": "output_text", "text": "The"}]}]})
    assert chat["add_generation_prompt"] is False
    assert chat["continue_final_message"] is True
    assert "continue_final_message" not in to_chat({"input": [{"role": "user", "content": "q"}]})


# ------------------------------------------------------------------------ chaining

def test_a_chained_turn_starts_with_the_history_without_system_messages() -> None:
    first = to_chat({"input": [{"role": "system", "content": "sys item"},
                               {"role": "user", "content": "one"}],
                     "instructions": "old rules"})
    response = {"output": [
        {"type": "reasoning", "id": "rs", "summary": [], "content": [
            {"type": "reasoning_text", "text": "hmm"}]},
        {"type": "message", "id": "msg", "role": "assistant", "status": "completed",
         "content": [{"type": "output_text", "text": "A1", "annotations": []},
                     {"type": "output_text", "text": "A2", "annotations": []}]},
        {"type": "function_call", "id": "fc", "call_id": "c", "name": "f", "arguments": "{}"},
    ]}
    past = history(first, response)
    # The output as a client resends it: one assistant message (reasoning, first text part,
    # the call), the same as `to_chat` makes of those items in `input`.
    assert past == [{"role": "user", "content": "one"},
                    {"role": "assistant", "reasoning": "hmm", "content": "A1",
                     "tool_calls": [{"id": "c", "type": "function",
                                     "function": {"name": "f", "arguments": "{}"}}]}]
    whole = to_chat({"input": [{"role": "user", "content": "one"}, *response["output"]]})
    assert whole["messages"] == past
    second = to_chat({"input": "two", "instructions": "new rules"}, previous=past)
    assert second["messages"] == [{"role": "system", "content": "new rules"}, *past,
                                  {"role": "user", "content": "two"}]
    # System messages in `previous` are dropped however they got there.
    again = to_chat({"input": "two"}, previous=[{"role": "system", "content": "x"}, *past])
    assert again["messages"] == [*past, {"role": "user", "content": "two"}]


def test_the_first_input_item_never_merges_into_the_history() -> None:
    past = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    chat = to_chat({"input": [{"type": "function_call_output", "call_id": "c", "output": "o"},
                              {"type": "reasoning", "summary": []}]}, previous=past)
    assert chat["messages"][2:] == [{"role": "tool", "content": "o", "tool_call_id": "c"},
                                    {"role": "assistant", "reasoning": ""}]
    assert past[1] == {"role": "assistant", "content": "a"}


# ------------------------------------------------------------------------ whole answers

def _completion(message: dict[str, Any], finish: str = "stop", **extra: Any) -> dict[str, Any]:
    return {"id": "chatcmpl-1", "object": "chat.completion", "model": "kvagent-demo",
            "choices": [{"index": 0, "message": {"role": "assistant", **message},
                         "finish_reason": finish}],
            "usage": {"prompt_tokens": 20, "completion_tokens": 5, "total_tokens": 25,
                      "prompt_tokens_details": {"cached_tokens": 16}}, **extra}


def test_a_text_answer_is_one_message_item_with_usage_and_echoed_fields() -> None:
    request = {"model": "kvagent-demo", "input": "hi", "instructions": "Be terse.",
               "max_output_tokens": 8, "temperature": 0, "metadata": {"k": "v"}}
    resp = response_from_chat(_completion({"content": "Hello."}, kvagent={"reused_tokens": 16}),
                              request=request, response_id="resp_1", created_at=100)
    assert resp["id"] == "resp_1" and resp["object"] == "response"
    assert resp["created_at"] == 100 and resp["model"] == "kvagent-demo"
    assert resp["status"] == "completed" and resp["incomplete_details"] is None
    [item] = resp["output"]
    assert item["type"] == "message" and item["id"].startswith("msg_")
    assert item["role"] == "assistant" and item["status"] == "completed"
    assert item["content"] == [{"annotations": [], "text": "Hello.", "type": "output_text",
                                "logprobs": None}]
    assert resp["usage"]["input_tokens"] == 20 and resp["usage"]["output_tokens"] == 5
    assert resp["usage"]["total_tokens"] == 25
    assert resp["usage"]["input_tokens_details"]["cached_tokens"] == 16
    assert resp["usage"]["output_tokens_details"]["reasoning_tokens"] == 0
    assert resp["instructions"] == "Be terse." and resp["metadata"] == {"k": "v"}
    assert resp["temperature"] == 0.0 and resp["top_p"] == 1.0
    assert resp["max_output_tokens"] == 8 and resp["tool_choice"] == "none"
    assert resp["tools"] == [] and resp["parallel_tool_calls"] is True
    assert resp["kvagent"] == {"reused_tokens": 16}


def test_tool_calls_and_reasoning_become_their_items() -> None:
    chat = _completion({"content": None, "reasoning": "think", "tool_calls": [
        {"id": "chatcmpl-tool-abc", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city":"paris"}'}}]},
        finish="tool_calls")
    request = {"input": "w?", "tools": [WEATHER], "tool_choice": "required"}
    resp = response_from_chat(chat, request=request, response_id="resp_2", created_at=1)
    reasoning, call = resp["output"]
    assert reasoning["type"] == "reasoning" and reasoning["id"].startswith("rs_")
    assert reasoning["content"] == [{"text": "think", "type": "reasoning_text"}]
    assert call["type"] == "function_call" and call["id"].startswith("fc_")
    assert (call["call_id"], call["name"], call["arguments"], call["status"]) == (
        "chatcmpl-tool-abc", "get_weather", '{"city":"paris"}', "completed")
    assert resp["tool_choice"] == "required" and resp["tools"][0]["name"] == "get_weather"
    assert "kvagent" not in resp


def test_greedy_requests_echo_the_top_p_vllm_samples_with() -> None:
    def top_p(request: dict[str, Any]) -> float:
        return response_from_chat(_completion({"content": "x"}), request=request,
                                  response_id="r", created_at=1)["top_p"]

    assert top_p({"input": "x", "temperature": 0, "top_p": 0.5}) == 1.0
    assert top_p({"input": "x", "temperature": 0.7, "top_p": 0.5}) == 0.5
    assert top_p({"input": "x", "top_p": 0.5}) == 0.5


def test_running_out_of_tokens_is_incomplete() -> None:
    resp = response_from_chat(_completion({"content": "abc"}, finish="length"),
                              request={"input": "hi", "max_output_tokens": 3},
                              response_id="r", created_at=1)
    assert resp["status"] == "incomplete"
    assert resp["incomplete_details"] == {"reason": "max_output_tokens"}


def test_a_namespaced_call_reports_its_namespace() -> None:
    request = {"input": "x", "tools": [{"type": "namespace", "name": "fs", "tools": [
        {"type": "function", "name": "read", "parameters": None}]}]}
    chat = _completion({"tool_calls": [{"id": "c", "type": "function",
                                        "function": {"name": "fs__read", "arguments": "{}"}}]})
    [call] = response_from_chat(chat, request=request, response_id="r", created_at=1)["output"]
    assert (call["name"], call["namespace"]) == ("read", "fs")


def test_the_response_validates_as_openai_s_response_type() -> None:
    responses = pytest.importorskip("openai.types.responses")
    chat = _completion({"content": "Hi", "reasoning": "r", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]})
    request = {"input": "hi", "tools": [WEATHER], "reasoning": {"effort": "low"},
               "text": {"format": {"type": "text"}}}
    resp = response_from_chat(chat, request=request, response_id="resp_x", created_at=1)
    parsed = responses.Response.model_validate(resp)
    assert [o.type for o in parsed.output] == ["reasoning", "message", "function_call"]


# ------------------------------------------------------------------------ stream

def _run(chunks: list[dict[str, Any] | None], request: dict[str, Any] | None = None
         ) -> tuple[ResponseStream, list[tuple[str, dict[str, Any]]]]:
    stream = ResponseStream(request=request or {"input": "hi"}, response_id="resp_s",
                            created_at=5)
    raw: list[bytes] = []
    for chunk in chunks:
        raw += stream.feed(chunk)
    return stream, _events(raw)


def test_a_text_stream_is_vllm_s_event_sequence() -> None:
    stream, events = _run([_chunk({"role": "assistant", "content": ""}),
                           _chunk({"content": "Hel"}), _chunk({"content": "lo"}),
                           _chunk({}, finish="stop"), USAGE_CHUNK, None])
    assert [e for e, _ in events] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", "response.output_text.delta",
        "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.completed"]
    assert [d["sequence_number"] for _, d in events] == list(range(10))
    created = events[0][1]["response"]
    assert created["status"] == "in_progress" and created["output"] == []
    assert created["usage"] is None and created["id"] == "resp_s" and created["model"] == "m"
    added = events[2][1]
    item_id = added["item"]["id"]
    assert added["output_index"] == 0 and added["item"]["status"] == "in_progress"
    assert events[3][1]["part"] == {"annotations": [], "text": "", "type": "output_text",
                                    "logprobs": []}
    assert [d["delta"] for _, d in events[4:6]] == ["Hel", "lo"]
    assert all(d["item_id"] == item_id for _, d in events[3:8])
    assert events[6][1]["text"] == "Hello"
    done_item = events[8][1]["item"]
    assert done_item["status"] == "completed" and done_item["content"][0]["text"] == "Hello"
    final = events[9][1]["response"]
    assert final["status"] == "completed" and final["output"] == [done_item]
    assert final["usage"]["input_tokens"] == 20
    assert final["usage"]["input_tokens_details"]["cached_tokens"] == 16
    assert final["kvagent"] == {"reused_tokens": 16}
    assert stream.response == final


def test_a_tool_call_stream_has_argument_events_and_the_call_id() -> None:
    request = {"input": "w?", "tools": [WEATHER], "tool_choice": "required"}
    _, events = _run([
        _chunk({"role": "assistant", "content": ""}),
        _chunk({"tool_calls": [{"index": 0, "id": "chatcmpl-tool-1", "type": "function",
                                "function": {"name": "get_weather", "arguments": ""}}]}),
        _chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"city":'}}]}),
        _chunk({"tool_calls": [{"index": 0, "function": {"arguments": '"paris"}'}}]}),
        _chunk({"tool_calls": [{"index": 1, "id": "chatcmpl-tool-2", "type": "function",
                                "function": {"name": "get_weather", "arguments": "{}"}}]}),
        _chunk({}, finish="tool_calls"), USAGE_CHUNK, None], request)
    kinds = [e for e, _ in events]
    assert kinds == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.function_call_arguments.delta", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed"]
    first = events[2][1]["item"]
    assert (first["call_id"], first["name"], first["status"]) == (
        "chatcmpl-tool-1", "get_weather", "in_progress")
    assert events[5][1]["arguments"] == '{"city":"paris"}'
    assert events[5][1]["name"] == "get_weather"
    assert [d["output_index"] for _, d in events[2:11]] == [0, 0, 0, 0, 0, 1, 1, 1, 1]
    final = events[-1][1]["response"]
    assert [(o["call_id"], o["arguments"]) for o in final["output"]] == [
        ("chatcmpl-tool-1", '{"city":"paris"}'), ("chatcmpl-tool-2", "{}")]


def test_reasoning_then_text_are_two_items() -> None:
    _, events = _run([_chunk({"reasoning": "let me"}), _chunk({"reasoning": " think"}),
                      _chunk({"reasoning": None, "content": "Answer"}),
                      _chunk({}, finish="length"), None])
    kinds = [e for e, _ in events]
    assert kinds[2:] == [
        "response.output_item.added", "response.content_part.added",
        "response.reasoning_text.delta", "response.reasoning_text.delta",
        "response.reasoning_text.done", "response.content_part.done",
        "response.output_item.done", "response.output_item.added",
        "response.content_part.added", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.completed"]
    assert events[6][1]["text"] == "let me think"
    final = events[-1][1]["response"]
    assert final["status"] == "incomplete" and final["usage"] is None
    assert [o["type"] for o in final["output"]] == ["reasoning", "message"]
    assert final["output"][0]["content"] == [{"text": "let me think", "type": "reasoning_text"}]


def test_a_delta_with_text_and_a_tool_call_is_split_text_first() -> None:
    _, events = _run([_chunk({"content": "ok", "tool_calls": [
        {"index": 0, "id": "c", "type": "function",
         "function": {"name": "get_weather", "arguments": "{}"}}]}), None],
        {"input": "x", "tools": [WEATHER]})
    kinds = [e for e, _ in events][2:]
    assert kinds[:3] == ["response.output_item.added", "response.content_part.added",
                         "response.output_text.delta"]
    assert kinds[6:] == ["response.output_item.added", "response.function_call_arguments.delta",
                         "response.function_call_arguments.done", "response.output_item.done",
                         "response.completed"]


def test_an_error_chunk_ends_the_stream_with_an_error_event() -> None:
    stream, events = _run([_chunk({"content": "a"}),
                           {"error": {"message": "node failed", "type": "InternalServerError",
                                      "param": None, "code": 500}},
                           None])
    kind, data = events[-1]
    assert kind == "error"
    assert data == {"type": "error", "sequence_number": 5, "code": "500",
                    "message": "node failed", "param": None}
    assert stream.response is None


def test_the_first_feed_starts_the_stream_even_when_it_is_done() -> None:
    stream, events = _run([None])
    assert [e for e, _ in events] == ["response.created", "response.in_progress",
                                      "response.completed"]
    assert stream.response is not None and stream.response["output"] == []
    assert stream.feed(None) == []


def test_stream_events_validate_as_openai_s_event_types() -> None:
    pydantic = pytest.importorskip("pydantic")
    responses = pytest.importorskip("openai.types.responses")
    adapter = pydantic.TypeAdapter(responses.ResponseStreamEvent)
    _, events = _run([_chunk({"reasoning": "r"}), _chunk({"content": "t"}),
                      _chunk({"tool_calls": [{"index": 0, "id": "c", "type": "function",
                                              "function": {"name": "get_weather",
                                                           "arguments": "{}"}}]}),
                      _chunk({}, finish="tool_calls"), USAGE_CHUNK, None],
                     {"input": "x", "tools": [WEATHER]})
    for _, data in events:
        assert adapter.validate_python(data).type == data["type"]


# ------------------------------------------------------------ what vLLM accepts, so do we

CODEX_TOOLS = [WEATHER, {"type": "web_search", "external_web_access": False},
               {"type": "custom", "name": "apply_patch", "description": "Patch files.",
                "format": {"type": "text"}}]


@pytest.mark.parametrize("builtin", [
    {"type": "web_search"}, {"type": "web_search_preview"},
    {"type": "file_search", "vector_store_ids": ["vs_1"]}, {"type": "local_shell"},
    {"type": "mcp", "server_label": "x", "server_url": "http://127.0.0.1:1"},
    {"type": "code_interpreter", "container": "auto"}, {"type": "image_generation"}])
def test_built_in_tools_are_accepted_and_shown_to_the_model_as_vllm_shows_them(
        builtin: dict[str, Any]) -> None:
    """vLLM renders function tools only; a built-in beside one changes nothing."""
    alone = to_chat({"input": "hi", "tools": [builtin]})
    assert "tools" not in alone and "tool_choice" not in alone
    beside = to_chat({"input": "hi", "tools": [builtin, WEATHER]})
    assert beside == to_chat({"input": "hi", "tools": [WEATHER]})


def test_codex_default_request_is_served_with_apply_patch_as_vllm_s_one_string_function(
) -> None:
    chat = to_chat({"input": "hi", "tools": CODEX_TOOLS, "tool_choice": "auto",
                    "parallel_tool_calls": False, "include": [], "prompt_cache_key": "k"})
    names = [t["function"]["name"] for t in chat["tools"]]
    assert names == ["get_weather", "apply_patch"]
    patch = chat["tools"][1]["function"]
    assert patch["parameters"]["required"] == ["input"]
    assert patch["parameters"]["properties"]["input"]["type"] == "string"
    named = to_chat({"input": "hi", "tools": CODEX_TOOLS,
                     "tool_choice": {"type": "custom", "name": "apply_patch"}})
    assert named["tool_choice"] == {"type": "function", "function": {"name": "apply_patch"}}


def test_a_custom_tool_call_answers_as_a_custom_tool_call_item_whole_and_streamed() -> None:
    request = {"input": "hi", "tools": CODEX_TOOLS}
    args = json.dumps({"input": "*** Begin Patch\n*** End Patch"})
    chat = {"model": "m", "choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
        "role": "assistant", "tool_calls": [{"id": "call_1", "type": "function",
                                             "function": {"name": "apply_patch",
                                                          "arguments": args}}]}}]}
    out = response_from_chat(chat, request=request, response_id="resp_1", created_at=0)
    item = out["output"][0]
    assert item["type"] == "custom_tool_call" and item["id"].startswith("ctc_")
    assert (item["call_id"], item["name"], item["input"]) == (
        "call_1", "apply_patch", "*** Begin Patch\n*** End Patch")
    stream = ResponseStream(request=request, response_id="resp_1", created_at=0)
    raw: list[bytes] = []
    for piece in (args[:10], args[10:]):
        raw += stream.feed(_chunk({"tool_calls": [{"index": 0, "id": "call_1", "function": {
            "name": "apply_patch", "arguments": piece}}]}))
    raw += stream.feed(_chunk(finish="tool_calls")) + stream.feed(None)
    events = _events(raw)
    kinds = [k for k, _ in events]
    assert "response.function_call_arguments.delta" not in kinds
    done = next(e for k, e in events if k == "response.custom_tool_call_input.done")
    assert done["input"] == item["input"]
    assert "".join(e["delta"] for k, e in events
                   if k == "response.custom_tool_call_input.delta") == item["input"]
    final = events[-1][1]["response"]["output"][0]
    assert final["type"] == "custom_tool_call" and final["input"] == item["input"]
    # Sent back, the call renders as vLLM renders it: the one-string function's arguments.
    again = to_chat({"input": [{"type": "custom_tool_call", "call_id": "call_1",
                                "name": "apply_patch", "input": item["input"]}],
                     "tools": CODEX_TOOLS})
    assert json.loads(again["messages"][0]["tool_calls"][0]["function"]["arguments"]) == {
        "input": item["input"]}


@pytest.mark.parametrize("choice", [
    {"type": "allowed_tools", "mode": "required", "tools": [{"type": "function",
                                                             "name": "get_weather"}]},
    {"type": "web_search_preview"}, {"type": "file_search"}, {"type": "mcp",
                                                              "server_label": "x"}])
def test_tool_choices_that_name_no_function_are_served_as_auto(choice: dict[str, Any]
                                                               ) -> None:
    assert to_chat({"input": "hi", "tools": [WEATHER], "tool_choice": choice})[
        "tool_choice"] == "auto"
    assert "tool_choice" not in to_chat({"input": "hi", "tool_choice": choice})


def test_conversation_is_ignored_as_vllm_ignores_it() -> None:
    plain = to_chat({"input": "hi"})
    assert to_chat({"input": "hi", "conversation": "conv_1"}) == plain
    assert to_chat({"input": "hi", "conversation": {"id": "conv_1"}}) == plain


def test_an_assistant_message_with_no_parts_is_an_empty_message() -> None:
    chat = to_chat({"input": [{"role": "user", "content": "hi"},
                              {"type": "message", "role": "assistant", "content": []},
                              {"role": "user", "content": "again"}]})
    assert chat["messages"][1] == {"role": "assistant", "content": ""}


@pytest.mark.parametrize(("field", "sent", "served"), [
    ("max_output_tokens", "4", 4), ("max_output_tokens", 4.0, 4),
    ("temperature", "0.5", 0.5), ("top_k", "5", 5), ("stream", "yes", True),
    ("parallel_tool_calls", "false", False), ("seed", "7", 7)])
def test_typed_fields_are_converted_as_vllm_converts_them(field: str, sent: Any,
                                                          served: Any) -> None:
    chat = to_chat({"input": "hi", "tools": [WEATHER], field: sent})
    key = "max_tokens" if field == "max_output_tokens" else field
    assert chat[key] == served and type(chat[key]) is type(served)


def test_metadata_within_the_api_s_bounds_is_accepted() -> None:
    meta = {f"k{i:02d}" + "x" * 60: "v" * 512 for i in range(16)}
    to_chat({"input": "hi", "metadata": meta})
