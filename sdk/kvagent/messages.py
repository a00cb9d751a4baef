"""The neutral data model of a conversation: what was said, by whom, with which tool calls.

Messages are frozen so a history prefix cannot change under the session's feet: KV reuse
depends on every earlier message being sent byte-for-byte the same on the next turn. The
mapping to OpenAI's wire format lives in ``_wire.py``.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter


class _Message(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class SystemMessage(_Message):
    """Instructions that open the conversation."""

    role: Literal["system"] = "system"
    content: str


class UserMessage(_Message):
    """A user turn."""

    role: Literal["user"] = "user"
    content: str


class ToolCall(_Message):
    """One function call the model asked for; ``arguments`` is the JSON text it produced.

    The raw text is kept (not re-serialised) so the call goes back to the server exactly as
    the model wrote it.
    """

    id: str
    name: str
    arguments: str = "{}"

    def parsed_arguments(self) -> Any:
        """``arguments`` decoded as JSON (raises ``ValueError`` when the model wrote junk)."""
        return json.loads(self.arguments or "{}")


class AssistantMessage(_Message):
    """A model answer: text, tool calls, or both, plus the cache token it came with."""

    role: Literal["assistant"] = "assistant"
    content: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()
    #: The router's cache-location token for the KV of everything up to this message.
    cache_token: str | None = None
    #: Wall-clock time after which the router no longer honours ``cache_token``.
    cache_token_expires_at: datetime | None = None
    finish_reason: str | None = None


class ToolResultMessage(_Message):
    """What a tool returned (or the error it raised), answering one ``ToolCall``."""

    role: Literal["tool"] = "tool"
    tool_call_id: str
    content: str
    name: str | None = None
    is_error: bool = False


Message = Annotated[
    SystemMessage | UserMessage | AssistantMessage | ToolResultMessage,
    Field(discriminator="role"),
]

#: Validates/dumps a list of messages (used by persistence).
MessageList: TypeAdapter[list[Message]] = TypeAdapter(list[Message])

__all__ = [
    "AssistantMessage",
    "Message",
    "MessageList",
    "SystemMessage",
    "ToolCall",
    "ToolResultMessage",
    "UserMessage",
]
