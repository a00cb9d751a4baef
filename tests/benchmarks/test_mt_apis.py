"""The client APIs of the multi-turn benchmark, pure parts: the chat history as Messages
and Responses requests (shape, identity, chaining) and each API's stream meter. Through the
router: test_mt_apis_router.py."""

from __future__ import annotations

import json

import pytest

from benchmarks.api import (
    ConversationRequests,
    MessagesMeter,
    ResponsesMeter,
    StreamMeter,
    apis,
    meter_for,
    tool_definitions,
)

CALL = {"id": "c000t01n00", "type": "function",
        "function": {"name": "read_file", "arguments": json.dumps({"path": "src/a.py"})}}
CALL2 = {"id": "c000t01n01", "type": "function",
         "function": {"name": "run_command", "arguments": json.dumps({"command": "ls"})}}
HISTORY = [
    {"role": "system", "content": "You are an agent."},
    {"role": "user", "content": "Fix it."},
    {"role": "assistant", "content": "Looking.", "tool_calls": [CALL, CALL2]},
    {"role": "tool", "tool_call_id": "c000t01n00", "content": "def f(): pass"},
    {"role": "tool", "tool_call_id": "c000t01n01", "content": "a.py"},
    {"role": "assistant", "content": "Done."},
    {"role": "user", "content": "Thanks."},
]


def test_parse_apis_and_row_names() -> None:
    assert apis.parse_apis("chat, messages,responses") == ["chat", "messages", "responses"]
    assert apis.parse_apis("responses-full") == ["responses-full"]
    for bad in ("", "chat,grpc", "chat,chat"):
        with pytest.raises(ValueError):
            apis.parse_apis(bad)
    assert apis.row_name("kvagent", "chat") == "kvagent"
    assert apis.row_name("kvagent", "messages") == "kvagent:messages"


def test_messages_body_system_tools_tool_use_and_results() -> None:
    tools = tool_definitions()
    body = apis.messages_body("m", HISTORY, tools, 16)
    assert body["system"] == "You are an agent."
    assert (body["model"], body["max_tokens"], body["stream"], body["temperature"]) == (
        "m", 16, True, 0.0)
    assert body["tools"][0] == {"name": "read_file",
                                "description": tools[0]["function"]["description"],
                                "input_schema": tools[0]["function"]["parameters"]}
    assert body["messages"] == [
        {"role": "user", "content": "Fix it."},
        {"role": "assistant", "content": [
            {"type": "text", "text": "Looking."},
            {"type": "tool_use", "id": "c000t01n00", "name": "read_file",
             "input": {"path": "src/a.py"}},
            {"type": "tool_use", "id": "c000t01n01", "name": "run_command",
             "input": {"command": "ls"}}]},
        # parallel tool results share one user message, as Anthropic requires
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "c000t01n00", "content": "def f(): pass"},
            {"type": "tool_result", "tool_use_id": "c000t01n01", "content": "a.py"}]},
        {"role": "assistant", "content": "Done."},
        {"role": "user", "content": "Thanks."},
    ]
    # json.dumps(input) is what the router renders: the same arguments string as chat's
    args = body["messages"][1]["content"][1]["input"]
    assert json.dumps(args) == CALL["function"]["arguments"]
    # no text: only tool_use blocks; no tools: no field
    calls_only = apis.messages_messages([{"role": "assistant", "content": "",
                                          "tool_calls": [CALL]}])
    assert [b["type"] for b in calls_only[0]["content"]] == ["tool_use"]
    assert "tools" not in apis.messages_body("m", HISTORY[:2], [], 4)


def test_response_items_and_body() -> None:
    instructions, rest = apis.split_system(HISTORY)
    assert instructions == "You are an agent." and rest == HISTORY[1:]
    items = apis.response_items(rest)
    assert items == [
        {"type": "message", "role": "user", "content": "Fix it."},
        {"type": "message", "role": "assistant",
         "content": [{"type": "output_text", "text": "Looking."}]},
        {"type": "function_call", "call_id": "c000t01n00", "name": "read_file",
         "arguments": CALL["function"]["arguments"]},
        {"type": "function_call", "call_id": "c000t01n01", "name": "run_command",
         "arguments": CALL2["function"]["arguments"]},
        {"type": "function_call_output", "call_id": "c000t01n00", "output": "def f(): pass"},
        {"type": "function_call_output", "call_id": "c000t01n01", "output": "a.py"},
        {"type": "message", "role": "assistant",
         "content": [{"type": "output_text", "text": "Done."}]},
        {"type": "message", "role": "user", "content": "Thanks."},
    ]
    body = apis.responses_body("m", instructions, items, tool_definitions(), 16, "resp_1")
    assert body["instructions"] == "You are an agent." and body["input"] is items
    assert body["previous_response_id"] == "resp_1" and body["max_output_tokens"] == 16
    assert body["tools"][0]["type"] == "function" and body["tools"][0]["name"] == "read_file"
    assert "parameters" in body["tools"][0] and body["stream"] is True


