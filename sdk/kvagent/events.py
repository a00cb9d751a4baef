"""Typed events yielded by ``Session.stream()``; plain slotted dataclasses, one per delta."""

from __future__ import annotations

from dataclasses import dataclass

from .results import TurnResult

__all__ = ["Done", "ReasoningDelta", "StreamEvent", "TextDelta", "ToolCallDelta"]


@dataclass(frozen=True, slots=True)
class TextDelta:
    """A piece of the assistant's text."""

    text: str


@dataclass(frozen=True, slots=True)
class ReasoningDelta:
    """A piece of the model's reasoning (``reasoning_content``/``reasoning`` deltas)."""

    text: str


@dataclass(frozen=True, slots=True)
class ToolCallDelta:
    """A fragment of tool call ``index``: ``id``/``name`` on its first fragment, then arguments."""

    index: int
    id: str | None
    name: str | None
    arguments: str


@dataclass(frozen=True, slots=True)
class Done:
    """The stream finished; ``result`` is already in the session's history."""

    result: TurnResult


StreamEvent = TextDelta | ReasoningDelta | ToolCallDelta | Done
