"""The sync Session over recorded vLLM/router streams through httpx.MockTransport."""

from __future__ import annotations

import itertools
import json
from datetime import UTC, datetime, timedelta

import httpx
import pytest
from kvagent import (
    APIConnectionError,
    AssistantMessage,
    BadRequestError,
    Done,
    MalformedStream,
    NotFoundError,
    Session,
    StreamInterrupted,
    TextDelta,
    ToolCallDelta,
    UserMessage,
    tool,
)
from kvagent.protocol import CACHE_TOKEN_HEADER, SESSION_HEADER, valid_session_id
from kvagent_server.common.ports import free_port
from sdk_helpers import (
    BASE_URL,
    MODEL,
    FakeServer,
    error_response,
    messages_prefix,
    sse,
    stream_response,
)

TOKEN_1 = json.loads(sse("router_text.sse").split(b"data: ")[-2])["kvagent"]["cache_token"]
TOKEN_2 = "kva1.eyJoaWQiOiJoMiJ9.dG9vbC1zaWc"


@tool
def get_weather(city: str, unit: str = "c") -> str:
    """Current weather for a city."""
    return f"18{unit} and sunny in {city}"


@tool
def get_time(timezone: str) -> str:
    """Local time in a timezone."""
    return f"12:00 in {timezone}"


def session(server: FakeServer, **kw) -> Session:
    kw.setdefault("system", "You are terse.")
    return Session(BASE_URL, MODEL, transport=server.transport, **kw)


def test_stream_yields_typed_events_then_done(server: FakeServer) -> None:
    server.queue(stream_response(sse("router_text.sse"), split=9))
    s = session(server)
    events = list(s.stream("Weather in Paris?"))
    assert [type(e) for e in events] == [TextDelta] * 8 + [Done]
    result = events[-1].result
    assert result.text == "The weather in Paris is mild today."
    assert [m.role for m in s.messages] == ["system", "user", "assistant"]
    assert s.messages[-1] is result.message and s.cache_token == TOKEN_1


def test_tool_call_deltas_are_streamed(server: FakeServer) -> None:
    server.queue(stream_response(sse("router_parallel_tools.sse")))
    s = session(server, tools=[get_weather, get_time])
    events = list(s.stream("Weather and time?"))
    deltas = [e for e in events if isinstance(e, ToolCallDelta)]
    assert [d.name for d in deltas if d.name] == ["get_weather", "get_time"]
    assert [c.name for c in events[-1].result.tool_calls] == ["get_weather", "get_time"]


def test_each_request_extends_the_previous_message_list_byte_for_byte(server: FakeServer) -> None:
    server.queue(stream_response(sse("router_text.sse")),
                 stream_response(sse("router_parallel_tools.sse"), split=50),
                 stream_response(sse("router_final_answer.sse"), split=3))
    s = session(server, tools=[get_weather, get_time], temperature=0.0)
    s.send("Hello")
    s.run("Weather and time in Paris?")
    bodies = [r.content for r in server.requests]
    assert len(bodies) == 3
    for before, after in itertools.pairwise(bodies):
        prefix = messages_prefix(before)
        assert after.startswith(prefix + b",")  # same bytes, then more messages
        old, new = json.loads(before)["messages"], json.loads(after)["messages"]
        assert new[:len(old)] == old
    assert [m["role"] for m in json.loads(bodies[2])["messages"]] == [
        "system", "user", "assistant", "user", "assistant", "tool", "tool"]


def test_token_of_turn_n_is_sent_on_turn_n_plus_1(server: FakeServer) -> None:
    server.queue(stream_response(sse("router_text.sse")),
                 stream_response(sse("router_parallel_tools.sse")),
                 stream_response(sse("router_final_answer.sse")))
    s = session(server, tools=[get_weather, get_time], session_id="conv-42")
    first = s.send("Hello")
    s.run("Weather?")
    sent = [r.headers.get(CACHE_TOKEN_HEADER) for r in server.requests]
    assert sent == [None, TOKEN_1, TOKEN_2]
    assert {r.headers[SESSION_HEADER] for r in server.requests} == {"conv-42"}
    assert first.message.cache_token == TOKEN_1  # kept on the message it belongs to
    assert s.cache_token == "kva1.eyJoaWQiOiJoMyJ9.ZmluYWwtc2ln"


