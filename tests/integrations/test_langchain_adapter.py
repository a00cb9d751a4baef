"""``ChatKVAgent`` against a scripted router (``httpx.MockTransport``): no server, fast."""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import UTC, datetime, timedelta

import httpx
import pytest

pytest.importorskip("langchain_core", reason="extra kvagent[langchain] not installed")

import kvagent
from adapter_streams import (
    ScriptedRouter,
    as_router_stream,
    load_chunks,
    text_chunks,
    tool_call_chunks,
)
from kvagent.integrations.langchain import ChatKVAgent
from langchain_core.messages import (
    AIMessage,
    AIMessageChunk,
    HumanMessage,
    SystemMessage,
    ToolMessage,
)
from langchain_core.tools import tool
from pydantic import BaseModel

TOKEN_1 = "kva1.eyJ0dXJuIjoxfQ.bWFjMQ"
TOKEN_2 = "kva1.eyJ0dXJuIjoyfQ.bWFjMg"


def model_for(router: ScriptedRouter, **kwargs) -> ChatKVAgent:
    return ChatKVAgent(model="kvagent-demo", base_url="http://router.test/v1",
                       http_client=router.client(), http_async_client=router.async_client(),
                       **kwargs)


@tool
def get_weather(city: str) -> str:
    """Current weather for a city."""
    return f"sunny in {city}"


def test_invoke_maps_usage_and_carries_the_token_on_the_message() -> None:
    router = ScriptedRouter(streams=[as_router_stream(load_chunks("vllm_text.sse"),
                                                      token=TOKEN_1, cached=16)])
    reply = model_for(router).invoke([SystemMessage("You are terse."), HumanMessage("Hello there")])

    assert isinstance(reply, AIMessage)
    assert reply.content == " 11727 443 616 616 6015 45321 233 5220"
    assert reply.usage_metadata == {"input_tokens": 25, "output_tokens": 8, "total_tokens": 33,
                                    "input_token_details": {"cache_read": 16}}
    carried = reply.response_metadata["kvagent"]
    assert carried["cache_token"] == TOKEN_1
    assert carried["session_id"] == router.sent[0].session_id
    assert carried["reused_tokens"] == 16 and carried["path"] == "pd_fresh"
    assert reply.response_metadata["finish_reason"] == "length"
    # First turn: a fresh session id, no token, a streamed request with usage.
    sent = router.sent[0]
    assert sent.token is None and sent.session_id
    assert sent.body["stream"] is True and sent.body["stream_options"] == {"include_usage": True}
    assert sent.body["messages"] == [{"role": "system", "content": "You are terse."},
                                     {"role": "user", "content": "Hello there"}]


def test_resent_history_sends_the_last_answers_token_and_session() -> None:
    router = ScriptedRouter(streams=[text_chunks("first answer", token=TOKEN_1),
                                     text_chunks("second answer", token=TOKEN_2, cached=28)])
    llm = model_for(router)
    history = [HumanMessage("one")]
    history.append(llm.invoke(history))
    history.append(HumanMessage("two"))
    second = llm.invoke(history)

    first_sent, second_sent = router.sent
    assert second_sent.token == TOKEN_1
    assert second_sent.session_id == first_sent.session_id
    assert second_sent.body["messages"][:2] == [{"role": "user", "content": "one"},
                                                {"role": "assistant", "content": "first answer"}]
    assert second.usage_metadata["input_token_details"]["cache_read"] == 28
    assert second.response_metadata["kvagent"]["cache_token"] == TOKEN_2


def test_only_the_last_ai_message_counts() -> None:
    router = ScriptedRouter(streams=[text_chunks("a", token=TOKEN_1), text_chunks("b")])
    llm = model_for(router)
    answered = llm.invoke([HumanMessage("one")])
    # An assistant message written by hand (no carrier) comes after the carried one.
    llm.invoke([HumanMessage("one"), answered, HumanMessage("two"),
                AIMessage("hand-written"), HumanMessage("three")])
    assert router.sent[1].token is None
    # The session still follows the conversation only when a carrier says which one it is.
    assert router.sent[1].session_id != router.sent[0].session_id


def test_expired_token_is_not_sent_but_the_session_is_kept() -> None:
    router = ScriptedRouter(streams=[text_chunks("b")])
    past = (datetime.now(UTC) - timedelta(seconds=5)).isoformat()
    old = AIMessage("a", response_metadata={"kvagent": {
        "session_id": "conv-7", "cache_token": TOKEN_1, "cache_token_expires_at": past}})
    model_for(router).invoke([HumanMessage("one"), old, HumanMessage("two")])
    assert router.sent[0].token is None
    assert router.sent[0].session_id == "conv-7"


