"""What a turn returns: the answer, its usage and timing, and what the router said about reuse."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

from .messages import AssistantMessage, ToolCall, ToolResultMessage

__all__ = ["RouterInfo", "RunResult", "TurnResult", "Usage"]


class Usage(BaseModel):
    """Token counts as the server reported them (``stream_options.include_usage``)."""

    model_config = ConfigDict(frozen=True)

    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    #: Prompt tokens not recomputed (``usage.prompt_tokens_details.cached_tokens``).
    cached_tokens: int = 0


class RouterInfo(BaseModel):
    """The top-level ``kvagent`` object of a router's final chunk; unknown fields are kept."""

    model_config = ConfigDict(frozen=True, extra="allow")

    cache_token: str | None = None
    reused_tokens: int | None = None
    expires_in: int | None = None
    path: str | None = None


class TurnResult(BaseModel):
    """One model answer, already appended to the session's history."""

    model_config = ConfigDict(frozen=True)

    message: AssistantMessage
    text: str = ""
    tool_calls: tuple[ToolCall, ...] = ()
    finish_reason: str | None = None
    usage: Usage | None = None
    response_id: str | None = None
    model: str | None = None
    #: Seconds from sending the request to the first SSE chunk / first generated text.
    time_to_first_chunk: float | None = None
    time_to_first_token: float | None = None
    duration: float = 0.0
    #: True when the server returned a cache token (a kvagent router that retained the KV).
    cache_token_received: bool = False
    #: Prompt tokens whose KV the router reused, and how it served the turn (router only).
    reused_tokens: int | None = None
    path: str | None = None
    router: RouterInfo | None = None


class RunResult(BaseModel):
    """The outcome of a tool loop: every model turn, every tool result, and why it stopped."""

    model_config = ConfigDict(frozen=True)

    steps: tuple[TurnResult, ...]
    tool_results: tuple[ToolResultMessage, ...] = ()
    stop_reason: Literal["final", "max_steps"]

    @property
    def final(self) -> TurnResult:
        """The last model turn (a final answer when ``stop_reason == "final"``)."""
        return self.steps[-1]

    @property
    def text(self) -> str:
        return self.final.text
