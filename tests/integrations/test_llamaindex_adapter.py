"""``KVAgentLLM`` against a scripted router (``httpx.MockTransport``): no server, fast."""

from __future__ import annotations

import pytest

pytest.importorskip("llama_index.core", reason="extra kvagent[llamaindex] not installed")

from adapter_streams import (
    ScriptedRouter,
    Sent,
    as_router_stream,
    load_chunks,
    text_chunks,
    tool_call_chunks,
)
from kvagent.integrations.llamaindex import KVAgentLLM
from llama_index.core.agent.workflow import FunctionAgent
from llama_index.core.llms import ChatMessage
from llama_index.core.memory import ChatMemoryBuffer
from llama_index.core.tools import FunctionTool

TOKEN_1 = "kva1.eyJ0dXJuIjoxfQ.bWFjMQ"
TOKEN_2 = "kva1.eyJ0dXJuIjoyfQ.bWFjMg"


def llm_for(router: ScriptedRouter, **kwargs) -> KVAgentLLM:
    return KVAgentLLM(model="kvagent-demo", base_url="http://router.test/v1",
                      http_client=router.client(), http_async_client=router.async_client(),
                      **kwargs)


def get_weather(city: str) -> str:
    """Current weather for a city."""
    return f"sunny in {city}"


WEATHER = FunctionTool.from_defaults(get_weather)


def test_chat_usage_and_carrier() -> None:
    router = ScriptedRouter(streams=[as_router_stream(load_chunks("vllm_text.sse"),
                                                      token=TOKEN_1, cached=16)])
    response = llm_for(router).chat([ChatMessage(role="system", content="You are terse."),
                                     ChatMessage(role="user", content="Hello there")])
    assert response.message.role == "assistant"
    assert response.message.content == " 11727 443 616 616 6015 45321 233 5220"
    assert response.additional_kwargs == {"prompt_tokens": 25, "completion_tokens": 8,
                                          "total_tokens": 33, "cached_tokens": 16}
    carried = response.message.additional_kwargs["kvagent"]
    assert carried["cache_token"] == TOKEN_1
    assert carried["session_id"] == router.sent[0].session_id
    assert router.sent[0].token is None


def test_history_resent_carries_token_and_session() -> None:
    router = ScriptedRouter(streams=[text_chunks("one", token=TOKEN_1),
                                     text_chunks("two", token=TOKEN_2, cached=25)])
    llm = llm_for(router)
    history = [ChatMessage(role="user", content="q1")]
    history.append(llm.chat(history).message)
    history.append(ChatMessage(role="user", content="q2"))
    second = llm.chat(history)
    assert router.sent[1].token == TOKEN_1
    assert router.sent[1].session_id == router.sent[0].session_id
    assert router.sent[1].body["messages"][1] == {"role": "assistant", "content": "one"}
    assert second.additional_kwargs["cached_tokens"] == 25


def test_carrier_survives_llamaindex_serialisation() -> None:
    router = ScriptedRouter(streams=[text_chunks("one", token=TOKEN_1), text_chunks("two")])
    llm = llm_for(router)
    answer = llm.chat([ChatMessage(role="user", content="q1")]).message
    restored = ChatMessage.model_validate_json(answer.model_dump_json())
    llm.chat([ChatMessage(role="user", content="q1"), restored,
              ChatMessage(role="user", content="q2")])
    assert router.sent[1].token == TOKEN_1


def test_stream_chat_accumulates_and_ends_with_the_carrier() -> None:
    router = ScriptedRouter(streams=[text_chunks("hello world", token=TOKEN_1, cached=3)])
    responses = list(llm_for(router).stream_chat([ChatMessage(role="user", content="hi")]))
    assert "".join(r.delta or "" for r in responses) == "hello world"
    assert [r.message.content for r in responses][-2:] == ["hello world", "hello world"]
    last = responses[-1]
    assert last.message.additional_kwargs["kvagent"]["cache_token"] == TOKEN_1
    assert last.additional_kwargs["cached_tokens"] == 3
    assert all("kvagent" not in r.message.additional_kwargs for r in responses[:-1])


async def test_async_chat_stream_and_complete() -> None:
    router = ScriptedRouter(streams=[text_chunks("a1", token=TOKEN_1), text_chunks("a2"),
                                     text_chunks("done"), text_chunks("sdone")])
    llm = llm_for(router)
    first = await llm.achat([ChatMessage(role="user", content="q")])
    stream = await llm.astream_chat([ChatMessage(role="user", content="q"), first.message,
                                     ChatMessage(role="user", content="q2")])
    deltas = [r.delta async for r in stream]
    assert "".join(d or "" for d in deltas) == "a2"
    assert router.sent[1].token == TOKEN_1
    assert (await llm.acomplete("say done")).text == "done"
    assert router.sent[2].body["messages"] == [{"role": "user", "content": "say done"}]
    chunks = [c async for c in await llm.astream_complete("again")]
    assert chunks[-1].text == "sdone"