def test_configured_session_id_wins_and_drops_a_foreign_token() -> None:
    router = ScriptedRouter(streams=[text_chunks("b"), text_chunks("c")])
    carried = AIMessage("a", response_metadata={"kvagent": {"session_id": "conv-7",
                                                            "cache_token": TOKEN_1}})
    model_for(router, session_id="pinned").invoke([HumanMessage("x"), carried])
    assert router.sent[0].session_id == "pinned" and router.sent[0].token is None
    mine = AIMessage("a", additional_kwargs={"kvagent": {"session_id": "pinned",
                                                         "cache_token": TOKEN_2}})
    model_for(router, session_id="pinned").invoke([HumanMessage("x"), mine])
    assert router.sent[1].token == TOKEN_2


def test_stream_yields_tool_call_chunks_and_one_final_chunk() -> None:
    router = ScriptedRouter(streams=[as_router_stream(load_chunks("vllm_tool_calls.sse"),
                                                      token=TOKEN_1, cached=0)])
    llm = model_for(router).bind_tools([get_weather], tool_choice="any")
    chunks = list(llm.stream("Weather in Paris and Rome?"))

    assert all(isinstance(c, AIMessageChunk) for c in chunks)
    assert sum(1 for c in chunks if c.tool_call_chunks) > 4  # fragments arrive as they stream
    assert [c.usage_metadata is not None for c in chunks].count(True) == 1
    assert chunks[-1].chunk_position == "last"
    full = chunks[0]
    for c in chunks[1:]:
        full = full + c
    # The recorded answer: one complete call, one cut off by max_tokens. LangChain parses
    # streamed arguments leniently (the cut one becomes {"city": ""}); the raw text the
    # model wrote is kept for the resend.
    assert [(c["id"], c["args"]) for c in full.tool_calls] == [
        ("chatcmpl-tool-92d270b80a3f13ef", {"city": "Rome"}),
        ("chatcmpl-tool-abd12a4f78a2ed92", {"city": ""})]
    assert full.response_metadata["kvagent"]["tool_arguments"] == {
        "chatcmpl-tool-92d270b80a3f13ef": '{"city":"Rome"}',
        "chatcmpl-tool-abd12a4f78a2ed92": '{"city":"'}
    assert full.response_metadata["kvagent"]["cache_token"] == TOKEN_1
    body = router.sent[0].body
    assert body["tool_choice"] == "required"
    assert body["tools"][0]["function"]["name"] == "get_weather"
    assert body["tools"][0]["function"]["parameters"]["required"] == ["city"]


def test_invoke_reports_a_cut_tool_call_as_invalid() -> None:
    router = ScriptedRouter(streams=[as_router_stream(load_chunks("vllm_tool_calls.sse"),
                                                      token=TOKEN_1)])
    ai = model_for(router).bind_tools([get_weather], tool_choice="any").invoke("Weather?")
    assert ai.tool_calls == [{"name": "get_weather", "args": {"city": "Rome"},
                              "id": "chatcmpl-tool-92d270b80a3f13ef", "type": "tool_call"}]
    assert [(c["id"], c["args"]) for c in ai.invalid_tool_calls] == [
        ("chatcmpl-tool-abd12a4f78a2ed92", '{"city":"')]


def test_tool_round_trip_resends_calls_as_the_model_wrote_them() -> None:
    raw_args = '{"city":  "Rome"}'  # odd spacing: must come back byte for byte
    router = ScriptedRouter(streams=[
        tool_call_chunks([("call-1", "get_weather", raw_args)], token=TOKEN_1),
        text_chunks("It is sunny.", token=TOKEN_2, cached=200),
    ])
    llm = model_for(router).bind_tools([get_weather])
    history = [HumanMessage("Weather in Rome?")]
    ai = llm.invoke(history)
    assert ai.tool_calls[0]["args"] == {"city": "Rome"}
    history += [ai, ToolMessage(get_weather.invoke(ai.tool_calls[0]["args"]),
                                tool_call_id=ai.tool_calls[0]["id"])]
    final = llm.invoke(history)

    sent = router.sent[1]
    assert sent.token == TOKEN_1
    assert sent.body["messages"][1:] == [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call-1", "type": "function",
             "function": {"name": "get_weather", "arguments": raw_args}}]},
        {"role": "tool", "tool_call_id": "call-1", "content": "sunny in Rome"},
    ]
    assert final.content == "It is sunny."
    assert final.usage_metadata["input_token_details"]["cache_read"] == 200


def test_bind_tools_choices() -> None:
    router = ScriptedRouter(streams=[text_chunks("x"), text_chunks("y"), text_chunks("z")])
    model = model_for(router)
    model.bind_tools([get_weather], tool_choice="get_weather").invoke("hi")
    model.bind_tools([get_weather], tool_choice=True, parallel_tool_calls=False).invoke("hi")
    model.bind_tools([get_weather]).invoke("hi")
    named = {"type": "function", "function": {"name": "get_weather"}}
    assert router.sent[0].body["tool_choice"] == named
    assert router.sent[1].body["tool_choice"] == named
    assert router.sent[1].body["parallel_tool_calls"] is False
    assert "tool_choice" not in router.sent[2].body
    with pytest.raises(ValueError, match="neither"):
        model.bind_tools([get_weather], tool_choice="nope")


