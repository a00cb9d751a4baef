"""The router's Anthropic Messages translation answers as vLLM's own `/v1/messages` does.

For a matrix of Messages requests, one stock vLLM node (the demo model, the bundle's
flags) answers twice: on its own `/v1/messages`, and on `/v1/chat/completions` with the
body `apis.anthropic.to_chat` builds, translated back by `message_from_chat` (whole) or
`MessageStream` (streamed). Greedy, the two must agree: the same prompt (input token
count, also from `count_tokens` against the `count_tokens_chat` body on `/tokenize`),
the same content blocks (text, tool calls' names and inputs), stop reason and usage; the
streams the same events (names, block types and indices, deltas joined per block, the
final stop reason and usage). Ids, tool call ids and thinking signatures are random on
both sides and not compared.

Before any node: the chat request vLLM builds internally from each request (its
`to_chat_completion_request`) equals the one `to_chat` builds, field for field.
"""

from __future__ import annotations

import copy
import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from kvagent_server.router.apis import sse
from kvagent_server.router.apis.anthropic import (
    MessageStream,
    count_tokens_chat,
    message_from_chat,
    to_chat,
)
from support import VLLMNode, vllm_available

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

MODEL = "kvagent-demo"  # the demo model's served name (the fixture asserts it)
TOOLS = [{"name": "get_metrics", "description": "Metrics of a service.",
          "input_schema": {"type": "object", "properties": {
              "service": {"type": "string", "enum": ["api", "db"]}},
              "required": ["service"]},
          "cache_control": {"type": "ephemeral"}},
         {"name": "restart", "description": "Restart a service.",
          "input_schema": {"properties": {"now": {"type": "boolean"}},
                           "required": ["now"]}}]
SYSTEM_BLOCKS = [
    {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.3; cch=ab12c"},
    {"type": "text", "text": "You are a terse operations assistant.",
     "cache_control": {"type": "ephemeral"}},
    {"type": "text", "text": " Answer in one line."}]
HISTORY = [
    {"role": "user", "content": "Is the api healthy?"},
    {"role": "assistant", "content": [
        {"type": "text", "text": "Let me check."},
        {"type": "tool_use", "id": "toolu_01", "name": "get_metrics",
         "input": {"service": "api"}}]},
    {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_01", "content": "p99 120ms, errors 0.1%",
         "cache_control": {"type": "ephemeral"}}]},
    {"role": "assistant", "content": [
        {"type": "tool_use", "id": "toolu_02", "name": "get_metrics",
         "input": {"service": "db"}},
        {"type": "tool_use", "id": "toolu_03", "name": "restart", "input": {"now": False}}]},
    {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_02",
         "content": [{"type": "text", "text": "p99 900ms"}, {"type": "text", "text": "slow"}]},
        {"type": "tool_result", "tool_use_id": "toolu_03", "is_error": True,
         "content": [{"type": "text", "text": "permission denied"}]},
        {"type": "text", "text": "What now?"}]},
]
GREEDY = {"temperature": 0.0}

