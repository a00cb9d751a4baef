"""Every example in ``examples/`` runs against the real bundle and shows reuse.

Each example exposes ``main(base_url, model)``; these tests call it the way a user runs the
file, then check what the example claims: tools ran, and from the second request of a
conversation on, the router reused KV (``cached_tokens > 0``, path ``pd_reuse`` or
``d_direct``).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

pytestmark = pytest.mark.vllm

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
REUSED = ("pd_reuse", "d_direct")


def load_example(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"kvagent_example_{name}",
                                                  EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def assert_reused_after_first(answers: list[Any]) -> None:
    """`answers` are one conversation's TurnResults, in order."""
    assert all(a.cache_token_received for a in answers), [a.path for a in answers]
    later = answers[1:]
    assert later, "a conversation of one request shows no reuse"
    assert all(a.usage is not None and a.usage.cached_tokens > 0 for a in later), \
        [(a.path, a.usage) for a in answers]
    assert all(a.path in REUSED for a in later), [a.path for a in answers]


def test_tool_agent(bundle: Any) -> None:
    answers = load_example("tool_agent").main(bundle.base_url, bundle.model)
    assert answers[0].tool_calls, "the first step is forced to call a tool"
    assert_reused_after_first(answers)


def test_async_parallel_tools(bundle: Any) -> None:
    conversations = load_example("async_parallel_tools").main(bundle.base_url, bundle.model)
    assert len(conversations) == 2
    for answers in conversations:
        assert answers[0].tool_calls
        assert_reused_after_first(answers)


def test_persist_resume(bundle: Any, tmp_path: Path) -> None:
    before, after = load_example("persist_resume").main(bundle.base_url, bundle.model,
                                                        path=tmp_path / "s.json")
    assert (tmp_path / "s.json").is_file()
    # The first turn after loading reuses the KV kept before saving.
    assert_reused_after_first([*before, *after])


def test_langchain_agent(bundle: Any) -> None:
    pytest.importorskip("langchain_core", reason="extra kvagent[langchain] not installed")
    answers = load_example("langchain_agent").main(bundle.base_url, bundle.model)
    assert answers[0].tool_calls
    cache_read = [a.usage_metadata["input_token_details"]["cache_read"] for a in answers]
    assert all(n > 0 for n in cache_read[1:]), cache_read
    assert all(a.response_metadata["kvagent"]["path"] in REUSED for a in answers[1:])


def test_llamaindex_agent(bundle: Any) -> None:
    pytest.importorskip("llama_index.core", reason="extra kvagent[llamaindex] not installed")
    records = load_example("llamaindex_agent").main(bundle.base_url, bundle.model)
    assert len(records) >= 4
    assert all((r["reused_tokens"] or 0) > 0 for r in records[1:]), records
    assert all(r["path"] in REUSED for r in records[1:]), records


def test_openai_python(bundle: Any) -> None:
    cached = load_example("openai_python").main(bundle.base_url, bundle.model)
    assert len(cached) == 4 and all(n > 0 for n in cached[1:]), cached
