"""A LangChain tool-calling agent on ``ChatKVAgent``.

LangChain resends the whole message list on every call. ``ChatKVAgent`` puts the router's
cache token on each ``AIMessage`` it returns (``response_metadata["kvagent"]``) and sends
it again when that message is the last answer in the next call's input, so this loop, a
chain with memory or a LangGraph graph reuses the KV cache with no extra code.

    pip install 'kvagent[langchain]'
    kvagent-server up                  # in another shell
    python examples/langchain_agent.py
"""

from __future__ import annotations

import os
from typing import Literal

from kvagent.integrations.langchain import ChatKVAgent
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_core.tools import tool

BASE_URL = os.environ.get("KVAGENT_BASE_URL", "http://127.0.0.1:8000/v1")
MODEL = os.environ.get("KVAGENT_MODEL", "kvagent-demo")

SYSTEM = ("You are a support agent for a bookshop. Look orders up with the tool before "
          "answering, then reply in one short sentence.")


@tool
def order_status(order_id: Literal["A-100", "A-101", "A-102"]) -> str:
    """Status of a customer order."""
    return {"A-100": "shipped", "A-101": "packing", "A-102": "delivered"}[order_id]


TOOLS = {order_status.name: order_status}


def main(base_url: str = BASE_URL, model: str = MODEL, max_steps: int = 6) -> list[AIMessage]:
    """Answer two customer messages with tool calls; returns every AIMessage, in order."""
    llm = ChatKVAgent(base_url=base_url, model=model, max_tokens=48, temperature=0.0)
    # The demo model (random weights) only emits valid calls when forced, so the first
    # call of each question uses tool_choice="any". With a real model bind once, no choice.
    forced = llm.bind_tools(list(TOOLS.values()), tool_choice="any")
    free = llm.bind_tools(list(TOOLS.values()))
    messages: list[BaseMessage] = [SystemMessage(SYSTEM)]
    answers: list[AIMessage] = []
    for question in ["Where is my order A-101?", "And A-100?"]:
        messages.append(HumanMessage(question))
        for step in range(max_steps):
            ai = (forced if step == 0 else free).invoke(messages)
            answers.append(ai)
            messages.append(ai)
            usage = ai.usage_metadata or {}
            carried = ai.response_metadata.get("kvagent", {})
            print(f"call {len(answers)}: prompt={usage.get('input_tokens')} "
                  f"cache_read={usage.get('input_token_details', {}).get('cache_read')} "
                  f"path={carried.get('path')} tools={[c['name'] for c in ai.tool_calls]}")
            if not ai.tool_calls:
                break
            for call in ai.tool_calls:
                found = TOOLS.get(call["name"])
                output = (found.invoke(call["args"]) if found is not None
                          else f"Error: unknown tool {call['name']!r}")
                messages.append(ToolMessage(str(output), tool_call_id=call["id"]))
    return answers


if __name__ == "__main__":
    main()