def test_standard_params_reach_the_request() -> None:
    router = ScriptedRouter(streams=[text_chunks("x"), text_chunks("y")])
    llm = model_for(router, temperature=0.0, max_tokens=12, stop=["END"], api_key="sk-1",
                    model_kwargs={"top_k": 3}, default_headers={"X-Trace": "t1"})
    llm.invoke("hi")
    llm.invoke("hi", stop=["HALT"], model="other-model", temperature=0.5)
    first, second = router.sent
    assert first.body["temperature"] == 0.0 and first.body["max_tokens"] == 12
    assert first.body["stop"] == ["END"] and first.body["top_k"] == 3
    assert first.headers["authorization"] == "Bearer sk-1"
    assert first.headers["x-trace"] == "t1"
    assert second.body["stop"] == ["HALT"] and second.body["model"] == "other-model"
    assert second.body["temperature"] == 0.5


async def test_ainvoke_and_astream() -> None:
    router = ScriptedRouter(streams=[text_chunks("async one", token=TOKEN_1),
                                     text_chunks("async two", token=TOKEN_2, cached=20)])
    llm = model_for(router)
    first = await llm.ainvoke([HumanMessage("one")])
    chunks = [c async for c in llm.astream([HumanMessage("one"), first, HumanMessage("two")])]
    text = "".join(c.content for c in chunks)
    assert first.content == "async one" and text == "async two"
    assert router.sent[1].token == TOKEN_1
    assert chunks[-1].usage_metadata["input_token_details"]["cache_read"] == 20
    assert chunks[-1].response_metadata["kvagent"]["cache_token"] == TOKEN_2


def test_streaming_flag_streams_under_invoke_with_callbacks() -> None:
    from langchain_core.callbacks import BaseCallbackHandler

    class Tokens(BaseCallbackHandler):
        def __init__(self) -> None:
            self.tokens: list[str] = []

        def on_llm_new_token(self, token: str, **kwargs) -> None:
            self.tokens.append(token)

    router = ScriptedRouter(streams=[text_chunks("streamed reply", token=TOKEN_1, cached=4)])
    handler = Tokens()
    reply = model_for(router, streaming=True).invoke("hi", config={"callbacks": [handler]})
    assert "".join(handler.tokens) == "streamed reply" == reply.content
    assert reply.response_metadata["kvagent"]["cache_token"] == TOKEN_1
    assert reply.usage_metadata["input_token_details"]["cache_read"] == 4


class Person(BaseModel):
    name: str
    age: int


def test_structured_output_json_schema_and_function_calling() -> None:
    router = ScriptedRouter(streams=[
        text_chunks('{"name":"Ada","age":36}'),
        tool_call_chunks([("c1", "Person", '{"name":"Bo","age":7}')]),
    ])
    model = model_for(router)
    assert model.with_structured_output(Person, method="json_schema").invoke("x") == \
        Person(name="Ada", age=36)
    fmt = router.sent[0].body["response_format"]
    assert fmt["type"] == "json_schema" and fmt["json_schema"]["schema"]["required"] == [
        "name", "age"]
    assert model.with_structured_output(Person).invoke("x") == Person(name="Bo", age=7)
    assert router.sent[1].body["tool_choice"] == "required"


def test_http_errors_surface_as_kvagent_errors() -> None:
    def not_found(request: httpx.Request) -> httpx.Response:
        return httpx.Response(404, json={"error": {"message": "model nope does not exist"}})

    llm = ChatKVAgent(model="nope", base_url="http://router.test/v1", max_retries=0,
                      http_client=httpx.Client(transport=httpx.MockTransport(not_found)))
    with pytest.raises(kvagent.NotFoundError, match="nope"):
        llm.invoke("hi")


def test_images_reach_the_server_as_openai_parts() -> None:
    router = ScriptedRouter(streams=[text_chunks("a cat")])
    llm = model_for(router)
    image = HumanMessage(content=[{"type": "text", "text": "what is this"},
                                  {"type": "image_url", "image_url": {"url": "data:,"}}])
    assert llm.invoke([image]).content == "a cat"
    user = router.sent[0].body["messages"][-1]
    assert user == {"role": "user", "content": [
        {"type": "text", "text": "what is this"},
        {"type": "image_url", "image_url": {"url": "data:,"}}]}


def test_import_kvagent_does_not_import_frameworks() -> None:
    code = ("import sys, kvagent, kvagent.integrations; "
            "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('langchain_core', 'llama_index', 'openai'))))")
    out = subprocess.run([sys.executable, "-c", "import json; " + code], check=True,
                         capture_output=True, text=True).stdout
    assert json.loads(out) == []