#: (name, Messages body without "model"): sent whole and, where `STREAMED`, streamed too.
CASES: list[tuple[str, dict[str, Any]]] = [
    ("system-string", {"system": "You are terse.", "max_tokens": 12, **GREEDY,
                       "messages": [{"role": "user", "content": "Describe the weather."}]}),
    ("system-blocks-billing-metadata", {
        "system": SYSTEM_BLOCKS, "max_tokens": 12, "temperature": 0.0, "top_k": 1,
        "top_p": 0.9, "metadata": {"user_id": "user_abc_session_1"},
        "messages": [{"role": "user", "content": [
            {"type": "text", "text": "Status?", "cache_control": {"type": "ephemeral"}}]}]}),
    ("history-tools-auto", {"system": SYSTEM_BLOCKS, "tools": TOOLS, "max_tokens": 24,
                            "tool_choice": {"type": "auto"}, "messages": HISTORY, **GREEDY}),
    ("tool-choice-any", {"tools": TOOLS, "tool_choice": {"type": "any",
                                                         "disable_parallel_tool_use": True},
                         "max_tokens": 48, "messages": HISTORY[:1], **GREEDY}),
    ("tool-choice-tool", {"tools": TOOLS, "tool_choice": {"type": "tool", "name": "restart"},
                          "max_tokens": 48, "messages": HISTORY, **GREEDY}),
    ("tool-choice-none", {"tools": TOOLS, "tool_choice": {"type": "none"}, "max_tokens": 8,
                          "messages": HISTORY, **GREEDY}),
    ("inline-system-thinking-disabled", {
        "system": "You are terse.", "thinking": {"type": "disabled"}, "max_tokens": 8,
        "messages": [{"role": "user", "content": "Hi"},
                     {"role": "assistant", "content": [
                         {"type": "thinking", "thinking": "Greet back.", "signature": "sig"},
                         {"type": "text", "text": "Hello."}]},
                     {"role": "system", "content": "Reminder: be brief."},
                     {"role": "user", "content": "And now?"}], **GREEDY}),
    ("thinking-adaptive-effort", {"thinking": {"type": "adaptive"},
                                  "output_config": {"effort": "high"}, "max_tokens": 8,
                                  "messages": HISTORY[:1], **GREEDY}),
]
STREAMED = ("system-string", "history-tools-auto", "tool-choice-any", "tool-choice-tool")

#: Requests only translated (no node): what the demo model cannot serve (images), what
#: needs more tokens than a test may spend (thinking budgets), and rarer blocks.
TRANSLATED_ONLY: list[tuple[str, dict[str, Any]]] = [
    ("images", {"max_tokens": 8, "messages": [
        {"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": "iVBORw0KGgo="}},
            {"type": "image", "source": {"type": "url", "url": "https://example.com/a.jpg"}},
            {"type": "text", "text": "What is shown?"}]},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "shot",
                                           "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [
            {"type": "text", "text": "taken"},
            {"type": "image", "source": {"type": "base64", "data": "AAAA"}},
            {"type": "tool_reference", "tool_name": "get_metrics"}]}]}]}),
    ("thinking-enabled", {"max_tokens": 2048, "stream": True,
                          "thinking": {"type": "enabled", "budget_tokens": 1024},
                          "messages": HISTORY[:1]}),
    ("assistant-tool-result-and-redacted", {"max_tokens": 8, "messages": [
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": [
            {"type": "redacted_thinking", "data": "opaque"},
            {"type": "tool_result", "tool_use_id": "t", "content": [{"type": "text",
                                                                     "text": "r"}]}]},
        {"role": "user", "content": [{"type": "text", "text": ""}, {"type": "text",
                                                                    "text": "y"}]}]}),
    ("tool-changes-json-format", {
        "max_tokens": 8, "tools": [TOOLS[0], {**TOOLS[1], "defer_loading": True}],
        "output_config": {"format": {"type": "json_schema", "schema": {
            "type": "object", "properties": {"ok": {"type": "boolean"}}}}},
        "chat_template_kwargs": {"custom": 1}, "stop_sequences": ["\n\n"],
        "messages": [
            {"role": "system", "content": [
                {"type": "tool_removal", "tool": {"type": "tool_reference",
                                                  "name": "get_metrics"}},
                {"type": "tool_addition", "tool": {"type": "tool_reference",
                                                   "name": "restart"}}]},
            {"role": "user", "content": "Go."}]}),
]


def messages_body(body: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, **copy.deepcopy(body), **extra}


# --------------------------------------------------------------------------- translation


@pytest.fixture(scope="module")
def vllm_translation() -> Any:
    """vLLM's own Messages -> chat translation (a classmethod: no engine needed)."""
    if not vllm_available():
        pytest.skip("vLLM is not installed (./dev test installs the CPU engine)")
    from vllm.entrypoints.anthropic import protocol
    from vllm.entrypoints.anthropic.serving import AnthropicServingMessages
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    return protocol, AnthropicServingMessages, ChatCompletionRequest