def test_complete_and_stream_complete() -> None:
    router = ScriptedRouter(streams=[text_chunks("done"), text_chunks("streamed")])
    llm = llm_for(router, max_tokens=5, temperature=0.0)
    assert llm.complete("say done").text == "done"
    assert [c.text for c in llm.stream_complete("go")][-1] == "streamed"
    assert router.sent[0].body["max_tokens"] == 5 and router.sent[0].body["temperature"] == 0.0


def test_chat_with_tools_and_tool_calls_from_response() -> None:
    router = ScriptedRouter(streams=[
        tool_call_chunks([("c1", "get_weather", '{"city":"Rome"}'),
                          ("c2", "get_weather", '{"city":"Oslo"}')], token=TOKEN_1),
        tool_call_chunks([("c3", "get_weather", '{"city":"Paris"}'),
                          ("c4", "get_weather", '{"city":"Oslo"}')]),
    ])
    llm = llm_for(router)
    response = llm.chat_with_tools([WEATHER], user_msg="Weather?", tool_required=True,
                                   allow_parallel_tool_calls=True)
    calls = llm.get_tool_calls_from_response(response)
    assert [(c.tool_id, c.tool_name, c.tool_kwargs) for c in calls] == [
        ("c1", "get_weather", {"city": "Rome"}), ("c2", "get_weather", {"city": "Oslo"})]
    body = router.sent[0].body
    assert body["tool_choice"] == "required" and "parallel_tool_calls" not in body
    assert body["tools"][0]["function"]["name"] == "get_weather"
    # Not parallel: the request says so and only the first call is kept.
    single = llm.chat_with_tools([WEATHER], user_msg="Weather?", tool_choice="get_weather")
    assert [c.tool_id for c in llm.get_tool_calls_from_response(single)] == ["c3"]
    assert router.sent[1].body["parallel_tool_calls"] is False
    assert router.sent[1].body["tool_choice"] == {"type": "function",
                                                  "function": {"name": "get_weather"}}
    with pytest.raises(ValueError, match="at least one tool call"):
        llm.get_tool_calls_from_response(llm_for(ScriptedRouter(
            streams=[text_chunks("no tools")])).chat([ChatMessage(role="user", content="x")]))


async def test_function_agent_runs_tools_and_reuses_across_requests() -> None:
    """A FunctionAgent turn: tool call, tool result, final answer; every request after the
    first carries the previous answer's token, and the tool result goes back verbatim."""
    issued = iter(["kva1.dDE.bTE", "kva1.dDI.bTI", "kva1.dDM.bTM", "kva1.dDQ.bTQ"])

    def reply(sent: Sent) -> list[dict]:
        last = sent.body["messages"][-1]
        if last["role"] == "user":
            n = len(sent.body["messages"])
            return tool_call_chunks([(f"call-{n}", "get_weather", '{"city":"Rome"}')],
                                    token=next(issued), cached=10 * n)
        return text_chunks(f"final after {last['content']}", token=next(issued), cached=50)

    router = ScriptedRouter(reply=reply)
    agent = FunctionAgent(tools=[WEATHER], llm=llm_for(router), initial_tool_choice="required")
    memory = ChatMemoryBuffer.from_defaults(token_limit=8000)
    first = await agent.run("Weather in Rome?", memory=memory)
    second = await agent.run("And again?", memory=memory)

    assert str(first.response.content) == "final after sunny in Rome"
    assert str(second.response.content) == "final after sunny in Rome"
    assert len(router.sent) == 4
    assert [s.token for s in router.sent] == [None, "kva1.dDE.bTE", "kva1.dDI.bTI",
                                              "kva1.dDM.bTM"]
    assert len({s.session_id for s in router.sent}) == 1
    assert router.sent[0].body["tool_choice"] == "required"
    assert router.sent[1].body["tool_choice"] == "auto"
    tool_msg = router.sent[1].body["messages"][-1]
    assert tool_msg == {"role": "tool", "tool_call_id": "call-1", "content": "sunny in Rome"}
    # The second run resends the first run's messages unchanged (a stable prefix).
    assert router.sent[2].body["messages"][:4] == router.sent[1].body["messages"] + [
        {"role": "assistant", "content": "final after sunny in Rome"}]
