"""Accumulates chat-completion chunks into one answer; the only place deltas are merged.

Text is concatenated; tool calls are keyed by their ``index`` so parallel calls whose
fragments interleave are rebuilt separately. The router's ``kvagent`` object (cache token,
reused tokens, path) is taken from the last chunk that carries it. No I/O, no clock of its
own: the caller passes timestamps, so tests are exact.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from . import protocol as proto
from ._exceptions import MalformedStream, StreamInterrupted
from ._logs import logger
from ._sse import ServerSentEvent
from .events import ReasoningDelta, TextDelta, ToolCallDelta
from .messages import AssistantMessage, ToolCall
from .results import Choice, RouterInfo, TokenLogprob, TurnResult, Usage

StreamDelta = TextDelta | ReasoningDelta | ToolCallDelta


__all__ = ["StreamAccumulator", "parse_router_info", "parse_usage"]


@dataclass(slots=True)
class _CallParts:
    id: str | None = None
    name: str | None = None
    arguments: list[str] = field(default_factory=list)


@dataclass(slots=True)
class _ChoiceParts:
    """Everything one choice's deltas carried so far."""

    text: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    calls: dict[int, _CallParts] = field(default_factory=dict)
    last_index: int | None = None
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None

    def tool_calls(self) -> tuple[ToolCall, ...]:
        return tuple(
            ToolCall(id=parts.id or f"call_{uuid.uuid4().hex[:24]}", name=parts.name or "",
                     arguments="".join(parts.arguments) or "{}")
            for _, parts in sorted(self.calls.items())
        )