def test_generated_session_id_is_valid_and_stable(server: FakeServer) -> None:
    server.queue(stream_response(sse("vllm_text.sse")), stream_response(sse("vllm_text.sse")))
    s = session(server)
    s.send("a")
    s.send("b")
    ids = {r.headers[SESSION_HEADER] for r in server.requests}
    assert ids == {s.session_id} and valid_session_id(s.session_id)
    with pytest.raises(ValueError, match="session_id"):
        session(server, session_id="has spaces")


def test_plain_server_without_token_works_without_reuse(server: FakeServer) -> None:
    server.queue(stream_response(sse("vllm_text.sse")), stream_response(sse("vllm_text.sse")))
    s = session(server)
    first = s.send("a")
    second = s.send("b")
    assert not first.cache_token_received and not second.cache_token_received
    assert first.reused_tokens is None and first.path is None
    assert all(CACHE_TOKEN_HEADER not in r.headers for r in server.requests)
    assert len(s.messages) == 5


def test_mid_stream_failure_keeps_history_and_token(server: FakeServer) -> None:
    body = sse("router_text.sse")
    cut = body.index(b" Paris")  # after "The weather in"
    server.queue(stream_response(body),
                 stream_response(body[:cut], fail=httpx.ReadError("connection reset")),
                 stream_response(sse("router_text.sse")))
    s = session(server)
    s.send("first")
    before = s.messages
    with pytest.raises(StreamInterrupted) as info:
        s.send("second")
    assert info.value.partial_text == "The weather in"
    assert "connection reset" in str(info.value)
    assert s.messages == before and s.cache_token == TOKEN_1
    s.send("second")  # the retry sends the same prefix and the still-valid token
    assert server.requests[2].headers[CACHE_TOKEN_HEADER] == TOKEN_1
    assert server.requests[2].content == server.requests[1].content


@pytest.mark.parametrize(("name", "error", "partial"), [
    ("truncated.sse", StreamInterrupted, "The weather in"),
    ("not_json.sse", MalformedStream, "Hi"),
    ("error_midstream.sse", StreamInterrupted, "The weather"),
])
def test_broken_streams_raise_typed_errors_and_leave_history(
        server: FakeServer, name: str, error: type, partial: str) -> None:
    server.queue(stream_response(sse(name), split=11))
    s = session(server)
    with pytest.raises(error) as info:
        s.send("hi")
    assert info.value.partial_text == partial
    assert [m.role for m in s.messages] == ["system"]


def test_json_instead_of_event_stream_is_malformed(server: FakeServer) -> None:
    server.queue(httpx.Response(200, json={"choices": []}))
    with pytest.raises(MalformedStream, match="application/json"):
        session(server).send("hi")


def test_wrong_model_name_gives_not_found_naming_the_model(server: FakeServer) -> None:
    server.queue(error_response(404, "The model `gpt-9` does not exist."))
    s = Session(BASE_URL, "gpt-9", transport=server.transport)
    with pytest.raises(NotFoundError) as info:
        s.send("hi")
    assert info.value.status_code == 404
    assert "'gpt-9'" in str(info.value) and "does not exist" in str(info.value)
    assert "/models" in str(info.value)
    assert len(server.requests) == 1  # 404 is not retried


#: vLLM 0.32's answer (through the router, which passes it on) to a prompt over the context.
CONTEXT_ERROR = {"error": {
    "message": "This model's maximum context length is 16384 tokens. However, your prompt "
               "contains at least 16385 input tokens, which exceeds this limit even without "
               "any output tokens. Please reduce the length of the input prompt. "
               "(parameter=input_tokens, value=16385)",
    "type": "BadRequestError", "param": "input_tokens", "code": 400}}


