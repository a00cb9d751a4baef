"""The SDK (`from kvagent import Session`) against the router and fake P/D nodes.

Real HTTP on 127.0.0.1: the SDK's token carry, the router's reuse and the tool loop
together, as a user would run them.
"""

from __future__ import annotations

import asyncio
import json

import pytest
from fakes import SPECIALS, FakeCluster, Reply, router_stack
from kvagent import AsyncSession, Session, StreamInterrupted, tool

MODEL = "fake-model"
CALL = {"id": "call_w", "type": "function",
        "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})}}


def tool_then_answer(prompt: list[int]) -> Reply:
    """Call the tool unless the last message is the tool's result, then answer."""
    roles = [t for t in prompt if t in (SPECIALS["<|user|>"], SPECIALS["<|tool|>"])]
    if roles and roles[-1] == SPECIALS["<|tool|>"]:
        return Reply(content="It is sunny in Paris today, " + "really " * 20 + "sunny.")
    return Reply(tool_calls=[CALL])


@tool
def get_weather(city: str) -> str:
    """The weather in a city."""
    return f"sunny in {city}, 21C, light wind from the west"


async def test_async_session_multi_turn_reuse() -> None:
    async with router_stack(policy={"params": {"skip_prefill_max_tokens": 0}}) as st:
        async with AsyncSession(f"{st.url}/v1", MODEL, session_id="sdk-1",
                                system="You are terse. " * 10) as s:
            first = await s.send("Tell me about the sea. " * 5)
            second = await s.send("And about mountains, in more detail please. " * 3)
            third = await s.send("Thanks!")
        assert first.path == "pd_fresh" and first.cache_token_received
        assert second.path == "pd_reuse" and second.reused_tokens and second.reused_tokens > 0
        assert third.path == "pd_reuse" and third.reused_tokens > second.reused_tokens
        assert third.usage is not None and third.usage.prompt_tokens > third.reused_tokens
        assert not st.cluster.events_of("wrong_kv") and not st.cluster.open_leases()


async def test_async_tool_loop_reuses_across_tool_results() -> None:
    cluster = FakeCluster(reply=tool_then_answer)
    async with router_stack(cluster=cluster,
                            policy={"params": {"skip_prefill_max_tokens": 0}}) as st:
        async with AsyncSession(f"{st.url}/v1", MODEL, tools=[get_weather]) as s:
            run = await s.run("What is the weather in Paris? " * 8)
        assert run.stop_reason == "final"
        assert [m.content for m in run.tool_results] == [
            "sunny in Paris, 21C, light wind from the west"]
        assert [t.path for t in run.steps] == ["pd_fresh", "pd_reuse"]
        assert run.steps[1].reused_tokens and run.steps[1].reused_tokens > 0
        assert "sunny" in run.final.text
        assert not st.cluster.events_of("wrong_kv") and not st.cluster.open_leases()


async def test_sync_session_against_router() -> None:
    async with router_stack(policy={"params": {"skip_prefill_max_tokens": 64}}) as st:
        def conversation() -> list[str | None]:
            with Session(f"{st.url}/v1", MODEL, session_id="sync-1") as s:
                paths = [s.send("Describe a lighthouse. " * 10).path]
                paths.append(s.send("ok").path)
                return paths

        paths = await asyncio.to_thread(conversation)
        assert paths == ["pd_fresh", "d_direct"]


async def test_cut_stream_raises_stream_interrupted_then_recovers() -> None:
    async with router_stack(policy={"params": {"skip_prefill_max_tokens": 0}}) as st:
        async with AsyncSession(f"{st.url}/v1", MODEL, session_id="cut-1") as s:
            await s.send("Start a long story. " * 8)
            st.decode[0].cut_after_chunks = 3
            with pytest.raises(StreamInterrupted) as info:
                await s.send("Continue it.")
            assert info.value.partial_text
            st.decode[0].cut_after_chunks = None
            again = await s.send("Continue it.")
        # The cut turn had claimed the single-use handle: the retry recomputes, correctly.
        assert again.path in ("recompute", "pd_reuse")
        assert again.cache_token_received
        assert not st.cluster.events_of("wrong_kv")
