"""``KVAgentLLM`` against the real router: a ``FunctionAgent`` running a multi-turn,
tool-using task, with reuse observed on every LLM call after the first.

The demo model has random weights: it emits a valid tool call only when forced
(``tool_choice: "required"``, here via ``initial_tool_choice``); its other answers are
gibberish text, which ends the agent's turn.
"""

# No `from __future__ import annotations`: LlamaIndex builds the tool schema from the
# function's evaluated annotations (a string "Literal[...]" would not resolve).

from typing import Any, Literal

import pytest

pytest.importorskip("llama_index.core", reason="extra kvagent[llamaindex] not installed")

from kvagent.integrations.llamaindex import KVAgentLLM
from llama_index.core.agent.workflow import FunctionAgent
from llama_index.core.llms import ChatMessage
from llama_index.core.memory import ChatMemoryBuffer
from llama_index.core.tools import FunctionTool

pytestmark = pytest.mark.vllm

SYSTEM = "You are a lab assistant. Read the thermometer before you answer. " * 10
READINGS: list[str] = []


# A default, because the forced call's JSON is the random model's: the grammar keeps an
# argument it writes to the schema, but it may close the object before writing one.
def thermometer(room: Literal["lab", "office", "cellar"] = "lab") -> str:
    """The current temperature of a room."""
    READINGS.append(room)
    return {"lab": "21.5 C", "office": "23.0 C", "cellar": "12.0 C"}[room]


async def test_function_agent_multi_turn_reuses_kv(bundle: Any) -> None:
    READINGS.clear()
    llm = KVAgentLLM(base_url=bundle.base_url, model=bundle.model, max_tokens=32,
                     temperature=0.0)
    agent = FunctionAgent(tools=[FunctionTool.from_defaults(thermometer)], llm=llm,
                          system_prompt=SYSTEM, initial_tool_choice="required",
                          allow_parallel_tool_calls=False)
    memory = ChatMemoryBuffer.from_defaults(token_limit=12000)
    for question in ["How warm is the lab?", "And the cellar?", "And the office?"]:
        await agent.run(question, memory=memory)

    assert len(READINGS) >= 3, "each user turn starts with a forced tool call"
    answers = [m for m in memory.get_all() if m.role == "assistant"]
    records = [m.additional_kwargs["kvagent"] for m in answers]
    assert len(records) >= 6  # per user turn: a tool call, then an answer
    assert len({r["session_id"] for r in records}) == 1
    assert all(r["cache_token"] for r in records), records
    reused = [r["reused_tokens"] for r in records]
    assert all(n and n > 0 for n in reused[1:]), f"LLM calls after the first reused nothing: {reused}"
    assert all(r["path"] in ("pd_reuse", "d_direct") for r in records[1:]), records


async def test_chat_stream_and_complete_against_the_router(bundle: Any) -> None:
    llm = KVAgentLLM(base_url=bundle.base_url, model=bundle.model, max_tokens=12,
                     temperature=0.0)
    history = [ChatMessage(role="system", content=SYSTEM),
               ChatMessage(role="user", content="Hello")]
    first = await llm.achat(history)
    assert first.message.content and first.additional_kwargs["prompt_tokens"] > 0
    history += [first.message, ChatMessage(role="user", content="More.")]
    responses = [r for r in llm.stream_chat(history)]
    last = responses[-1]
    assert "".join(r.delta or "" for r in responses) == last.message.content
    assert last.additional_kwargs["cached_tokens"] > 0
    assert last.message.additional_kwargs["kvagent"]["path"] in ("pd_reuse", "d_direct")
    assert (await llm.acomplete("Say something.")).text
