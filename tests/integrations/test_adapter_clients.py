"""Both adapters keep one HTTP client per model object (per event loop for async calls).

A new client per call means a new TCP connection per agent step. Counted here as client
constructions in the calling thread, against the router with fake nodes over real HTTP.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import httpx
import pytest
from fakes import Stack
from fakes.threaded import MODEL, threaded_router_stack

pytest.importorskip("langchain_core", reason="extra kvagent[langchain] not installed")


from kvagent.integrations.langchain import ChatKVAgent
from langchain_core.messages import HumanMessage


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    with threaded_router_stack(policy={"params": {"skip_prefill_max_tokens": 0}}) as st:
        yield st


@pytest.fixture
def made(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """How many httpx clients the test's own thread constructs, by class."""
    counts = {"sync": 0, "async": 0}
    me = threading.current_thread()
    for cls, key in ((httpx.Client, "sync"), (httpx.AsyncClient, "async")):
        original = cls.__init__

        def counting(self, *args, __original=original, __key=key, **kwargs):  # type: ignore[no-untyped-def]
            if threading.current_thread() is me:
                counts[__key] += 1
            __original(self, *args, **kwargs)

        monkeypatch.setattr(cls, "__init__", counting)
    return counts


def test_langchain_model_reuses_one_client(stack: Stack, made: dict[str, int]) -> None:
    llm = ChatKVAgent(model=MODEL, base_url=f"{stack.url}/v1", max_tokens=16)
    history = [HumanMessage("Tell me about the sea. " * 4)]
    history.append(llm.invoke(history))
    history.append(HumanMessage("And the mountains?"))
    streamed = list(llm.stream(history))
    assert streamed and llm.invoke("hello").content
    assert made == {"sync": 1, "async": 0}

    async def calls() -> None:
        for _ in range(3):
            assert (await llm.ainvoke("hello")).content
        assert [c async for c in llm.astream("again")]

    asyncio.run(calls())
    asyncio.run(calls())  # a new loop: its own client, no "Event loop is closed"
    assert made == {"sync": 1, "async": 2}


def test_llamaindex_llm_reuses_one_client(stack: Stack, made: dict[str, int]) -> None:
    pytest.importorskip("llama_index.core", reason="extra kvagent[llamaindex] not installed")
    from kvagent.integrations.llamaindex import KVAgentLLM
    from llama_index.core.base.llms.types import ChatMessage

    llm = KVAgentLLM(model=MODEL, base_url=f"{stack.url}/v1", max_tokens=16)
    messages = [ChatMessage(role="user", content="Tell me about the sea. " * 4)]
    messages.append(llm.chat(messages).message)
    messages.append(ChatMessage(role="user", content="And the mountains?"))
    assert list(llm.stream_chat(messages))
    assert llm.complete("hello").text
    assert made == {"sync": 1, "async": 0}

    async def calls() -> None:
        for _ in range(3):
            assert (await llm.achat(messages)).message.content
        assert [c async for c in await llm.astream_chat(messages)]

    asyncio.run(calls())
    asyncio.run(calls())
    assert made == {"sync": 1, "async": 2}


def test_your_own_client_is_used_and_not_closed(stack: Stack, made: dict[str, int]) -> None:
    with httpx.Client(timeout=30) as client:
        llm = ChatKVAgent(model=MODEL, base_url=f"{stack.url}/v1", max_tokens=8,
                          http_client=client)
        llm.invoke("one")
        llm.invoke("two")
        assert not client.is_closed
    assert made == {"sync": 1, "async": 0}  # only the test's own


def test_models_with_their_clients_still_copy_and_pickle(stack: Stack) -> None:
    import copy
    import pickle

    llm = ChatKVAgent(model=MODEL, base_url=f"{stack.url}/v1", max_tokens=8)
    llm.invoke("warm the client up")
    for twin in (copy.deepcopy(llm), pickle.loads(pickle.dumps(llm))):
        assert twin.invoke("again").content
        assert twin._sync_client() is not llm._sync_client()
