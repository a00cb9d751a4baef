"""Accumulates chat-completion chunks into one answer; the only place deltas are merged.

Text is concatenated; tool calls are keyed by their ``index`` so parallel calls whose
fragments interleave are rebuilt separately. The router's ``kvagent`` object (cache token,
reused tokens, path) is taken from the last chunk that carries it. No I/O, no clock of its
own: the caller passes timestamps, so tests are exact.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from . import protocol as proto
from ._exceptions import MalformedStream, StreamInterrupted
from ._sse import ServerSentEvent
from .events import TextDelta, ToolCallDelta
from .messages import AssistantMessage, ToolCall
from .results import RouterInfo, TurnResult, Usage

logger = logging.getLogger("kvagent")

__all__ = ["StreamAccumulator", "parse_router_info", "parse_usage"]


@dataclass(slots=True)
class _CallParts:
    id: str | None = None
    name: str | None = None
    arguments: list[str] = field(default_factory=list)


class StreamAccumulator:
    """Feed SSE events (or decoded chunks) in order; ``finish()`` returns the turn's answer."""

    def __init__(self, *, clock: Callable[[], float], started_at: float) -> None:
        self._clock = clock
        self._started_at = started_at
        self._text: list[str] = []
        self._calls: dict[int, _CallParts] = {}
        self._last_index: int | None = None
        self._usage: dict[str, Any] | None = None
        self._router: dict[str, Any] | None = None
        self.finish_reason: str | None = None
        self.response_id: str | None = None
        self.model: str | None = None
        self.done = False
        self.first_chunk_at: float | None = None
        self.first_token_at: float | None = None

    @property
    def text(self) -> str:
        """Text so far (what ``StreamInterrupted.partial_text`` reports)."""
        return "".join(self._text)

    def feed_event(self, event: ServerSentEvent) -> list[TextDelta | ToolCallDelta]:
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

    def feed_chunk(self, chunk: dict[str, Any]) -> list[TextDelta | ToolCallDelta]:
        """Merge one ``chat.completion.chunk`` object; returns the deltas it carried."""
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
        events: list[TextDelta | ToolCallDelta] = []
        for choice in chunk.get("choices") or ():
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                continue  # n > 1 is not supported: the session keeps one answer per turn
            delta = choice.get("delta") or {}
            content = delta.get("content")
            if content:
                self._text.append(content)
                events.append(TextDelta(content))
            for fragment in delta.get("tool_calls") or ():
                events.append(self._tool_fragment(fragment))
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
        if events and self.first_token_at is None:
            self.first_token_at = self._clock()
        return events

    def _tool_fragment(self, fragment: dict[str, Any]) -> ToolCallDelta:
        function = fragment.get("function") or {}
        call_id = fragment.get("id") or None
        index = fragment.get("index")
        if not isinstance(index, int):
            # Some servers omit the index: a new id starts a new call, else continue the last.
            last = self._calls.get(self._last_index) if self._last_index is not None else None
            if last is None or (call_id and last.id and call_id != last.id):
                index = len(self._calls)
            else:
                index = self._last_index
        parts = self._calls.get(index)
        if parts is None:
            parts = self._calls[index] = _CallParts()
        self._last_index = index
        if call_id and not parts.id:
            parts.id = call_id
        name = function.get("name") or None
        if name and not parts.name:
            parts.name = name
        arguments = function.get("arguments") or ""
        if not isinstance(arguments, str):  # a few servers send an object
            arguments = json.dumps(arguments, separators=(",", ":"))
        if arguments:
            parts.arguments.append(arguments)
        return ToolCallDelta(index=index, id=call_id, name=name, arguments=arguments)

    def finish(self, *, now: datetime) -> TurnResult:
        """The completed answer; raises ``StreamInterrupted`` if ``[DONE]`` never came."""
        if not self.done:
            raise StreamInterrupted("the stream ended before [DONE]; the answer is incomplete",
                                    partial_text=self.text)
        finished_at = self._clock()
        calls = tuple(
            ToolCall(id=parts.id or f"call_{uuid.uuid4().hex[:24]}", name=parts.name or "",
                     arguments="".join(parts.arguments) or "{}")
            for _, parts in sorted(self._calls.items())
        )
        router = parse_router_info(self._router)
        token = router.cache_token if router else None
        if token is not None and not proto.valid_cache_token(token):
            logger.warning("ignoring a malformed cache token (%d chars)", len(token))
            token = None
        expires_at = None
        if token and router and router.expires_in is not None:
            expires_at = now + timedelta(seconds=router.expires_in)
        text = self.text
        message = AssistantMessage(
            content=text if text or not calls else None, tool_calls=calls, cache_token=token,
            cache_token_expires_at=expires_at, finish_reason=self.finish_reason,
        )
        return TurnResult(
            message=message, text=text, tool_calls=calls, finish_reason=self.finish_reason,
            usage=parse_usage(self._usage), response_id=self.response_id, model=self.model,
            time_to_first_chunk=_since(self._started_at, self.first_chunk_at),
            time_to_first_token=_since(self._started_at, self.first_token_at),
            duration=finished_at - self._started_at, cache_token_received=token is not None,
            reused_tokens=router.reused_tokens if router else None,
            path=router.path if router else None, router=router,
        )


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
