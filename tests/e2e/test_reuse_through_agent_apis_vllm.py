"""The agent APIs on real vLLM: greedy output with reuse equals stock vLLM's, every turn.

Messages and Responses requests go to the router (which translates them to chat and
reuses D's KV) and, as the reference, to the prefill node's own `/v1/messages` and
`/v1/responses` (stock vLLM, its own translation, nothing reused from D). Chat clients
that send no conversation id at all reuse by content; the prompt changes agents really
make between turns (a changed system prompt, reordered tools, an edited answer, a
compaction) must recompute from the first differing token, never reuse wrong KV.

Its name sorts after the other e2e modules on purpose: it leaves retained turns on D, and
`test_conversation_vllm` opens with a test that needs D idle.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import httpx
import pytest

from .e2e_helpers import ALPHA_KEY, E2E

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

SYSTEM = ("You are a coding agent working in a repository. Read files before editing, run "
          "the tests after every change, and answer in one short sentence. ") * 8
#: Bounded arguments: a random-weight model made to call a tool writes a whole call.
FILE_ENUM = ["src/app.py", "tests/test_app.py", "README.md"]
ANTHROPIC_TOOLS = [
    {"name": "read_file", "description": "Read a file of the repository.",
     "input_schema": {"type": "object", "properties": {"path": {"type": "string",
                                                                "enum": FILE_ENUM}},
                      "required": ["path"]}},
    {"name": "run_tests", "description": "Run the test suite.",
     "input_schema": {"type": "object", "properties": {"verbose": {"type": "boolean"}},
                      "required": ["verbose"]}},
]
CHAT_TOOLS = [{"type": "function", "function": {"name": t["name"],
                                                "description": t["description"],
                                                "parameters": t["input_schema"]}}
              for t in ANTHROPIC_TOOLS]
RESPONSES_TOOLS = [{"type": "function", "name": t["name"], "description": t["description"],
                    "parameters": t["input_schema"]} for t in ANTHROPIC_TOOLS]
FILE_TEXT = "def main():\n    return compute(42)\n" * 20


def post(url: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> Any:
    r = httpx.post(url, json=body, headers=headers or {}, timeout=600)
    assert r.status_code == 200, r.text
    return r.json()


def alpha(extra: dict[str, str] | None = None) -> dict[str, str]:
    return {"Authorization": f"Bearer {ALPHA_KEY}", **(extra or {})}


# ------------------------------------------------------------------ Anthropic Messages


def blocks(message: dict[str, Any]) -> list[tuple[str, Any]]:
    """What greedy decoding produced, block by block."""
    out: list[tuple[str, Any]] = []
    for b in message["content"]:
        if b["type"] == "text":
            out.append(("text", b["text"]))
        elif b["type"] == "tool_use":
            out.append(("tool_use", (b["name"], json.dumps(b["input"], sort_keys=True))))
    return out


def billing_block() -> dict[str, Any]:
    """Claude Code's first system block: its `cch` changes on every request."""
    return {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.90.abc; "
            f"cc_entrypoint=cli; cch={uuid.uuid4().hex[:5]};"}


@pytest.mark.parametrize("identity", ["claude_code", "none"])
def test_messages_turns_equal_stock_vllm_and_reuse(e2e: E2E, identity: str) -> None:
    headers = alpha({"X-Claude-Code-Session-Id": str(uuid.uuid4())}
                    if identity == "claude_code" else {})
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Open src/app.py first."}]
    plan = [{"tool_choice": {"type": "any"}, "max_tokens": 48},
            {"tool_choice": {"type": "none"}, "max_tokens": 16},
            {"max_tokens": 16}]
    reused = []
    for i, opts in enumerate(plan):
        body = {"model": e2e.model, "system": [billing_block(), {"type": "text",
                                                                 "text": SYSTEM}],
                "messages": messages, "tools": ANTHROPIC_TOOLS, "temperature": 0.0, **opts}
        got = post(f"{e2e.router_url}/v1/messages", body, headers)
        ref = post(f"{e2e.prefill_url}/v1/messages", body)
        assert blocks(got) == blocks(ref), f"turn {i}"
        assert got["stop_reason"] == ref["stop_reason"]
        reused.append(got["kvagent"]["reused_tokens"])
        # The usage counts the nodes' own prefix-cache hits too (the shared system prompt).
        assert (got["usage"].get("cache_read_input_tokens") or 0) >= reused[-1]
        messages.append({"role": "assistant", "content": got["content"]})
        calls = [b for b in got["content"] if b["type"] == "tool_use"]
        if calls:
            messages.append({"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": c["id"], "content": FILE_TEXT}
                for c in calls]})
        else:
            messages.append({"role": "user", "content": "Now run the tests."})
    assert all(n > 0 for n in reused[1:]), reused  # every later turn reused D's KV


