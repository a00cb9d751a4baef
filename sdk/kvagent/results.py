"""What a turn returns: the answer, its usage and timing, and what the router said about reuse."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, PrivateAttr

from .messages import AssistantMessage, ToolCall, ToolResultMessage

__all__ = ["Choice", "RouterInfo", "RunResult", "TokenLogprob", "TopLogprob", "TurnResult",
           "Usage"]


class TopLogprob(BaseModel):
    """One alternative token at a position (OpenAI ``top_logprobs`` entry)."""

    model_config = ConfigDict(frozen=True, extra="allow")

    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    """A generated token with its log probability and the alternatives asked for."""

    top_logprobs: tuple[TopLogprob, ...] = ()


class Choice(BaseModel):
    """One of the ``n`` answers the server generated; the session keeps choice 0."""

    model_config = ConfigDict(frozen=True)

    index: int
    text: str = ""
    reasoning: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()
    finish_reason: str | None = None
    #: Per-token log probabilities, when the request asked for ``logprobs``.
    logprobs: tuple[TokenLogprob, ...] | None = None


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
    #: The model's reasoning for this answer (reasoning models), also on ``message``.
    reasoning: str | None = None
    #: Per-token log probabilities of the answer, when the turn asked for ``logprobs``.
    logprobs: tuple[TokenLogprob, ...] | None = None
    #: Every choice the server sent (more than one only with ``n`` > 1); ``choices[0]`` is
    #: the answer above, the one added to the history.
    choices: tuple[Choice, ...] = ()
    #: The HTTP response's headers (lower-case names) and its request id, when it had one.
    headers: dict[str, str] = {}
    request_id: str | None = None
    _format: Any = PrivateAttr(default=None)
    _parsed: Any = PrivateAttr(default=None)

    @property
    def parsed(self) -> Any:
        """The answer validated into the turn's ``response_format`` pydantic model.

        Raises pydantic's ``ValidationError`` when the text does not fit the model (for
        example a ``finish_reason`` of ``"length"`` cut the JSON), ``ValueError`` when the
        turn asked for no model.
        """
        if self._parsed is None:
            if self._format is None:
                raise ValueError("this turn had no response_format model to parse into")
            self._parsed = self._format.model_validate_json(self.text)
        return self._parsed


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