@pytest.mark.parametrize("merge", [False, True], ids=["inline-system", "merged-system"])
@pytest.mark.parametrize(("name", "body"), CASES + TRANSLATED_ONLY,
                         ids=[n for n, _ in CASES + TRANSLATED_ONLY])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_chat_request_is_vllms(vllm_translation: Any, name: str, body: dict[str, Any],
                               merge: bool, stream: bool) -> None:
    """`to_chat` builds the chat request vLLM builds (vLLM's per-chunk usage included when
    asked for), for both outcomes of vLLM's system-ordering probe."""
    protocol, serving, chat_request = vllm_translation
    request = messages_body(body, stream=stream)
    effort = "low"  # the demo model's: its template ignores reasoning_effort
    theirs = serving.to_chat_completion_request(
        protocol.AnthropicMessagesRequest.model_validate(copy.deepcopy(request)),
        merge_inline_system=merge, disabled_thinking_effort=effort)
    ours = chat_request.model_validate(to_chat(request, merge_inline_system=merge,
                                               disabled_thinking_effort=effort,
                                               continuous_usage=True))
    skip = {"request_id"}
    if not theirs.tools:  # vLLM's own `tools: []` with "auto": no tools, which chat rejects
        skip |= {"tools", "tool_choice"}
    assert _dump(ours, skip) == _dump(theirs, skip)


def _dump(request: Any, skip: set[str]) -> dict[str, Any]:
    """The request's fields; no `stop` is chat's default `[]` (vLLM's own sets None: the
    same sampling)."""
    out = {k: v for k, v in request.model_dump().items() if k not in skip}
    out["stop"] = out["stop"] or []
    return out


@pytest.mark.parametrize(("name", "body"), CASES + TRANSLATED_ONLY,
                         ids=[n for n, _ in CASES + TRANSLATED_ONLY])
def test_count_tokens_request_is_vllms(vllm_translation: Any, name: str,
                                       body: dict[str, Any]) -> None:
    """The `/tokenize` body renders what vLLM's count_tokens renders: the same messages
    and tools, and the template kwargs its chat request would derive."""
    protocol, serving, chat_request = vllm_translation
    request = messages_body(body)
    theirs = serving.to_chat_completion_request(
        protocol.AnthropicCountTokensRequest.model_validate(copy.deepcopy(request)),
        disabled_thinking_effort="low")
    ours = count_tokens_chat(request)
    as_chat = chat_request.model_validate({k: ours[k] for k in ("model", "messages", "tools")
                                           if k in ours})
    assert as_chat.model_dump()["messages"] == theirs.model_dump()["messages"]
    assert ([t.model_dump() for t in as_chat.tools or []]
            == [t.model_dump() for t in theirs.tools or []])
    kwargs = theirs.build_chat_params(None, "auto").chat_template_kwargs
    derived = {k: kwargs[k] for k in ("reasoning_effort", "enable_thinking", "custom")
               if k in kwargs}
    assert ours.get("chat_template_kwargs", {}) == derived


# --------------------------------------------------------------------------- the node


def _post(client: httpx.Client, url: str, body: dict[str, Any]) -> dict[str, Any]:
    resp = client.post(url, json=body)
    assert resp.status_code == 200, (url, resp.status_code, resp.text[:2000])
    data: dict[str, Any] = resp.json()
    return data


def _stream(client: httpx.Client, url: str, body: dict[str, Any]) -> bytes:
    with client.stream("POST", url, json=body) as resp:
        raw = resp.read()
        assert resp.status_code == 200, (url, resp.status_code, raw[:2000])
        return raw


def named_events(raw: bytes) -> list[tuple[str, dict[str, Any]]]:
    """(event, data) of a named-event SSE stream."""
    out = []
    for block in raw.decode().split("\n\n"):
        if not block.strip():
            continue
        lines = dict(line.split(": ", 1) for line in block.split("\n"))
        out.append((lines["event"], json.loads(lines["data"])))
    return out