def test_messages_stream_equals_the_whole_answer(e2e: E2E) -> None:
    body = {"model": e2e.model, "system": SYSTEM, "max_tokens": 16, "temperature": 0.0,
            "messages": [{"role": "user", "content": "Say what the repository does."}]}
    whole = post(f"{e2e.router_url}/v1/messages", body, alpha())
    text, events = [], []
    with httpx.stream("POST", f"{e2e.router_url}/v1/messages", json={**body, "stream": True},
                      headers=alpha(), timeout=600) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("event: "):
                events.append(line[7:])
            elif line.startswith("data: "):
                data = json.loads(line[6:])
                if data.get("type") == "content_block_delta":
                    text.append(data["delta"].get("text", ""))
    assert events[0] == "message_start" and events[-1] == "message_stop"
    assert "".join(text) == whole["content"][0]["text"]


# ------------------------------------------------------------------ OpenAI Responses


def items(response: dict[str, Any]) -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    for item in response["output"]:
        if item["type"] == "message":
            out.append(("message", "".join(c.get("text", "") for c in item["content"])))
        elif item["type"] == "function_call":
            out.append(("function_call", (item["name"], item["arguments"])))
    return out


def test_responses_chained_turns_equal_stock_vllm_and_reuse(e2e: E2E) -> None:
    """The router chains by `previous_response_id` (its own store); stock vLLM gets what
    a client that keeps the history itself sends: every earlier item again."""
    base = {"model": e2e.model, "instructions": SYSTEM, "tools": RESPONSES_TOOLS,
            "temperature": 0.0}
    full: list[dict[str, Any]] = []
    previous = None
    plan: list[tuple[list[dict[str, Any]], dict[str, Any]]] = [
        ([{"role": "user", "content": "Open src/app.py first."}],
         {"tool_choice": "required", "max_output_tokens": 48}),
        ([], {"tool_choice": "none", "max_output_tokens": 16}),
        ([{"role": "user", "content": "Now run the tests."}], {"max_output_tokens": 16}),
    ]
    cached = []
    for i, (new, opts) in enumerate(plan):
        if not new:  # the model asked for no tool: the user speaks instead
            new.append({"role": "user", "content": "Continue."})
        got = post(f"{e2e.router_url}/v1/responses",
                   {**base, **opts, "input": new, "previous_response_id": previous}
                   if previous else {**base, **opts, "input": new}, alpha())
        ref = post(f"{e2e.prefill_url}/v1/responses",
                   {**base, **opts, "input": [*full, *new], "store": False})
        assert items(got) == items(ref), f"turn {i}"
        cached.append(got["kvagent"]["reused_tokens"])
        assert got["usage"]["input_tokens_details"]["cached_tokens"] >= cached[-1]
        full += [*new, *[o for o in got["output"] if o["type"] in ("message",
                                                                    "function_call")]]
        calls = [o for o in got["output"] if o["type"] == "function_call"]
        if i + 1 < len(plan) and calls:
            plan[i + 1][0].extend({"type": "function_call_output", "call_id": c["call_id"],
                                   "output": FILE_TEXT} for c in calls)
        previous = got["id"]
    assert all(n > 0 for n in cached[1:]), cached  # every later turn reused D's KV