class StreamAccumulator:
    """Feed SSE events (or decoded chunks) in order; ``finish()`` returns the turn's answer.

    Choice 0 is the answer (its deltas are returned as events); other choices (``n`` > 1)
    are accumulated quietly and exposed on ``TurnResult.choices``.
    """

    def __init__(self, *, clock: Callable[[], float], started_at: float) -> None:
        self._clock = clock
        self._started_at = started_at
        self._choices: dict[int, _ChoiceParts] = {0: _ChoiceParts()}
        self._first = self._choices[0]
        self._usage: dict[str, Any] | None = None
        self._router: dict[str, Any] | None = None
        self.response_id: str | None = None
        self.model: str | None = None
        self.done = False
        self.first_chunk_at: float | None = None
        self.first_token_at: float | None = None

    @property
    def text(self) -> str:
        """Text so far (what ``StreamInterrupted.partial_text`` reports)."""
        return "".join(self._first.text)

    @property
    def finish_reason(self) -> str | None:
        return self._first.finish_reason

    @property
    def complete(self) -> bool:
        """``[DONE]`` came, or every choice that started has finished: a server that ends
        the stream without ``[DONE]`` after ``finish_reason`` (some do) gave a whole answer."""
        return self.done or (self.first_chunk_at is not None and all(
            c.finish_reason for c in self._choices.values()))

    def feed_event(self, event: ServerSentEvent) -> list[StreamDelta]:
        """Decode one SSE event; ``[DONE]`` ends the stream."""
        data = event.data
        if data == "[DONE]":
            self.done = True
            return []
        if self.done:
            return []  # nothing after [DONE] belongs to this answer
        try:
            chunk = json.loads(data)
        except ValueError:
            raise MalformedStream(f"server sent an event that is not JSON: {data[:200]!r}",
                                  partial_text=self.text) from None
        if not isinstance(chunk, dict):
            raise MalformedStream(f"server sent a JSON event that is not an object: {data[:200]!r}",
                                  partial_text=self.text)
        return self.feed_chunk(chunk)

    def feed_chunk(self, chunk: dict[str, Any]) -> list[StreamDelta]:
        """Merge one ``chat.completion.chunk`` object; returns choice 0's deltas."""
        if self.first_chunk_at is None:
            self.first_chunk_at = self._clock()
        error = chunk.get("error")
        if error is not None:
            message = error.get("message") if isinstance(error, dict) else error
            raise StreamInterrupted(f"server reported an error mid-stream: {message}",
                                    partial_text=self.text)
        if self.response_id is None and isinstance(chunk.get("id"), str):
            self.response_id = chunk["id"]
        if self.model is None and isinstance(chunk.get("model"), str):
            self.model = chunk["model"]
        router = chunk.get(proto.BODY_FIELD)
        if isinstance(router, dict):
            self._router = router
        usage = chunk.get("usage")
        if isinstance(usage, dict):
            self._usage = usage
        events: list[StreamDelta] = []
        for choice in chunk.get("choices") or ():
            if not isinstance(choice, dict):
                continue
            index = choice.get("index", 0)
            if not isinstance(index, int):
                continue
            parts = self._choices.get(index)
            if parts is None:
                parts = self._choices[index] = _ChoiceParts()
            out = self._merge(parts, choice)
            if index == 0:
                events.extend(out)
        if events and self.first_token_at is None:
            self.first_token_at = self._clock()
        return events

    def _merge(self, parts: _ChoiceParts, choice: dict[str, Any]) -> list[StreamDelta]:
        events: list[StreamDelta] = []
        delta = choice.get("delta") or {}
        # vLLM renamed reasoning_content to reasoning and, for a while, sent both with the
        # same text: take one, never both.
        reasoning = delta.get("reasoning") or delta.get("reasoning_content")
        if isinstance(reasoning, str) and reasoning:
            parts.reasoning.append(reasoning)
            events.append(ReasoningDelta(reasoning))
        content = delta.get("content")
        if content:
            parts.text.append(content)
            events.append(TextDelta(content))
        for fragment in delta.get("tool_calls") or ():
            events.append(self._tool_fragment(parts, fragment))
        logprobs = choice.get("logprobs")
        if isinstance(logprobs, dict) and isinstance(logprobs.get("content"), list):
            if parts.logprobs is None:
                parts.logprobs = []
            parts.logprobs.extend(_token_logprob(item) for item in logprobs["content"]
                                  if isinstance(item, dict))
        if choice.get("finish_reason"):
            parts.finish_reason = choice["finish_reason"]
        return events

    @staticmethod
    def _tool_fragment(parts: _ChoiceParts, fragment: dict[str, Any]) -> ToolCallDelta:
        function = fragment.get("function") or {}
        call_id = fragment.get("id") or None
        index = fragment.get("index")
        if not isinstance(index, int):
            # Some servers omit the index: a new id starts a new call, else continue the last.
            last = parts.calls.get(parts.last_index) if parts.last_index is not None else None
            if last is None or (call_id and last.id and call_id != last.id):
                index = len(parts.calls)
            else:
                index = parts.last_index
        call = parts.calls.get(index)
        if call is None:
            call = parts.calls[index] = _CallParts()
        parts.last_index = index
        if call_id and not call.id:
            call.id = call_id
        name = function.get("name") or None
        if name and not call.name:
            call.name = name
        arguments = function.get("arguments") or ""
        if not isinstance(arguments, str):  # a few servers send an object
            arguments = json.dumps(arguments, separators=(",", ":"))
        if arguments:
            call.arguments.append(arguments)
        return ToolCallDelta(index=index, id=call_id, name=name, arguments=arguments)

    def finish(self, *, now: datetime) -> TurnResult:
        """The completed answer; raises ``StreamInterrupted`` if the stream ended early
        (neither ``[DONE]`` nor a ``finish_reason`` on every choice)."""
        if not self.complete:
            raise StreamInterrupted("the stream ended before [DONE] or a finish_reason; "
                                    "the answer is incomplete", partial_text=self.text)
        finished_at = self._clock()
        choices = tuple(
            Choice(index=index, text="".join(parts.text),
                   reasoning="".join(parts.reasoning) or None, tool_calls=parts.tool_calls(),
                   finish_reason=parts.finish_reason,
                   logprobs=None if parts.logprobs is None else tuple(parts.logprobs))
            for index, parts in sorted(self._choices.items())
        )
        first = choices[0]
        calls = first.tool_calls
        router = parse_router_info(self._router)
        token = router.cache_token if router else None
        if token is not None and not proto.valid_cache_token(token):
            logger.warning("ignoring a malformed cache token (%d chars)", len(token))
            token = None
        expires_at = None
        if token and router and router.expires_in is not None:
            expires_at = now + timedelta(seconds=router.expires_in)
        text = first.text
        message = AssistantMessage(
            content=text if text or not calls else None, tool_calls=calls, cache_token=token,
            cache_token_expires_at=expires_at, finish_reason=first.finish_reason,
            reasoning=first.reasoning,
        )
        return TurnResult(
            message=message, text=text, tool_calls=calls, finish_reason=first.finish_reason,
            usage=parse_usage(self._usage), response_id=self.response_id, model=self.model,
            time_to_first_chunk=_since(self._started_at, self.first_chunk_at),
            time_to_first_token=_since(self._started_at, self.first_token_at),
            duration=finished_at - self._started_at, cache_token_received=token is not None,
            reused_tokens=router.reused_tokens if router else None,
            path=router.path if router else None, router=router,
            reasoning=first.reasoning, logprobs=first.logprobs, choices=choices,
        )


def _token_logprob(raw: dict[str, Any]) -> TokenLogprob:
    try:
        return TokenLogprob.model_validate(raw)
    except ValueError:  # a server's odd entry must not cost the answer
        return TokenLogprob(token=str(raw.get("token", "")), logprob=float("nan"))


def _since(start: float, at: float | None) -> float | None:
    return None if at is None else at - start


def parse_usage(raw: dict[str, Any] | None) -> Usage | None:
    """OpenAI ``usage`` (with ``prompt_tokens_details.cached_tokens``), read leniently."""
    if not raw:
        return None
    details = raw.get("prompt_tokens_details") or {}
    return Usage(
        prompt_tokens=raw.get("prompt_tokens") or 0,
        completion_tokens=raw.get("completion_tokens") or 0,
        total_tokens=raw.get("total_tokens") or 0,
        cached_tokens=(details.get("cached_tokens") if isinstance(details, dict) else 0) or 0,
    )


def parse_router_info(raw: dict[str, Any] | None) -> RouterInfo | None:
    """The router's ``kvagent`` object; a malformed one is ignored, never fatal."""
    if raw is None:
        return None
    try:
        return RouterInfo.model_validate(raw)
    except ValueError:
        logger.warning("ignoring a malformed %r object in the stream", proto.BODY_FIELD)
        return None