def blocks(message: dict[str, Any]) -> list[tuple[Any, ...]]:
    """A message's content without what is random (tool ids, signatures)."""
    return [(b["type"], b.get("text"), b.get("thinking"), b.get("name"), b.get("input"))
            for b in message["content"]]


def stream_shape(events: list[tuple[str, dict[str, Any]]]) -> list[tuple[Any, ...]]:
    """A stream's events with consecutive deltas of one block joined (chunking may differ
    between two runs) and random values left out."""
    out: list[tuple[Any, ...]] = []
    for name, data in events:
        if name == "message_start":
            out.append((name, data["message"]["usage"], data["message"]["content"]))
        elif name == "content_block_start":
            block = data["content_block"]
            out.append((name, data["index"], block["type"], block.get("name"),
                        block.get("input"), block.get("text"), block.get("thinking")))
        elif name == "content_block_delta":
            delta = data["delta"]
            kind = delta["type"]
            value = "" if kind == "signature_delta" else delta.get(
                {"text_delta": "text", "input_json_delta": "partial_json",
                 "thinking_delta": "thinking"}[kind])
            if out and out[-1][:3] == (name, data["index"], kind):
                out[-1] = (*out[-1][:3], out[-1][3] + value)
            else:
                out.append((name, data["index"], kind, value))
        elif name == "content_block_stop":
            out.append((name, data["index"]))
        elif name == "message_delta":
            out.append((name, data["delta"].get("stop_reason"),
                        data["delta"].get("stop_sequence"), data["usage"]))
        else:
            out.append((name, data))
    return out


@pytest.fixture(scope="module")
def node(vllm_node: VLLMNode) -> VLLMNode:
    assert vllm_node.model == MODEL
    return vllm_node


@pytest.fixture(scope="module")
def client() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=120) as c:
        yield c


def test_demo_model_probes(node: VLLMNode, client: httpx.Client) -> None:
    """The defaults of `to_chat` are what vLLM's probes find on the demo model: its
    template accepts a system message after the first turn (no merging), and renders
    `reasoning_effort` "none" as every effort (so vLLM disables thinking with "low")."""
    from vllm.entrypoints.anthropic.serving import AnthropicServingMessages

    template = (node.model_path / "chat_template.jinja").read_text()
    assert AnthropicServingMessages._detect_merge_inline_system(template) is False
    prompts = []
    for effort in ("none", "low", "medium", "high", "xhigh", "max"):
        prompts.append(_post(client, f"{node.root_url}/tokenize", {
            "model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
            "chat_template_kwargs": {"reasoning_effort": effort,
                                     "enable_thinking": effort != "none"}})["tokens"])
    assert all(p == prompts[0] for p in prompts)


def cache_blind(usage: dict[str, Any]) -> dict[str, Any]:
    """Usage with the prompt's cached/uncached split summed: the split says what the
    node's prefix cache held when each request came (the stock node is the suite's, and
    the second of two equal prompts hits the first's blocks), not how usage translates
    (tests/router/apis/test_anthropic.py pins the mapping)."""
    out = dict(usage)
    out["cache_read_input_tokens"] = (out.pop("cache_read_input_tokens", 0) or 0) + (
        out.pop("cache_creation_input_tokens", 0) or 0)
    return out


