"""Clients nobody here wrote drive the router through multi-turn conversations, in front
of fake P/D nodes (fast, always) and of the real bundle (marker `vllm`).

Each client sends only a session id (header `X-Session-ID`, set once on the client) and
the whole history every turn, as any OpenAI client does; none of them knows the cache
token. Every later turn must reuse KV (the router's reuse counters grow by one per turn,
and where the client exposes unknown fields, the `kvagent` object says so), and no client
may fail on anything the router sends. The raw aiohttp client reads `choices[0]` of every
chunk with `include_usage` off, as vLLM's own multi-turn benchmark client does.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Callable
from typing import Any

import aiohttp
import openai
import pytest
from client_targets import client_bundle, reuse_hits  # noqa: F401 - fixture `bundle`
from kvagent.protocol import SESSION_HEADER

# A long, stable system prompt: reuse covers whole KV blocks of it and of the history.
SYSTEM = "You are a weather assistant. Answer briefly and call tools when asked. " * 12
QUESTIONS = ["How is the weather in Oslo?", "And in Lima?", "And in Perth?"]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "enum": ["oslo", "lima", "perth"]}},
        "required": ["city"]}}}]
MAX_TOKENS = 12


def session_id() -> str:
    return f"third-party-{uuid.uuid4().hex[:12]}"


def converse(bundle: Any, turn: Callable[[list[dict[str, Any]]], str],
             questions: list[str] = QUESTIONS) -> list[float]:
    """Run `turn` (history -> answer text) over the questions; returns the router's reuse
    hits each turn added."""
    history: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
    added = []
    for question in questions:
        history.append({"role": "user", "content": question})
        before = reuse_hits(bundle.router_url)
        history.append({"role": "assistant", "content": turn(history)})
        added.append(reuse_hits(bundle.router_url) - before)
    return added


def assert_reused_after_first(added: list[float]) -> None:
    assert added[0] == 0 and all(n == 1 for n in added[1:]), added


def kvagent_info(obj: Any) -> dict[str, Any]:
    return (getattr(obj, "model_extra", None) or {}).get("kvagent") or {}


# ------------------------------------------------------------------ openai-python


def test_openai_sync_streaming_reuses_with_session_id_only(bundle: Any) -> None:
    client = openai.OpenAI(base_url=bundle.base_url, api_key="none", max_retries=0,
                           default_headers={SESSION_HEADER: session_id()})
    paths: list[str] = []

    def turn(history: list[dict[str, Any]]) -> str:
        text = []
        # No stream_options: the plain call most code makes.
        for chunk in client.chat.completions.create(
                model=bundle.model, messages=history, stream=True, temperature=0.0,
                max_tokens=MAX_TOKENS):
            text.append(chunk.choices[0].delta.content or "")
            if kvagent_info(chunk):
                paths.append(kvagent_info(chunk)["path"])
                assert chunk.choices[0].finish_reason  # it rides on the finish chunk
        return "".join(text)

    with client:
        assert_reused_after_first(converse(bundle, turn))
    assert len(paths) == 3 and all(p in ("pd_reuse", "d_direct") for p in paths[1:]), paths


def test_openai_sync_streaming_with_usage(bundle: Any) -> None:
    client = openai.OpenAI(base_url=bundle.base_url, api_key="none", max_retries=0,
                           default_headers={SESSION_HEADER: session_id()})
    cached: list[int] = []

    def turn(history: list[dict[str, Any]]) -> str:
        text = []
        for chunk in client.chat.completions.create(
                model=bundle.model, messages=history, stream=True, temperature=0.0,
                max_tokens=MAX_TOKENS, stream_options={"include_usage": True}):
            text.extend(c.delta.content or "" for c in chunk.choices)
            if chunk.usage is not None:
                cached.append(chunk.usage.prompt_tokens_details.cached_tokens)
                assert kvagent_info(chunk)["reused_tokens"] <= cached[-1]
        return "".join(text)

    with client:
        assert_reused_after_first(converse(bundle, turn))
    assert len(cached) == 3 and all(n > 0 for n in cached[1:]), cached


async def test_openai_async_whole_reuses(bundle: Any) -> None:
    client = openai.AsyncOpenAI(base_url=bundle.base_url, api_key="none", max_retries=0,
                                default_headers={SESSION_HEADER: session_id()})
    history: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
    reused = []
    async with client:
        for question in QUESTIONS:
            history.append({"role": "user", "content": question})
            resp = await client.chat.completions.create(
                model=bundle.model, messages=history, temperature=0.0, max_tokens=MAX_TOKENS)
            history.append({"role": "assistant", "content": resp.choices[0].message.content})
            reused.append(kvagent_info(resp)["reused_tokens"])
            assert resp.usage.prompt_tokens_details.cached_tokens >= reused[-1]
    assert reused[0] == 0 and all(n > 0 for n in reused[1:]), reused


async def test_openai_async_streaming_reuses_with_session_id_only(bundle: Any) -> None:
    client = openai.AsyncOpenAI(base_url=bundle.base_url, api_key="none", max_retries=0,
                                default_headers={SESSION_HEADER: session_id()})
    history: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
    added: list[float] = []
    paths: list[str] = []
    async with client:
        for question in QUESTIONS:
            history.append({"role": "user", "content": question})
            before = await asyncio.to_thread(reuse_hits, bundle.router_url)
            text = []
            # No stream_options: the plain call most code makes.
            stream = await client.chat.completions.create(
                model=bundle.model, messages=history, stream=True, temperature=0.0,
                max_tokens=MAX_TOKENS)
            async for chunk in stream:
                text.append(chunk.choices[0].delta.content or "")
                if kvagent_info(chunk):
                    paths.append(kvagent_info(chunk)["path"])
                    assert chunk.choices[0].finish_reason  # it rides on the finish chunk
            added.append(await asyncio.to_thread(reuse_hits, bundle.router_url) - before)
            history.append({"role": "assistant", "content": "".join(text)})
    assert_reused_after_first(added)
    assert len(paths) == 3 and all(p in ("pd_reuse", "d_direct") for p in paths[1:]), paths


def test_openai_streamed_tool_calls_multi_turn(bundle: Any) -> None:
    """A forced tool call streamed as deltas, its result sent back, three times over."""
    if not bundle.real:
        pytest.skip("the fake nodes answer with text; vLLM's structured outputs force calls")
    client = openai.OpenAI(base_url=bundle.base_url, api_key="none", max_retries=0,
                           default_headers={SESSION_HEADER: session_id()})
    history: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
    added = []
    with client:
        for question in QUESTIONS:
            history.append({"role": "user", "content": question})
            before = reuse_hits(bundle.router_url)
            calls: dict[int, dict[str, Any]] = {}
            finish = None
            for chunk in client.chat.completions.create(
                    model=bundle.model, messages=history, stream=True, tools=TOOLS,
                    tool_choice="required", parallel_tool_calls=False, temperature=0.0,
                    max_tokens=48):
                choice = chunk.choices[0]
                for d in choice.delta.tool_calls or ():
                    call = calls.setdefault(d.index, {"id": "", "name": "", "arguments": ""})
                    call["id"] = d.id or call["id"]
                    if d.function is not None:
                        call["name"] += d.function.name or ""
                        call["arguments"] += d.function.arguments or ""
                finish = choice.finish_reason or finish
            added.append(reuse_hits(bundle.router_url) - before)
            assert finish == "tool_calls" and len(calls) == 1, (finish, calls)
            call = calls[0]
            city = json.loads(call["arguments"])["city"]
            history.append({"role": "assistant", "content": None, "tool_calls": [
                {"id": call["id"], "type": "function",
                 "function": {"name": call["name"], "arguments": call["arguments"]}}]})
            history.append({"role": "tool", "tool_call_id": call["id"],
                            "content": f"{city}: sunny, 21 C"})
    assert_reused_after_first(added)


# ------------------------------------------------------------------ frameworks


@pytest.mark.parametrize("stream_usage", [False, True])
def test_langchain_chat_openai_multi_turn(bundle: Any, stream_usage: bool) -> None:
    from langchain_core.messages import AIMessage, HumanMessage, SystemMessage
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model=bundle.model, base_url=bundle.base_url, api_key="none",
                     temperature=0.0, max_tokens=MAX_TOKENS, max_retries=0,
                     stream_usage=stream_usage,
                     default_headers={SESSION_HEADER: session_id()})
    messages: list[Any] = [SystemMessage(SYSTEM)]
    added = []
    for i, question in enumerate(QUESTIONS):
        messages.append(HumanMessage(question))
        before = reuse_hits(bundle.router_url)
        if i % 2:
            ai = llm.invoke(messages)
        else:  # streamed turns too: chunks summed as LangChain does
            ai = None
            for part in llm.stream(messages):
                ai = part if ai is None else ai + part
        added.append(reuse_hits(bundle.router_url) - before)
        assert isinstance(ai.content, str)
        if stream_usage or i % 2:
            assert ai.usage_metadata["input_tokens"] > 0
        messages.append(AIMessage(ai.content))
    assert_reused_after_first(added)


def test_llamaindex_openai_like_multi_turn(bundle: Any) -> None:
    from llama_index.core.llms import ChatMessage
    from llama_index.llms.openai_like import OpenAILike

    llm = OpenAILike(model=bundle.model, api_base=bundle.base_url, api_key="none",
                     is_chat_model=True, context_window=16384, max_tokens=MAX_TOKENS,
                     temperature=0.0, max_retries=0,
                     default_headers={SESSION_HEADER: session_id()})
    messages = [ChatMessage(role="system", content=SYSTEM)]
    added = []
    for i, question in enumerate(QUESTIONS):
        messages.append(ChatMessage(role="user", content=question))
        before = reuse_hits(bundle.router_url)
        if i % 2:
            response = llm.chat(messages)
        else:
            response = None
            for response in llm.stream_chat(messages):
                pass
        added.append(reuse_hits(bundle.router_url) - before)
        assert response is not None and isinstance(response.message.content, str)
        messages.append(ChatMessage(role="assistant", content=response.message.content))
    assert_reused_after_first(added)


async def test_llamaindex_openai_like_async(bundle: Any) -> None:
    from llama_index.core.llms import ChatMessage
    from llama_index.llms.openai_like import OpenAILike

    llm = OpenAILike(model=bundle.model, api_base=bundle.base_url, api_key="none",
                     is_chat_model=True, context_window=16384, max_tokens=MAX_TOKENS,
                     temperature=0.0, max_retries=0,
                     default_headers={SESSION_HEADER: session_id()})
    messages = [ChatMessage(role="system", content=SYSTEM)]
    added = []
    for question in QUESTIONS[:2]:
        messages.append(ChatMessage(role="user", content=question))
        before = await asyncio.to_thread(reuse_hits, bundle.router_url)
        text = ""
        async for response in await llm.astream_chat(messages):
            text = response.message.content or ""
        added.append(await asyncio.to_thread(reuse_hits, bundle.router_url) - before)
        messages.append(ChatMessage(role="assistant", content=text))
    assert_reused_after_first(added)


# ------------------------------------------------------------------ raw aiohttp


async def test_raw_aiohttp_client_indexing_choices_zero(bundle: Any) -> None:
    """vLLM's benchmark client's way: `include_usage` off, `choices[0]` of every chunk."""
    sid = session_id()
    history: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
    added = []
    async with aiohttp.ClientSession() as http:
        for question in QUESTIONS:
            history.append({"role": "user", "content": question})
            before = await asyncio.to_thread(reuse_hits, bundle.router_url)
            body = {"model": bundle.model, "messages": history, "stream": True,
                    "stream_options": {"include_usage": False}, "temperature": 0.0,
                    "max_tokens": MAX_TOKENS}
            text, finish, info = [], None, {}
            async with http.post(f"{bundle.base_url}/chat/completions", json=body,
                                 headers={SESSION_HEADER: sid}) as resp:
                assert resp.status == 200
                assert resp.headers["content-type"].startswith("text/event-stream")
                done = False
                async for raw in resp.content:
                    line = raw.decode().strip()
                    if not line:
                        continue
                    assert line.startswith("data: ") and not done, line
                    data = line[len("data: "):]
                    if data == "[DONE]":
                        done = True
                        continue
                    chunk = json.loads(data)
                    choice = chunk["choices"][0]  # IndexError on a choice-less chunk
                    text.append(choice["delta"].get("content") or "")
                    finish = choice.get("finish_reason") or finish
                    info = chunk.get("kvagent") or info
                assert done and finish in ("stop", "length")
            added.append(await asyncio.to_thread(reuse_hits, bundle.router_url) - before)
            history.append({"role": "assistant", "content": "".join(text)})
            assert info["path"] in (("pd_fresh",) if len(added) == 1
                                    else ("pd_reuse", "d_direct")), info
    assert_reused_after_first(added)