def test_a_prompt_over_the_context_says_why_and_what_to_do(server: FakeServer) -> None:
    """The README's two-turn example against a model that never stops on its own: the first
    answer ran to the end of the context ("length"), so the second turn cannot fit."""
    server.queue(stream_response(sse("vllm_recorded_text.sse")),
                 httpx.Response(400, json=CONTEXT_ERROR))
    s = session(server)
    assert s.send("Summarise the report.").finish_reason == "length"
    with pytest.raises(BadRequestError) as info:
        s.send("And the risks?")
    message = str(info.value)
    assert "maximum context length is 16384 tokens" in message  # the server's own words
    assert "no longer fits the model's context of 16384 tokens" in message
    assert "finish_reason 'length'" in message and "max_tokens=" in message
    assert "truncate()" in message
    assert info.value.status_code == 400 and info.value.body == CONTEXT_ERROR
    assert len(server.requests) == 2  # a 400 is not retried
    assert [m.role for m in s.messages] == ["system", "user", "assistant"]


def test_a_first_prompt_over_the_context_does_not_blame_an_answer(server: FakeServer) -> None:
    server.queue(httpx.Response(400, json=CONTEXT_ERROR))
    with pytest.raises(BadRequestError) as info:
        session(server).send("x " * 20000)
    assert "no longer fits the model's context of 16384 tokens" in str(info.value)
    assert "finish_reason" not in str(info.value)


def test_other_bad_requests_keep_the_plain_message(server: FakeServer) -> None:
    server.queue(error_response(400, "temperature must be non-negative"))
    with pytest.raises(BadRequestError) as info:
        session(server).send("hi")
    assert str(info.value) == (f"HTTP 400 from {BASE_URL}/chat/completions: "
                               "temperature must be non-negative")


def test_unreachable_server_is_a_connection_error() -> None:
    port = free_port()  # a port nobody listens on
    s = Session(f"http://127.0.0.1:{port}/v1", MODEL, max_retries=0)
    with pytest.raises(APIConnectionError, match=f"could not reach http://127.0.0.1:{port}"):
        s.send("hi")
    assert s.messages == ()
    s.close()


def test_options_merge_session_then_turn(server: FakeServer) -> None:
    server.queue(stream_response(sse("vllm_text.sse")))
    s = session(server, temperature=0.5, max_tokens=16, extra_body={"top_k": 1})
    s.send("hi", temperature=0.0, seed=3, extra_body={"repetition_penalty": 1.1})
    body = server.body()
    assert (body["temperature"], body["max_tokens"], body["seed"]) == (0.0, 16, 3)
    assert (body["top_k"], body["repetition_penalty"]) == (1, 1.1)
    assert body["stream_options"] == {"include_usage": True}
    with pytest.raises(TypeError, match="temprature"):
        s.send("hi", temprature=0)  # type: ignore[call-arg]


def test_save_and_load_keep_the_token_and_the_prefix(server: FakeServer, tmp_path) -> None:
    server.queue(stream_response(sse("router_text.sse")), stream_response(sse("vllm_text.sse")))
    s = session(server, session_id="conv-7", max_tokens=8)
    s.send("hello")
    path = tmp_path / "session.json"
    s.save(path)
    loaded = Session.load(path, transport=server.transport)
    assert loaded.messages == s.messages and loaded.session_id == "conv-7"
    assert loaded.cache_token == TOKEN_1
    loaded.send("again")
    request = server.requests[-1]
    assert request.headers[CACHE_TOKEN_HEADER] == TOKEN_1
    assert request.headers[SESSION_HEADER] == "conv-7"
    assert json.loads(request.content)["max_tokens"] == 8
    assert request.content.startswith(messages_prefix(server.requests[0].content))


