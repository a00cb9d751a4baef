"""The public surface is exactly what ``kvagent/__init__.py`` intends to export."""

from __future__ import annotations

import kvagent

EXPECTED = {
    # sessions and streams
    "Session", "AsyncSession", "TurnStream", "AsyncTurnStream", "RetryPolicy",
    # tools
    "Tool", "tool",
    # messages
    "Message", "SystemMessage", "UserMessage", "AssistantMessage", "ToolCall",
    "ToolResultMessage",
    # content parts of user messages
    "ContentPart", "TextPart", "ImagePart", "ImageURL", "AudioPart", "InputAudio", "FilePart",
    "FileData",
    # results and events
    "TurnResult", "RunResult", "Usage", "RouterInfo", "Choice", "TokenLogprob", "TopLogprob",
    "StreamEvent", "TextDelta", "ReasoningDelta", "ToolCallDelta", "Done",
    # errors
    "KVAgentError", "APIError", "APIConnectionError", "APITimeoutError", "APIStatusError",
    "BadRequestError", "AuthenticationError", "PermissionDeniedError", "NotFoundError",
    "ConflictError", "UnprocessableEntityError", "RateLimitError", "InternalServerError",
    "StreamError", "StreamInterrupted", "MalformedStream", "ToolError", "ToolSchemaError",
    "__version__",
}


def test_exported_names_are_exactly_the_intended_ones() -> None:
    assert set(kvagent.__all__) == EXPECTED
    assert len(kvagent.__all__) == len(EXPECTED)  # no duplicates
    for name in kvagent.__all__:
        assert hasattr(kvagent, name), name


def test_error_hierarchy_matches_the_docstring() -> None:
    k = kvagent
    assert issubclass(k.APITimeoutError, k.APIConnectionError)
    assert issubclass(k.APIConnectionError, k.APIError)
    for cls in (k.BadRequestError, k.AuthenticationError, k.PermissionDeniedError,
                k.NotFoundError, k.ConflictError, k.UnprocessableEntityError,
                k.RateLimitError, k.InternalServerError):
        assert issubclass(cls, k.APIStatusError) and cls.__name__ in k._exceptions.__doc__
    assert issubclass(k.APIStatusError, k.APIError) and issubclass(k.APIError, k.KVAgentError)
    assert issubclass(k.StreamInterrupted, k.StreamError)
    assert issubclass(k.MalformedStream, k.StreamError)
    assert issubclass(k.StreamError, k.KVAgentError)
    assert issubclass(k.ToolSchemaError, k.ToolError) and issubclass(k.ToolError, k.KVAgentError)