def test_a_turn_chained_onto_another_s_response_branches(e2e: E2E) -> None:
    """An intruder chains onto the owner's first response after the owner has moved on:
    it gets its own branch, and the owner's next turn still reuses its latest handle, with
    stock vLLM's greedy answer."""
    base = {"model": e2e.model, "instructions": SYSTEM, "temperature": 0.0,
            "max_output_tokens": 8}
    one = post(f"{e2e.router_url}/v1/responses",
               {**base, "input": "Describe the repository layout."}, alpha())
    two_input = [{"role": "user", "content": "Now list its tests, one by one, with what each "
                  "of them checks and which module it imports. " * 4}]
    two = post(f"{e2e.router_url}/v1/responses",
               {**base, "input": two_input, "previous_response_id": one["id"]}, alpha())
    assert two["kvagent"]["reused_tokens"] > 0
    intruder = post(f"{e2e.router_url}/v1/responses",
                    {**base, "input": "Something else: write a poem.",
                     "previous_response_id": one["id"]}, alpha())
    assert intruder["status"] in ("completed", "incomplete")
    three_input = [{"role": "user", "content": "And the README?"}]
    three = post(f"{e2e.router_url}/v1/responses",
                 {**base, "input": three_input, "previous_response_id": two["id"]}, alpha())
    # More than the intruder's handle could give it (turn 1 and its answer): the owner's
    # own latest handle, turn 2 and its answer.
    turn_one = one["usage"]["input_tokens"] + one["usage"]["output_tokens"]
    assert three["kvagent"]["reused_tokens"] > turn_one, (three["kvagent"], turn_one)
    full = [{"role": "user", "content": "Describe the repository layout."},
            *[o for o in one["output"] if o["type"] == "message"], *two_input,
            *[o for o in two["output"] if o["type"] == "message"], *three_input]
    ref = post(f"{e2e.prefill_url}/v1/responses", {**base, "input": full, "store": False})
    assert items(three) == items(ref)


# ------------------------------------------------------------------ chat without identity


def chat_reference(e2e: E2E, body: dict[str, Any]) -> dict[str, Any]:
    """The same request on P directly under a fresh cache salt: nothing reused at all."""
    ref = post(f"{e2e.prefill_url}/v1/chat/completions",
               {**body, "cache_salt": uuid.uuid4().hex})
    details = ref["usage"].get("prompt_tokens_details") or {}
    assert not details.get("cached_tokens"), details
    return ref


def chat_answer(out: dict[str, Any]) -> tuple[Any, ...]:
    msg = out["choices"][0]["message"]
    return msg.get("content"), tuple((c["function"]["name"], c["function"]["arguments"])
                                     for c in msg.get("tool_calls") or ())


def chat_turn(e2e: E2E, messages: list[dict[str, Any]], tools: list[dict[str, Any]],
              **opts: Any) -> dict[str, Any]:
    body = {"model": e2e.model, "messages": messages, "tools": tools, "temperature": 0.0,
            "max_tokens": 16, **opts}
    got = post(f"{e2e.router_url}/v1/chat/completions", body, alpha())
    assert chat_answer(got) == chat_answer(chat_reference(e2e, body))
    return got


@pytest.mark.parametrize("change", ["none", "system", "tool_order", "edited_answer",
                                    "reasoning_dropped", "compaction"])
def test_no_identity_reuses_only_what_is_verified(e2e: E2E, change: str) -> None:
    """A client that sends no id at all (as LangGraph does) reuses by content; whatever an
    agent changes between turns is recomputed from the first differing token."""
    topic = uuid.uuid4().hex[:8]  # this conversation's own tokens
    earlier = [{"role": "user", "content": f"Task {topic}: is the repository clean?"},
               {"role": "assistant", "content": "It is clean.",
                "reasoning_content": "The status showed no changes, so it is clean."}]
    messages = [{"role": "system", "content": SYSTEM}, *earlier,
                {"role": "user", "content": f"Task {topic}: explain src/app.py."}]
    first = chat_turn(e2e, messages, CHAT_TOOLS)
    answer = first["choices"][0]["message"]["content"] or ""
    tools = CHAT_TOOLS
    history = [*messages, {"role": "assistant", "content": answer}]
    if change == "system":
        history[0] = {"role": "system", "content": "You are terse. " + SYSTEM}
    elif change == "tool_order":
        tools = list(reversed(CHAT_TOOLS))
    elif change == "reasoning_dropped":  # as clients that strip reasoning from history do
        history[2] = {"role": "assistant", "content": "It is clean."}
    elif change == "edited_answer":
        history[-1] = {"role": "assistant", "content": answer[: len(answer) // 2] + " (edited)"}
    elif change == "compaction":
        history = [history[0], {"role": "user", "content": f"Summary of task {topic}: the "
                                "user asked about src/app.py; it was explained."}]
    second = chat_turn(e2e, [*history, {"role": "user", "content": "And the tests?"}], tools)
    reused = second["kvagent"]["reused_tokens"]
    if change == "none":
        assert reused > 0 and second["kvagent"]["path"] in ("pd_reuse", "d_direct")
    elif change == "system":
        assert reused == 0  # the very first tokens differ