def test_expired_token_is_not_sent(server: FakeServer) -> None:
    server.queue(stream_response(sse("vllm_text.sse")))
    old = AssistantMessage(content="x", cache_token="kva1.a.b",
                           cache_token_expires_at=datetime.now(UTC) - timedelta(seconds=1))
    s = session(server, messages=[UserMessage(content="q"), old])
    assert s.cache_token is None
    s.send("next")
    assert CACHE_TOKEN_HEADER not in server.requests[0].headers


def test_fork_and_truncate(server: FakeServer) -> None:
    server.queue(stream_response(sse("router_text.sse")), stream_response(sse("vllm_text.sse")))
    s = session(server)
    s.send("hello")
    branch = s.fork()
    assert branch.messages == s.messages and branch.session_id == s.session_id
    branch.send("other direction")
    assert len(branch.messages) == 5 and len(s.messages) == 3  # independent histories
    s.truncate(1)
    assert [m.role for m in s.messages] == ["system"] and s.cache_token is None
    assert s.fork(0, session_id="conv-b").messages == ()


def test_breaking_out_of_a_stream_leaves_history_unchanged(server: FakeServer) -> None:
    server.queue(stream_response(sse("router_text.sse"), split=40))
    s = session(server)
    with s.stream("hi") as events:
        for event in events:
            assert isinstance(event, TextDelta)
            break
    assert [m.role for m in s.messages] == ["system"]


def test_a_second_turn_cannot_start_while_one_is_streaming(server: FakeServer) -> None:
    server.queue(stream_response(sse("router_text.sse"), split=40))
    s = session(server)
    events = s.stream("hi")
    next(events)
    with pytest.raises(RuntimeError, match="already running"):
        s.send("again")
    events.until_done()
    assert len(s.messages) == 3


def test_tool_loop_runs_parallel_calls_and_feeds_results_back(server: FakeServer) -> None:
    server.queue(stream_response(sse("router_parallel_tools.sse")),
                 stream_response(sse("router_final_answer.sse")))
    s = session(server, tools=[get_weather, get_time])
    run = s.run("Weather and time in Paris?", tool_choice="auto")
    assert run.stop_reason == "final" and run.text == "It is 18°C in Paris at noon."
    assert [m.content for m in run.tool_results] == ["18c and sunny in Paris",
                                                    "12:00 in Europe/Paris"]
    second = server.body(1)
    assert second["tool_choice"] == "auto"
    assert second["messages"][-2:] == [
        {"role": "tool", "tool_call_id": "chatcmpl-tool-a1b2c3", "content":
         "18c and sunny in Paris"},
        {"role": "tool", "tool_call_id": "chatcmpl-tool-d4e5f6", "content":
         "12:00 in Europe/Paris"}]


def test_failing_unknown_and_malformed_tools_are_told_to_the_model(server: FakeServer) -> None:
    @tool
    def get_weather(city: str, unit: str = "c") -> str:
        raise ConnectionError("weather API down")

    server.queue(stream_response(sse("router_parallel_tools.sse")),
                 stream_response(sse("router_final_answer.sse")))
    s = session(server, tools=[get_weather])  # get_time is not declared
    run = s.run("Weather and time?")
    contents = [m.content for m in run.tool_results]
    assert contents == [
        "Error: tool 'get_weather' raised ConnectionError: weather API down",
        "Error: unknown tool 'get_time'. Available tools: get_weather."]
    assert all(m.is_error for m in run.tool_results)
    assert run.stop_reason == "final"


def test_step_limit_stops_but_answers_every_call(server: FakeServer) -> None:
    server.queue(stream_response(sse("router_parallel_tools.sse")))
    s = session(server, tools=[get_weather, get_time])
    run = s.run("Weather?", max_steps=1)
    assert run.stop_reason == "max_steps" and len(run.steps) == 1
    assert [m.role for m in s.messages][-3:] == ["assistant", "tool", "tool"]