@pytest.mark.parametrize(("name", "body"), CASES, ids=[n for n, _ in CASES])
def test_whole_message_matches(node: VLLMNode, client: httpx.Client, name: str,
                               body: dict[str, Any]) -> None:
    request = messages_body(body)
    started = time.monotonic()
    theirs = _post(client, f"{node.root_url}/v1/messages", request)
    chat = _post(client, f"{node.root_url}/v1/chat/completions", to_chat(request))
    ours = message_from_chat(chat, model=MODEL)
    counted = _post(client, f"{node.root_url}/v1/messages/count_tokens", request)
    tokenized = _post(client, f"{node.root_url}/tokenize", count_tokens_chat(request))
    print(f"{name}: {time.monotonic() - started:.1f}s, {blocks(theirs)}")
    assert ours["usage"]["input_tokens"] == theirs["usage"]["input_tokens"]
    assert tokenized["count"] == counted["input_tokens"] == chat["usage"]["prompt_tokens"]
    assert blocks(ours) == blocks(theirs)
    assert ours.keys() - {"kvagent"} == theirs.keys()
    assert ours.get("stop_reason") == theirs.get("stop_reason")
    assert ours.get("stop_sequence") == theirs.get("stop_sequence")
    assert ours["usage"].keys() == theirs["usage"].keys()
    assert cache_blind(ours["usage"]) == cache_blind(theirs["usage"])
    assert ours["model"] == theirs["model"]
    if name.startswith("tool-choice-") and name != "tool-choice-none":
        assert theirs["stop_reason"] == "tool_use"  # the case tests what it means to


def test_stop_sequence_matches(node: VLLMNode, client: httpx.Client) -> None:
    """A stop string the greedy answer reaches: both report it as the stop sequence."""
    base = messages_body(CASES[0][1], max_tokens=24)
    text = _post(client, f"{node.root_url}/v1/messages", base)["content"][0]["text"]
    stop = next((text[i:i + 2] for i in range(3, len(text) - 1)
                 if text[i:i + 2].strip() and text[i:i + 2] not in text[:i + 1]), None)
    if stop is None:
        pytest.skip(f"no stop string to pick from the greedy answer {text!r}")
    request = {**base, "stop_sequences": ["never-in-the-answer", stop]}
    theirs = _post(client, f"{node.root_url}/v1/messages", request)
    ours = message_from_chat(_post(client, f"{node.root_url}/v1/chat/completions",
                                   to_chat(request)), model=MODEL)
    assert theirs["stop_reason"] == "stop_sequence" and theirs["stop_sequence"] == stop
    assert (ours["stop_reason"], ours["stop_sequence"], blocks(ours),
            cache_blind(ours["usage"])) == (theirs["stop_reason"], theirs["stop_sequence"],
                                            blocks(theirs), cache_blind(theirs["usage"]))


@pytest.mark.parametrize(("name", "body"), [c for c in CASES if c[0] in STREAMED],
                         ids=list(STREAMED))
def test_stream_matches(node: VLLMNode, client: httpx.Client, name: str,
                        body: dict[str, Any]) -> None:
    """The chat stream through `MessageStream` gives vLLM's event stream. With vLLM's
    per-chunk usage `message_start` carries the input tokens as vLLM's does; without it
    (the router's default) it carries zeros, and everything else is the same."""
    request = messages_body(body, stream=True)
    theirs = named_events(_stream(client, f"{node.root_url}/v1/messages", request))
    for continuous in (True, False):
        raw = _stream(client, f"{node.root_url}/v1/chat/completions",
                      to_chat(request, continuous_usage=continuous))
        stream = MessageStream(model=MODEL)
        ours = named_events(b"".join(e for c in sse.ChatEvents().feed(raw)
                                     for e in stream.feed(c)))
        expected = stream_shape(theirs)
        if not continuous:
            zero = {"input_tokens": 0, "output_tokens": 0}
            expected[0] = (expected[0][0], zero, *expected[0][2:])
        assert stream_shape(ours) == expected, name


@pytest.mark.parametrize(("name", "body"), [c for c in TRANSLATED_ONLY if c[0] != "images"],
                         ids=[n for n, _ in TRANSLATED_ONLY if n != "images"])
def test_count_tokens_matches(node: VLLMNode, client: httpx.Client, name: str,
                              body: dict[str, Any]) -> None:
    """Requests not generated here (a thinking budget needs more tokens than a test may
    spend) are still counted alike. (Images: the demo model takes none.)"""
    request = messages_body(body)
    counted = _post(client, f"{node.root_url}/v1/messages/count_tokens", request)
    tokenized = _post(client, f"{node.root_url}/tokenize", count_tokens_chat(request))
    assert tokenized["count"] == counted["input_tokens"]
