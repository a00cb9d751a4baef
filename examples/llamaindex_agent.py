"""A LlamaIndex ``FunctionAgent`` on ``KVAgentLLM``, over two user turns.

The agent keeps the conversation in its memory and resends it on every LLM call. Each
assistant message carries the router's cache token in ``additional_kwargs["kvagent"]``, and
memory keeps it, so every call after the first reuses the KV cache.

    pip install 'kvagent[llamaindex]'
    kvagent-server up                  # in another shell
    python examples/llamaindex_agent.py
"""

# No `from __future__ import annotations`: LlamaIndex builds the tool schema from the
# function's evaluated annotations (a string "Literal[...]" would not resolve).

import asyncio
import os
from typing import Any, Literal

from kvagent.integrations.llamaindex import KVAgentLLM
from llama_index.core.agent.workflow import FunctionAgent
from llama_index.core.llms import ChatMessage
from llama_index.core.memory import ChatMemoryBuffer
from llama_index.core.tools import FunctionTool

BASE_URL = os.environ.get("KVAGENT_BASE_URL", "http://127.0.0.1:8000/v1")
MODEL = os.environ.get("KVAGENT_MODEL", "kvagent-demo")

SYSTEM = ("You are a lab assistant. Use the thermometer tool before answering questions "
          "about a room, then answer in one sentence.")


def thermometer(room: Literal["lab", "office", "cellar"]) -> str:
    """The current temperature of a room."""
    return {"lab": "21.5 °C", "office": "23.0 °C", "cellar": "12.0 °C"}[room]


def assistant_messages(memory: ChatMemoryBuffer) -> list[ChatMessage]:
    return [m for m in memory.get_all() if m.role == "assistant"]


async def amain(base_url: str = BASE_URL, model: str = MODEL) -> list[dict[str, Any]]:
    """Two questions to one agent; returns the router's ``kvagent`` record of every LLM
    answer (session, reused tokens, path), in order."""
    llm = KVAgentLLM(base_url=base_url, model=model, max_tokens=48, temperature=0.0)
    agent = FunctionAgent(
        tools=[FunctionTool.from_defaults(thermometer)], llm=llm, system_prompt=SYSTEM,
        # The demo model (random weights) only emits valid calls when forced: force the
        # first call after each user message. With a real model, leave this out.
        initial_tool_choice="required", allow_parallel_tool_calls=False,
    )
    # One memory for the whole conversation: the agent resends it, tokens included.
    memory = ChatMemoryBuffer.from_defaults(token_limit=12000)
    for question in ["How warm is the lab?", "And the cellar?"]:
        answer = await agent.run(question, memory=memory)
        print(f"user: {question}\nagent: {str(answer)[:60]!r}")
    records = [m.additional_kwargs["kvagent"] for m in assistant_messages(memory)]
    for n, record in enumerate(records, 1):
        print(f"LLM call {n}: reused={record['reused_tokens']} path={record['path']}")
    return records


def main(base_url: str = BASE_URL, model: str = MODEL) -> list[dict[str, Any]]:
    return asyncio.run(amain(base_url, model))


if __name__ == "__main__":
    main()