def test_each_api_identifies_the_conversation_its_clients_way() -> None:
    turn0 = HISTORY[:2]
    new1 = HISTORY[2:5]
    chat = ConversationRequests("chat", "m", "run.c0", [], 8)
    r0 = chat.request(turn0, turn0)
    assert r0.path == "/chat/completions" and r0.headers == {"X-Session-ID": "run.c0"}
    assert r0.body["messages"] == turn0
    chat.answered(cache_token="tok")
    assert chat.request(HISTORY[:5], new1).headers["X-KVAgent-Cache-Token"] == "tok"

    msgs = ConversationRequests("messages", "m", "run.c0", [], 8)
    r = msgs.request(turn0, turn0)
    assert r.path == "/messages" and r.headers == {"X-Claude-Code-Session-Id": "run.c0"}
    msgs.answered(cache_token="tok")  # the token is chat's own: never sent here
    assert msgs.request(HISTORY[:5], new1).headers == {"X-Claude-Code-Session-Id": "run.c0"}


def test_chained_responses_send_only_the_new_items() -> None:
    req = ConversationRequests("responses", "m", "run.c0", [], 8)
    first = req.request(HISTORY[:2], HISTORY[:2])
    assert first.path == "/responses" and first.headers == {}
    assert "previous_response_id" not in first.body
    assert first.body["input"] == [{"type": "message", "role": "user", "content": "Fix it."}]
    req.answered(response_id="resp_1")
    second = req.request(HISTORY[:5], HISTORY[2:5])
    assert second.body["previous_response_id"] == "resp_1"
    assert second.body["instructions"] == "You are an agent."
    # the stored response holds the answer's text; the scripted calls are new
    assert [i["type"] for i in second.body["input"]] == [
        "function_call", "function_call", "function_call_output", "function_call_output"]
    req.answered(response_id="resp_2")
    third = req.request(HISTORY, HISTORY[5:])
    assert third.body["input"] == [{"type": "message", "role": "user", "content": "Thanks."}]
    assert third.body["previous_response_id"] == "resp_2"

    full = ConversationRequests("responses-full", "m", "run.c0", [], 8)
    full.answered(response_id="resp_1")
    body = full.request(HISTORY[:5], HISTORY[2:5]).body
    assert "previous_response_id" not in body
    assert body["input"] == apis.response_items(HISTORY[1:5])


# ------------------------------------------------------------------ meters


def _sse(events: list[dict], named: bool = True) -> list[str]:
    lines = []
    for e in events:
        if named:
            lines.append(f"event: {e['type']}")
        lines += [f"data: {json.dumps(e)}", ""]
    return lines


def _feed(meter, lines: list[str]) -> None:
    for i, line in enumerate(lines):
        meter.feed_line(line, 0.1 * (i + 1))


KVA = {"path": "pd_reuse", "reused_tokens": 96, "reason": "hit"}


