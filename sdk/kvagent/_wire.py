"""Neutral messages and tools to OpenAI Chat Completions wire dicts (and nothing else).

The mapping is a pure function of each message, so the same history always produces the
same bytes: the property the router's prefix reuse depends on.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any, Literal

from .messages import AssistantMessage, Message, SystemMessage, ToolResultMessage, UserMessage
from .tools import Tool

__all__ = ["ReasoningHistory", "ToolChoice", "message_to_wire", "messages_to_wire", "tool_choice_to_wire",
           "tool_to_wire"]

#: "auto" | "none" | "required" | a declared tool (by object) | an OpenAI tool_choice dict.
ToolChoice = str | Tool | Mapping[str, Any]

#: What happens to earlier answers' reasoning: "strip" (not sent, as vLLM's reasoning-model
#: templates drop it from history anyway) or "send" (as ``reasoning``, which vLLM accepts and
#: also hands templates as ``reasoning_content``).
ReasoningHistory = Literal["strip", "send"]


def message_to_wire(message: Message, reasoning: ReasoningHistory = "strip") -> dict[str, Any]:
    """One message as OpenAI expects it; SDK-only fields (cache token, flags) stay behind."""
    if isinstance(message, AssistantMessage):
        out: dict[str, Any] = {"role": "assistant", "content": message.content}
        if reasoning == "send" and message.reasoning:
            out["reasoning"] = message.reasoning
        if message.tool_calls:
            out["tool_calls"] = [
                {"id": call.id, "type": "function",
                 "function": {"name": call.name, "arguments": _arguments(call.arguments)}}
                for call in message.tool_calls
            ]
        return out
    if isinstance(message, ToolResultMessage):
        return {"role": "tool", "tool_call_id": message.tool_call_id, "content": message.content}
    if isinstance(message, UserMessage) and not isinstance(message.content, str):
        return {"role": "user", "content": [p.model_dump(mode="json") for p in message.content]}
    if isinstance(message, SystemMessage | UserMessage):
        return {"role": message.role, "content": message.content}
    raise TypeError(f"not a kvagent message: {message!r}")


def messages_to_wire(messages: Iterable[Message], reasoning: ReasoningHistory = "strip"
                     ) -> list[dict[str, Any]]:
    return [message_to_wire(m, reasoning) for m in messages]


def _arguments(raw: str) -> str:
    """Arguments as the model wrote them; junk becomes ``{}`` because servers (vLLM) parse
    earlier tool calls when rendering the prompt and would reject the whole request."""
    try:
        return raw if isinstance(json.loads(raw), dict) else "{}"
    except ValueError:
        return "{}"


def tool_to_wire(tool: Tool) -> dict[str, Any]:
    """A declared tool as a ``tools`` entry (public as ``Tool.to_wire``, which benchmarks use)."""
    return tool.to_wire()


def tool_choice_to_wire(choice: ToolChoice) -> str | dict[str, Any]:
    """Pass strings and dicts through; a ``Tool`` becomes the named-function form."""
    if isinstance(choice, Tool):
        return {"type": "function", "function": {"name": choice.name}}
    if isinstance(choice, str):
        return choice
    return dict(choice)
