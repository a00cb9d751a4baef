"""kvagent: a multi-turn, tool-using chat client that carries KV-cache reuse across turns.

Against a kvagent router each streamed answer brings back a cache-location token that the
next turn sends, so the server reuses the conversation's KV cache instead of recomputing it.
Against any other OpenAI-compatible server everything works the same, without reuse.
"""

from __future__ import annotations

from ._exceptions import (
    APIConnectionError,
    APIError,
    APIStatusError,
    APITimeoutError,
    AuthenticationError,
    BadRequestError,
    ConflictError,
    InternalServerError,
    KVAgentError,
    MalformedStream,
    NotFoundError,
    PermissionDeniedError,
    RateLimitError,
    StreamError,
    StreamInterrupted,
    ToolError,
    ToolSchemaError,
    UnprocessableEntityError,
)
from ._retry import RetryPolicy
from .async_session import AsyncSession, AsyncTurnStream
from .events import Done, StreamEvent, TextDelta, ToolCallDelta
from .messages import (
    AssistantMessage,
    Message,
    SystemMessage,
    ToolCall,
    ToolResultMessage,
    UserMessage,
)
from .results import RouterInfo, RunResult, TurnResult, Usage
from .session import Session, TurnStream
from .tools import Tool, tool

__version__ = "0.1.0"

__all__ = [
    "APIConnectionError",
    "APIError",
    "APIStatusError",
    "APITimeoutError",
    "AssistantMessage",
    "AsyncSession",
    "AsyncTurnStream",
    "AuthenticationError",
    "BadRequestError",
    "ConflictError",
    "Done",
    "InternalServerError",
    "KVAgentError",
    "MalformedStream",
    "Message",
    "NotFoundError",
    "PermissionDeniedError",
    "RateLimitError",
    "RetryPolicy",
    "RouterInfo",
    "RunResult",
    "Session",
    "StreamError",
    "StreamEvent",
    "StreamInterrupted",
    "SystemMessage",
    "TextDelta",
    "Tool",
    "ToolCall",
    "ToolCallDelta",
    "ToolError",
    "ToolResultMessage",
    "ToolSchemaError",
    "TurnResult",
    "TurnStream",
    "UnprocessableEntityError",
    "Usage",
    "UserMessage",
    "__version__",
    "tool",
]