def test_messages_meter() -> None:
    m = MessagesMeter()
    _feed(m, _sse([
        {"type": "message_start", "message": {"usage": {"input_tokens": 0, "output_tokens": 0}}},
        {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
        {"type": "content_block_delta", "index": 0,
         "delta": {"type": "text_delta", "text": "Hel"}},
        {"type": "content_block_delta", "index": 0,
         "delta": {"type": "text_delta", "text": "lo"}},
        {"type": "content_block_stop", "index": 0},
        {"type": "content_block_start", "index": 1,
         "content_block": {"type": "tool_use", "id": "t", "name": "f", "input": {}}},
        {"type": "content_block_delta", "index": 1,
         "delta": {"type": "input_json_delta", "partial_json": "{}"}},
        {"type": "content_block_stop", "index": 1},
        {"type": "message_delta", "delta": {"stop_reason": "tool_use"},
         "usage": {"input_tokens": 30, "output_tokens": 4, "cache_read_input_tokens": 96},
         "kvagent": KVA},
        {"type": "message_stop"}]))
    assert m.done and m.error is None and m.answer == "Hello"
    assert m.first_chunk_s == pytest.approx(0.2)  # the `event:` line is not data
    assert m.ttft_s == pytest.approx(0.8)  # the first text delta
    assert len(m.token_times) == 4 and len(m.itl_s) == 3
    assert (m.prompt_tokens(), m.cached_tokens(), m.completion_tokens()) == (126, 96, 4)
    assert m.kvagent == KVA

    err = MessagesMeter()
    _feed(err, _sse([{"type": "error", "error": {"type": "overloaded_error",
                                                 "message": "busy"}}]))
    assert err.error == "busy" and not err.done


def test_responses_meter() -> None:
    m = ResponsesMeter()
    usage = {"input_tokens": 126, "input_tokens_details": {"cached_tokens": 96},
             "output_tokens": 3, "total_tokens": 129}
    _feed(m, _sse([
        {"type": "response.created", "response": {"id": "resp_9", "status": "in_progress"}},
        {"type": "response.in_progress", "response": {"id": "resp_9"}},
        {"type": "response.output_item.added", "item": {"type": "message"}},
        {"type": "response.output_text.delta", "delta": "Hi"},
        {"type": "response.output_text.delta", "delta": "!"},
        {"type": "response.output_item.added", "item": {"type": "function_call"}},
        {"type": "response.function_call_arguments.delta", "delta": "{}"},
        {"type": "response.completed", "response": {"id": "resp_9", "usage": usage,
                                                    "kvagent": KVA}}]))
    assert m.done and m.error is None and m.answer == "Hi!" and m.response_id == "resp_9"
    assert m.first_choice_s == pytest.approx(0.2) and m.ttft_s == pytest.approx(1.1)
    assert len(m.token_times) == 4
    assert (m.prompt_tokens(), m.cached_tokens(), m.completion_tokens()) == (126, 96, 3)
    assert m.kvagent == KVA

    cut = ResponsesMeter()
    _feed(cut, _sse([{"type": "response.created", "response": {"id": "r"}}]))
    assert not cut.done and cut.ttft_s == pytest.approx(0.2)  # an empty answer: its start
    assert cut.END == "stream ended without response.completed"


def test_chat_meter_readings_and_meter_for() -> None:
    m = StreamMeter()
    _feed(m, _sse([{"choices": [{"delta": {"role": "assistant", "content": ""}}]},
                   {"choices": [{"delta": {"content": "a"}}]},
                   {"choices": [], "usage": {"prompt_tokens": 10, "completion_tokens": 1,
                                             "prompt_tokens_details": {"cached_tokens": 8}},
                    "kvagent": KVA}], named=False) + ["data: [DONE]"])
    assert m.done and m.answer == "a" and m.ttft_s == pytest.approx(0.3)
    assert (m.prompt_tokens(), m.cached_tokens(), m.completion_tokens()) == (10, 8, 1)
    assert type(meter_for("chat")) is StreamMeter
    assert type(meter_for("messages")) is MessagesMeter
    assert type(meter_for("responses")) is ResponsesMeter
    assert type(meter_for("responses-full")) is ResponsesMeter


# ------------------------------------------------------------------ rows and report


def test_rows_per_api_for_reusing_configurations_only() -> None:
    from benchmarks.api import CONFIGS, plan_rows

    rows = plan_rows([CONFIGS["kvagent"], CONFIGS["aggregated"]], ["chat", "messages"])
    assert [(r.name, r.api) for r in rows] == [
        ("kvagent", "chat"), ("kvagent:messages", "messages"), ("aggregated", "chat")]
    assert "messages API" in rows[1].description


def test_summary_puts_the_apis_side_by_side() -> None:
    from benchmarks.api import (
        BenchmarkReport,
        ConfigResult,
        RequestRecord,
        Targets,
        markdown_summary,
        stats,
    )

    def rec(config: str, turn: int, prompt: int, answer: str) -> RequestRecord:
        return RequestRecord(config=config, conversation="c", turn=turn, start_s=0.0,
                             ttft_s=0.1 * (turn + 1), prompt_tokens=prompt,
                             cached_tokens=prompt // 2 if turn else 0,
                             reused_tokens=prompt // 2 if turn else 0,
                             path="pd_reuse" if turn else "pd_fresh", answer=answer)

    def row(name: str, api: str, prompts: list[int], answers: list[str]) -> ConfigResult:
        records = [rec(name, t, p, a) for t, (p, a) in enumerate(zip(prompts, answers,
                                                                     strict=True))]
        return ConfigResult(name=name, description="d", api=api, status="ok",
                            summary=stats.summarize(records, 1.0),
                            per_turn=stats.per_turn(records), records=records)

    report = BenchmarkReport(
        created_at="t", command=["x"], machine={}, versions={}, workload_source="generated",
        workload_fingerprint="f", workload={}, reference_config=None,
        apis=["chat", "responses"], targets=Targets(), configs=[
            row("kvagent", "chat", [100, 200, 300], ["a", "b", "c"]),
            row("kvagent:responses", "responses", [100, 210, 300], ["a", "x", "c"]),
            row("aggregated", "chat", [100, 200, 300], ["a", "b", "c"])])
    text = markdown_summary(report)
    assert ("| kvagent:responses | responses | 250 | 290 | 100% | 50% | 255 | pd_reuse 2 | 0 "
            "| 2/3 | 2/3 |") in text
    assert "| kvagent | chat | 250 | 290 | 100% | 50% | 250 | pd_reuse 2 | 0 | – | – |" in text
    assert "Ran through chat only (baselines): aggregated." in text
    chat_only = report.model_copy(update={"apis": ["chat"], "configs": report.configs[:1]})
    assert "Client APIs" not in markdown_summary(chat_only)
