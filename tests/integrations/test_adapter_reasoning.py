"""Reasoning deltas (reasoning models) pass through both adapters instead of crashing them."""

from __future__ import annotations

import pytest
from kvagent.events import ReasoningDelta, TextDelta


def test_langchain_chunk_keeps_reasoning_beside_content() -> None:
    pytest.importorskip("langchain_core", reason="extra kvagent[langchain] not installed")
    from kvagent.integrations.langchain import _chunk, _chunk_text

    first = _chunk(ReasoningDelta(text="think "), "s1")
    second = _chunk(ReasoningDelta(text="more"), "s1")
    text = _chunk(TextDelta(text="answer"), "s1")
    merged = first + second + text
    assert merged.message.content == "answer"
    assert merged.message.additional_kwargs["reasoning_content"] == "think more"
    assert _chunk_text(ReasoningDelta(text="x")) == ""


def test_llamaindex_partial_skips_reasoning_in_the_answer() -> None:
    pytest.importorskip("llama_index.core", reason="extra kvagent[llamaindex] not installed")
    from kvagent.integrations.llamaindex import _Partial

    parts = _Partial()
    r1 = parts.feed(ReasoningDelta(text="hmm"), "s1")
    r2 = parts.feed(TextDelta(text="hi"), "s1")
    assert r1.delta == "" and r1.message.content == ""
    assert r2.delta == "hi" and r2.message.content == "hi"
