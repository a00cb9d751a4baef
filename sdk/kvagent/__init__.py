"""kvagent: a multi-turn, tool-using chat client that carries KV-cache reuse across turns.

Against a kvagent router each streamed answer brings back a cache-location token that the
next turn sends, so the server reuses the conversation's KV cache instead of recomputing it.
Against any other OpenAI-compatible server everything works the same, without reuse.
"""

from __future__ import annotations

from . import _logs
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
from .events import Done, ReasoningDelta, StreamEvent, TextDelta, ToolCallDelta
from .messages import (
    AssistantMessage,
    AudioPart,
    ContentPart,
    FileData,
    FilePart,
    ImagePart,
    ImageURL,
    InputAudio,
    Message,
    SystemMessage,
    TextPart,
    ToolCall,
    ToolResultMessage,
    UserMessage,
)
from .results import Choice, RouterInfo, RunResult, TokenLogprob, TopLogprob, TurnResult, Usage
from .session import Session, TurnStream
from .tools import Tool, tool

__version__ = "0.1.0"

_logs.setup_from_env()

__all__ = [
    "APIConnectionError",
    "APIError",
    "APIStatusError",
    "APITimeoutError",
    "AssistantMessage",
    "AsyncSession",
    "AsyncTurnStream",
    "AudioPart",
    "AuthenticationError",
    "BadRequestError",
    "Choice",
    "ConflictError",
    "ContentPart",
    "Done",
    "FileData",
    "FilePart",
    "ImagePart",
    "ImageURL",
    "InputAudio",
    "InternalServerError",
    "KVAgentError",
    "MalformedStream",
    "Message",
    "NotFoundError",
    "PermissionDeniedError",
    "RateLimitError",
    "ReasoningDelta",
    "RetryPolicy",
    "RouterInfo",
    "RunResult",
    "Session",
    "StreamError",
    "StreamEvent",
    "StreamInterrupted",
    "SystemMessage",
    "TextDelta",
    "TextPart",
    "TokenLogprob",
    "Tool",
    "ToolCall",
    "ToolCallDelta",
    "ToolError",
    "ToolResultMessage",
    "ToolSchemaError",
    "TopLogprob",
    "TurnResult",
    "TurnStream",
    "UnprocessableEntityError",
    "Usage",
    "UserMessage",
    "__version__",
    "tool",
]
