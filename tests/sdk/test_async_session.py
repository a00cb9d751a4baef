"""AsyncSession: the same core through httpx.AsyncClient, tools gathered concurrently."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from kvagent import (
    AsyncSession,
    Done,
    MalformedStream,
    NotFoundError,
    StreamInterrupted,
    TextDelta,
    tool,
)
from kvagent.protocol import CACHE_TOKEN_HEADER
from sdk_helpers import BASE_URL, MODEL, FakeServer, error_response, sse, stream_response

TOKEN_1 = json.loads(sse("router_text.sse").split(b"data: ")[-2])["kvagent"]["cache_token"]


def session(server: FakeServer, **kw) -> AsyncSession:
    return AsyncSession(BASE_URL, MODEL, transport=server.transport, **kw)


async def test_stream_and_token_carry(server: FakeServer) -> None:
    server.queue(stream_response(sse("router_text.sse"), split=5),
                 stream_response(sse("vllm_text.sse")))
    async with session(server, system="sys") as s:
        events = [e async for e in s.stream("hi")]
        assert [type(e) for e in events] == [TextDelta] * 8 + [Done]
        await s.send("more")
    assert server.requests[1].headers[CACHE_TOKEN_HEADER] == TOKEN_1
    first = json.loads(server.requests[0].content)["messages"]
    assert json.loads(server.requests[1].content)["messages"][:len(first)] == first


async def test_parallel_async_tools_really_run_concurrently(server: FakeServer) -> None:
    # Each tool waits for the other to start: only a concurrent gather can finish.
    started = {"get_weather": asyncio.Event(), "get_time": asyncio.Event()}

    @tool
    async def get_weather(city: str, unit: str = "c") -> str:
        started["get_weather"].set()
        await asyncio.wait_for(started["get_time"].wait(), 2)
        return f"sunny in {city} ({unit})"

    @tool
    async def get_time(timezone: str) -> str:
        started["get_time"].set()
        await asyncio.wait_for(started["get_weather"].wait(), 2)
        return f"noon in {timezone}"

    server.queue(stream_response(sse("router_parallel_tools.sse")),
                 stream_response(sse("router_final_answer.sse")))
    async with session(server, tools=[get_weather, get_time]) as s:
        run = await s.run("weather and time")
    assert [m.content for m in run.tool_results] == ["sunny in Paris (c)",
                                                    "noon in Europe/Paris"]
    assert run.stop_reason == "final" and run.final.path == "d_direct"


async def test_sync_tool_raising_in_async_session_is_reported(server: FakeServer) -> None:
    @tool
    def get_weather(city: str, unit: str = "c") -> str:
        raise ValueError(f"no station in {city}")

    @tool
    def get_time(timezone: str) -> str:
        return timezone

    server.queue(stream_response(sse("router_parallel_tools.sse")),
                 stream_response(sse("router_final_answer.sse")))
    async with session(server, tools=[get_weather, get_time]) as s:
        run = await s.run("x", parallel_tool_calls=False)
    assert run.tool_results[0].content == "Error: tool 'get_weather' raised ValueError: " \
        "no station in Paris"
    assert run.tool_results[1].content == "Europe/Paris"


async def test_mid_stream_failure_keeps_history(server: FakeServer) -> None:
    body = sse("router_text.sse")
    server.queue(stream_response(body),
                 stream_response(body[:body.index(b" mild")], fail=httpx.RemoteProtocolError(
                     "peer closed connection")))
    async with session(server) as s:
        await s.send("one")
        before = s.messages
        with pytest.raises(StreamInterrupted) as info:
            await s.send("two")
    assert info.value.partial_text == "The weather in Paris is"
    assert s.messages == before and s.cache_token == TOKEN_1


async def test_errors_are_the_same_types(server: FakeServer) -> None:
    server.queue(error_response(404, "The model `nope` does not exist."),
                 stream_response(sse("not_json.sse")))
    async with AsyncSession(BASE_URL, "nope", transport=server.transport) as s:
        with pytest.raises(NotFoundError, match="'nope'"):
            await s.send("hi")
        with pytest.raises(MalformedStream):
            await s.send("hi")
    assert s.messages == ()


async def test_closing_an_async_stream_early_leaves_history(server: FakeServer) -> None:
    server.queue(stream_response(sse("router_text.sse"), split=40))
    async with session(server) as s:
        async with s.stream("hi") as events:
            async for _ in events:
                break
        assert s.messages == ()
        assert not s._busy
