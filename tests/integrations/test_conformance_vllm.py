"""The router is indistinguishable from stock vLLM to a client that knows nothing of kvagent.

The same matrix of requests (streamed or not, `include_usage` on/off/absent, per-chunk
usage, tools, `n` > 1, logprobs, token ids, both endpoints, and requests vLLM rejects)
goes to a stock vLLM node (no KV connector, no plugin) serving the demo model with the
bundle's flags, and to the bundle's router. The answers must agree in structure, field by
field: status codes, content types, error bodies, every chunk's keys and value types, which
chunks come first and last, whether a usage chunk or `[DONE]` comes at all. Values are not
compared (ids, timings, sampled text), nor `system_fingerprint` (the nodes' configurations
differ), and the router's one addition, `kvagent`, is checked on its own: it must ride on
a chunk the client receives anyway.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from support import SUITE_MAX_MODEL_LEN, VLLMNode

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

MESSAGES = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Say something about the weather."}]
TOOLS = [{"type": "function", "function": {
    "name": "get_metrics", "description": "Metrics of a service.",
    "parameters": {"type": "object", "properties": {
        "service": {"type": "string", "enum": ["api", "db"]}}, "required": ["service"]}}}]
GREEDY = {"temperature": 0.0, "max_tokens": 8}
#: vLLM rejects `n` > 1 with greedy sampling.
SAMPLED = {"temperature": 1.0, "seed": 7, "max_tokens": 8}
TOOL_CALL = {"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False,
             "temperature": 0.0, "max_tokens": 48}
LOGPROBS = {"logprobs": True, "top_logprobs": 2}
USAGE = {"stream_options": {"include_usage": True}}
NO_USAGE = {"stream_options": {"include_usage": False}}
CONTINUOUS = {"stream_options": {"include_usage": True, "continuous_usage_stats": True}}
CONTINUOUS_ONLY = {"stream_options": {"include_usage": False, "continuous_usage_stats": True}}
#: More tokens than the nodes' context (`SUITE_MAX_MODEL_LEN`, one token a word here).
TOO_LONG = "weather " * (SUITE_MAX_MODEL_LEN + 1_000)

#: (name, endpoint, body without "model"): every request both servers answer.
CASES: list[tuple[str, str, dict[str, Any]]] = [
    ("chat-stream-usage-absent", "chat", {"stream": True, **GREEDY}),
    ("chat-stream-usage-off", "chat", {"stream": True, **NO_USAGE, **GREEDY}),
    ("chat-stream-usage-on", "chat", {"stream": True, **USAGE, **GREEDY}),
    ("chat-stream-continuous-usage", "chat", {"stream": True, **CONTINUOUS, **GREEDY}),
    ("chat-stream-continuous-without-usage", "chat",
     {"stream": True, **CONTINUOUS_ONLY, **GREEDY}),
    ("chat-whole", "chat", {**GREEDY}),
    ("chat-stream-logprobs", "chat", {"stream": True, **LOGPROBS, **GREEDY}),
    ("chat-whole-logprobs", "chat", {**LOGPROBS, **GREEDY}),
    ("chat-stream-n2", "chat", {"stream": True, "n": 2, **SAMPLED}),
    ("chat-stream-n2-usage", "chat", {"stream": True, "n": 2, **USAGE, **SAMPLED}),
    ("chat-whole-n2", "chat", {"n": 2, **SAMPLED}),
    ("err-n2-greedy", "chat", {"stream": True, "n": 2, **GREEDY}),
    ("chat-stream-tools", "chat", {"stream": True, **TOOL_CALL}),
    ("chat-stream-tools-usage", "chat", {"stream": True, **USAGE, **TOOL_CALL}),
    ("chat-whole-tools", "chat", {**TOOL_CALL}),
    ("chat-stream-token-ids", "chat", {"stream": True, "return_token_ids": True, **GREEDY}),
    ("chat-whole-token-ids", "chat", {"return_token_ids": True, **GREEDY}),
    ("text-stream-usage-absent", "text", {"stream": True, **GREEDY}),
    ("text-stream-usage-on", "text", {"stream": True, **USAGE, **GREEDY}),
    ("text-whole-logprobs", "text", {"logprobs": 2, **GREEDY}),
    ("text-stream-logprobs", "text", {"stream": True, "logprobs": 2, **GREEDY}),
    # Rejected by vLLM (the router forwards them: the P leg answers first).
    ("err-negative-temperature", "chat", {"temperature": -1.0, "max_tokens": 4}),
    ("err-negative-temperature-stream", "chat",
     {"stream": True, "temperature": -1.0, "max_tokens": 4}),
    ("err-too-long-prompt", "chat", {"max_tokens": 4, "messages": [
        {"role": "user", "content": TOO_LONG}]}),
    ("err-too-long-prompt-stream", "chat", {"stream": True, "max_tokens": 4, "messages": [
        {"role": "user", "content": TOO_LONG}]}),
    ("err-max-tokens-beyond-context", "chat", {"max_tokens": 100_000}),
    ("err-stream-options-not-streamed", "chat", {**USAGE, "max_tokens": 4}),
    ("err-unknown-model", "chat", {"model": "no-such-model", "max_tokens": 4}),
    ("err-tool-choice-without-tools", "chat", {"tool_choice": "required", "max_tokens": 4}),
    ("err-text-negative-temperature", "text", {"temperature": -1.0, "max_tokens": 4}),
    # Rejected by the router itself, before any node: the same status and body structure;
    # `type` and `param` are the router's (OpenAI's names, the field without "body.").
    ("err-router-max-tokens-type", "chat", {"max_tokens": "many"}),
    ("err-router-messages-type", "chat", {"messages": "hello", "max_tokens": 4}),
]
#: Errors the router answers itself (see above).
ROUTER_ERRORS = ("err-router-max-tokens-type", "err-router-messages-type")


@dataclass
class Answer:
    status: int
    content_type: str
    headers: set[str]
    body: Any  # the JSON object, or the list of SSE events ("[DONE]" for the end)

    @property
    def chunks(self) -> list[dict[str, Any]]:
        return [e for e in self.body if isinstance(e, dict)]


@dataclass
class Servers:
    stock: str  # root URLs
    router: str
    model: str


@pytest.fixture(scope="module")
def servers(vllm_node: VLLMNode, kvagent_bundle: Any) -> Servers:
    """The suite's stock node (`--enable-request-id-headers`: the router always sends
    `x-request-id` as vLLM does with it, so the header check below holds the router
    to it) and the shared bundle's router."""
    if not kvagent_bundle.available:
        pytest.skip(kvagent_bundle.reason)
    assert vllm_node.model == kvagent_bundle.model
    return Servers(stock=vllm_node.root_url, router=kvagent_bundle.router_url,
                   model=kvagent_bundle.model)


@pytest.fixture(scope="module")
def answers(servers: Servers) -> dict[str, tuple[Answer, Answer]]:
    """Every case's (stock, router) answers, sent once for the module."""
    out = both(servers, CASES, send)
    dump = os.environ.get("KVAGENT_CONFORMANCE_DUMP")
    if dump:  # every answer, for reading a difference whole
        with open(dump, "w") as f:
            json.dump({k: [a.__dict__ | {"headers": sorted(a.headers)} for a in v]
                       for k, v in out.items()}, f, indent=1)
    return out


def both(servers: Servers, cases: list[tuple[str, str, dict[str, Any]]],
         sender: Callable[..., Answer]) -> dict[str, tuple[Answer, Answer]]:
    """Each case's (stock, router) answers, by `sender(client, root, model, where, body)`.

    Sent a few at a time (values are not compared, so how the nodes batch them does not
    matter): the module's time is mostly waiting on the two CPU engines."""
    with httpx.Client(timeout=300) as client, ThreadPoolExecutor(max_workers=4) as pool:
        futures = {name: (pool.submit(sender, client, servers.stock, servers.model, where, body),
                          pool.submit(sender, client, servers.router, servers.model, where,
                                      body))
                   for name, where, body in cases}
        return {name: (stock.result(), router.result())
                for name, (stock, router) in futures.items()}


def send(client: httpx.Client, root: str, model: str, endpoint: str,
         body: dict[str, Any]) -> Answer:
    payload: dict[str, Any] = {"model": model, **body}
    if endpoint == "chat":
        path = "/v1/chat/completions"
        payload.setdefault("messages", MESSAGES)
    else:
        path = "/v1/completions"
        payload.setdefault("prompt", "The weather today is")
    return post(client, root + path, payload, sse_events)


def post(client: httpx.Client, url: str, payload: dict[str, Any],
         events: Callable[[str], list[Any]]) -> Answer:
    """One request's answer: JSON, or a stream's events as `events` reads them."""
    with client.stream("POST", url, json=payload) as resp:
        raw = resp.read().decode()
        content_type = resp.headers.get("content-type", "")
        parsed: Any = events(raw) if content_type.startswith("text/event-stream") else (
            json.loads(raw))
        return Answer(resp.status_code, content_type, set(resp.headers.keys()), parsed)


def sse_events(raw: str) -> list[Any]:
    """Every event's data, in order; comments must not appear (vLLM sends none here)."""
    out: list[Any] = []
    for block in raw.split("\n\n"):
        if not block.strip():
            continue
        assert block.startswith("data: ") and "\n" not in block, block
        data = block[len("data: "):]
        out.append("[DONE]" if data == "[DONE]" else json.loads(data))
    return out


# ------------------------------------------------------------------ structure


#: Keys whose presence differs by configuration only (see the module docstring).
_ASIDE = ("system_fingerprint", "kvagent")


def skeleton(value: Any, key: str = "") -> Any:
    """The structure of a JSON value: keys and value types, list lengths aside."""
    if isinstance(value, dict) and key == "top_logprobs" and all(  # text: token -> logprob
            v is None or isinstance(v, int | float) for v in value.values()):
        return {"<token>": sorted({skeleton(v) for v in value.values()})}
    if isinstance(value, dict):
        return {k: skeleton(v, k) for k, v in sorted(value.items()) if k not in _ASIDE}
    if isinstance(value, list):
        return sorted({json.dumps(skeleton(v, key), sort_keys=True) for v in value})
    return "null" if value is None else type(value).__name__


def _is_middle(chunk: dict[str, Any]) -> bool:
    """A chunk with choices that opens none (no `role`), finishes none and carries no
    usage: the kind vLLM merges into its neighbours when the reader lags."""
    choices = chunk.get("choices") or []
    return bool(choices) and chunk.get("usage") is None and not any(
        ch.get("finish_reason") or "role" in (ch.get("delta") or {}) for ch in choices)


def stream_shape(events: list[Any]) -> dict[str, Any]:
    """What a client can tell apart between two streams of different lengths."""
    chunks = [e for e in events if isinstance(e, dict)]
    return {
        "ends_with_done": events[-1] == "[DONE]" and events.count("[DONE]") == 1,
        "first": skeleton(chunks[0]),
        "last": skeleton(chunks[-1]),
        "kinds": skeleton(chunks),  # every distinct chunk structure
        # For streams whose middle chunks were merged away (see
        # `without_unmatched_middles`): the kinds of the other chunks, and whether there
        # were middle ones.
        "_edges": skeleton([c for c in chunks if not _is_middle(c)]),
        "_middle": any(_is_middle(c) for c in chunks),
        "choiceless": sum(1 for c in chunks if not c.get("choices")),
        "with_usage": sum(1 for c in chunks if c.get("usage") is not None),
        "finish_chunks": sum(1 for c in chunks for ch in c.get("choices") or ()
                             if ch.get("finish_reason")),
        "choices_seen": sorted({ch["index"] for c in chunks for ch in c.get("choices") or ()}),
    }


def differences(stock: Any, router: Any, path: str = "") -> list[str]:
    """Where two shapes differ, each path with both sides whole."""
    if isinstance(stock, dict) and isinstance(router, dict):
        return [d for k in sorted(set(stock) | set(router))
                for d in differences(stock.get(k, "<absent>"), router.get(k, "<absent>"),
                                     f"{path}.{k}")]
    if isinstance(stock, list) and isinstance(router, list) and stock != router:
        return [(f"{path}: stock only {sorted(set(stock) - set(router))}, "
                 f"router only {sorted(set(router) - set(stock))}")]
    return [] if stock == router else [f"{path}: stock {stock!r}, router {router!r}"]


def shape(answer: Answer) -> dict[str, Any]:
    body = answer.body
    return {"status": answer.status, "content_type": answer.content_type,
            "body": stream_shape(body) if isinstance(body, list) else skeleton(body)}


def without_unmatched_middles(a: dict[str, Any], b: dict[str, Any]) -> None:
    """vLLM merges the tokens a stream's reader has not taken yet into one chunk, so a short
    stream from a busy server can arrive without any middle chunk (each choice's first
    chunk, then its finish). The middle chunks' kinds are then compared on neither side;
    every other chunk's kind still is."""
    sa, sb = a["body"], b["body"]
    if not (isinstance(sa, dict) and isinstance(sb, dict) and "_middle" in sa
            and "_middle" in sb):
        return
    if not (sa["_middle"] and sb["_middle"]):
        sa["kinds"], sb["kinds"] = sa["_edges"], sb["_edges"]
    for side in (sa, sb):
        del side["_edges"], side["_middle"]


@pytest.mark.parametrize("name", [c[0] for c in CASES])
def test_router_answers_like_stock_vllm(answers: dict[str, tuple[Answer, Answer]],
                                        name: str) -> None:
    stock, router = answers[name]
    s, r = shape(stock), shape(router)
    without_unmatched_middles(s, r)
    assert r == s, differences(s, r)
    # Only transport-level headers may be the router's own (e.g. no-cache on a stream);
    # `vary: origin` comes from vLLM's CORS middleware (the router serves no browsers).
    # `x-request-id` is not exempt: the router sends it on every response.
    missing = stock.headers - router.headers - {"vary"}
    assert not missing, missing
    if name.startswith("err-"):
        assert stock.status >= 400
    if name.startswith("err-") and name not in ROUTER_ERRORS:
        assert router.body["error"]["type"] == stock.body["error"]["type"]
        assert router.body["error"]["param"] == stock.body["error"]["param"]
        assert router.body["error"]["code"] == stock.body["error"]["code"]


@pytest.mark.parametrize("name", [c[0] for c in CASES
                                  if not c[0].startswith("err-") and c[2].get("stream")])
def test_kvagent_rides_on_a_chunk_the_client_receives_anyway(
        answers: dict[str, tuple[Answer, Answer]], name: str) -> None:
    stock, router = answers[name]
    carriers = [c for c in router.chunks if "kvagent" in c]
    assert len(carriers) == 1, carriers
    carrier = carriers[0]
    assert carrier is router.chunks[-1]
    usage_asked = bool(_body(name).get("stream_options", {}).get("include_usage"))
    if usage_asked:
        assert carrier["choices"] == [] and carrier["usage"]
    else:  # the finish chunk: clients that read choices[0] of every chunk keep working
        assert carrier["choices"] and carrier["choices"][0]["finish_reason"]
    assert set(carrier["kvagent"]) >= {"cache_token", "reused_tokens", "expires_in", "path"}
    # vLLM stamps the fingerprint on the last chunk it sends; so does the router.
    if "n" not in _body(name):
        assert ("system_fingerprint" in stock.chunks[-1]) == (
            "system_fingerprint" in carrier)


def test_whole_answers_carry_kvagent_at_the_top(
        answers: dict[str, tuple[Answer, Answer]]) -> None:
    stock, router = answers["chat-whole"]
    assert "kvagent" not in stock.body and router.body["kvagent"]["path"]
    assert router.body["kv_transfer_params"] is None  # as stock vLLM writes it


def _body(name: str) -> dict[str, Any]:
    return next(body for n, _, body in CASES if n == name)


# ------------------------------------------------------------------ Messages and Responses
#
# The same check for the agent APIs the router translates to chat: every whole answer's
# structure, and every stream's sequence of event types (a run of deltas counted once)
# with each event type's structure. Values are not compared, nor the ids' prefixes; the
# router's `kvagent` object is set aside as for chat.

ANTHROPIC_TOOL = {"name": "get_metrics", "description": "Metrics of a service.",
                  "input_schema": TOOLS[0]["function"]["parameters"]}
RESPONSES_TOOL = {"type": "function", "name": "get_metrics",
                  "description": "Metrics of a service.",
                  "parameters": TOOLS[0]["function"]["parameters"]}
AGENT_CASES: list[tuple[str, str, dict[str, Any]]] = [
    ("messages-whole", "/v1/messages", {"max_tokens": 8, "temperature": 0.0}),
    ("messages-stream", "/v1/messages", {"max_tokens": 8, "temperature": 0.0,
                                         "stream": True}),
    ("messages-stream-tool", "/v1/messages", {
        "max_tokens": 48, "temperature": 0.0, "stream": True, "tools": [ANTHROPIC_TOOL],
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True}}),
    ("responses-whole", "/v1/responses", {"max_output_tokens": 8, "temperature": 0.0}),
    ("responses-stream", "/v1/responses", {"max_output_tokens": 8, "temperature": 0.0,
                                           "stream": True}),
    ("responses-stream-tool", "/v1/responses", {
        "max_output_tokens": 48, "temperature": 0.0, "stream": True,
        "tools": [RESPONSES_TOOL], "tool_choice": "auto", "parallel_tool_calls": False}),
]


def send_agent_api(client: httpx.Client, root: str, model: str, path: str,
                   body: dict[str, Any]) -> Answer:
    payload: dict[str, Any] = {"model": model, **body}
    if path == "/v1/messages":
        payload.update(system="You are terse.", messages=MESSAGES[1:])
    else:
        payload.update(instructions="You are terse.", input=MESSAGES[1]["content"],
                       store=False)
    return post(client, root + path, payload, named_events)


def named_events(raw: str) -> list[Any]:
    """Each event as (name, data); the name must be the data's `type`."""
    out = []
    for block in raw.split("\n\n"):
        if not block.strip():
            continue
        name, data = block.split("\n", 1)
        assert name.startswith("event: ") and data.startswith("data: "), block
        event = json.loads(data[len("data: "):])
        assert event["type"] == name[len("event: "):], block
        out.append(event)
    return out


def event_shape(events: list[dict[str, Any]]) -> dict[str, Any]:
    """The event types in order (a run of one type counted once: how many deltas a stream
    has depends on the server's pace) and each type's structures."""
    order: list[str] = []
    for event in events:
        if not order or order[-1] != event["type"]:
            order.append(event["type"])
    kinds: dict[str, list[str]] = {}
    for event in events:
        kinds.setdefault(event["type"], []).append(
            json.dumps(skeleton(event), sort_keys=True))
    return {"order": order, "kinds": {k: sorted(set(v)) for k, v in kinds.items()}}


@pytest.fixture(scope="module")
def agent_answers(servers: Servers) -> dict[str, tuple[Answer, Answer]]:
    return both(servers, AGENT_CASES, send_agent_api)


@pytest.mark.parametrize("name", [c[0] for c in AGENT_CASES])
def test_agent_apis_answer_like_stock_vllm(agent_answers: dict[str, tuple[Answer, Answer]],
                                           name: str) -> None:
    stock, router = agent_answers[name]
    assert (router.status, router.content_type) == (stock.status, stock.content_type)
    if isinstance(stock.body, list):
        s, r = event_shape(stock.body), event_shape(router.body)
    else:
        s, r = skeleton(stock.body), skeleton(router.body)
    assert r == s, differences(s, r)


# ------------------------------------------------------------------ never stricter than vLLM
#
# docs/conformance.md, row by row: each input goes to the stock node and to the router.
# What stock vLLM answers, the router answers (never a refusal); what vLLM refuses, the
# router refuses too, and where the refusal comes from the engine, in vLLM's own words.
# The rows the router deliberately answers differently are `ROUTER_DIFFERS`.

CODEX_TOOLS = [RESPONSES_TOOL, {"type": "web_search", "external_web_access": False},
               {"type": "custom", "name": "apply_patch", "description": "Edit files.",
                "format": {"type": "text"}}]
PNG = "data:image/png;base64,iVBORw0KGgo="


def _r(**fields: Any) -> tuple[str, dict[str, Any]]:
    return "/v1/responses", {"input": "Say something.", "max_output_tokens": 4,
                             "temperature": 0, "store": False, **fields}


def _c(**fields: Any) -> tuple[str, dict[str, Any]]:
    return "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 4, "temperature": 0,
                                    **fields}


def _m(**fields: Any) -> tuple[str, dict[str, Any]]:
    return "/v1/messages", {"messages": MESSAGES[1:], "max_tokens": 4, "temperature": 0,
                            **fields}


#: id -> (path, body without "model"); the ids are the table's first column.
ROWS: dict[str, tuple[str, dict[str, Any]]] = {
    "responses-web-search": _r(tools=[{"type": "web_search"}]),
    "responses-web-search-preview": _r(tools=[{"type": "web_search_preview"}]),
    "responses-file-search": _r(tools=[{"type": "file_search", "vector_store_ids": ["vs_1"]}]),
    "responses-local-shell": _r(tools=[{"type": "local_shell"}]),
    "responses-mcp": _r(tools=[{"type": "mcp", "server_label": "x",
                                "server_url": "http://127.0.0.1:1"}]),
    "responses-built-in-beside-function": _r(tools=[{"type": "web_search"}, RESPONSES_TOOL]),
    "responses-custom-tool": _r(tools=[{"type": "custom", "name": "apply_patch"}]),
    "responses-codex-first-request": _r(tools=CODEX_TOOLS, tool_choice="auto",
                                        parallel_tool_calls=False, include=[],
                                        prompt_cache_key="codex-thread", stream=True),
    "responses-custom-grammar": _r(tools=[{"type": "custom", "name": "apply_patch", "format": {
        "type": "grammar", "syntax": "lark", "definition": "start: /x/"}}]),
    "responses-choice-allowed-tools": _r(tools=[RESPONSES_TOOL], tool_choice={
        "type": "allowed_tools", "mode": "auto",
        "tools": [{"type": "function", "name": "get_metrics"}]}),
    "responses-choice-web-search-preview": _r(tools=[RESPONSES_TOOL],
                                              tool_choice={"type": "web_search_preview"}),
    "responses-choice-required-built-in-only": _r(tools=[{"type": "web_search"}],
                                                  tool_choice="required"),
    "responses-conversation": _r(conversation={"id": "conv_1"}),
    "responses-assistant-empty-content": _r(input=[
        {"role": "user", "content": "hi"}, {"type": "message", "role": "assistant",
                                            "content": []},
        {"role": "user", "content": "again"}]),
    "responses-max-output-tokens-string": _r(max_output_tokens="4"),
    "responses-max-output-tokens-float": _r(max_output_tokens=4.0),
    "responses-max-output-tokens-fraction": _r(max_output_tokens=4.5),
    "responses-temperature-string": _r(temperature="0.5"),
    "responses-top-k-string": _r(top_k="5"),
    "responses-stream-yes": _r(stream="yes"),
    "responses-metadata-string": _r(metadata="x"),
    "responses-metadata-nested": _r(metadata={"a": {"b": "c"}}),
    "responses-metadata-17-pairs": _r(metadata={f"k{i}": "v" for i in range(17)}),
    "responses-metadata-long-value": _r(metadata={"k": "v" * 513}),
    "responses-background": _r(background=True),
    "responses-prompt-template": _r(prompt={"id": "pmpt_1"}),
    "responses-image-text-model": _r(input=[{"role": "user", "content": [
        {"type": "input_image", "image_url": PNG}]}]),
    "responses-unknown-model": _r(model="no-such-model"),
    "responses-max-output-beyond-context": _r(max_output_tokens=100_000),
    "chat-max-tokens-string": _c(max_tokens="4"),
    "chat-max-tokens-float": _c(max_tokens=4.0),
    "chat-max-tokens-fraction": _c(max_tokens=4.5),
    "chat-top-k-string": _c(top_k="5"),
    "chat-stream-yes": _c(stream="yes"),
    "chat-temperature-string": _c(temperature="0.5"),
    "chat-seed-string": _c(seed="3"),
    "chat-logprobs-string": _c(logprobs="true"),
    "chat-assistant-empty-content": _c(messages=[
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": []},
        {"role": "user", "content": "x"}]),
    "chat-max-completion-tokens-beyond-context": _c(max_completion_tokens=100_000),
    "chat-unknown-model": _c(model="no-such-model"),
    "chat-image-text-model": _c(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": PNG}}]}]),
    "messages-max-tokens-string": _m(max_tokens="4"),
    "messages-max-tokens-float": _m(max_tokens=4.0),
    "messages-top-k-string": _m(top_k="5"),
    "messages-stream-yes": _m(stream="yes"),
    "messages-temperature-string": _m(temperature="0.5"),
    "messages-tool-choice-any-without-tools": _m(tool_choice={"type": "any"}),
    "messages-assistant-empty-content": _m(messages=[
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": []},
        {"role": "user", "content": "x"}]),
    "messages-image-text-model": _m(messages=[{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                     "data": PNG.split(",", 1)[1]}}]}]),
    "messages-unknown-model": _m(model="no-such-model"),
    "messages-max-tokens-beyond-context": _m(max_tokens=100_000),
}
#: Rows the router answers differently on purpose (docs/conformance.md says why): vLLM
#: fails on an assistant message with no parts (500); the OpenAI API bounds `metadata`,
#: which the router stores with the Response.
ROUTER_DIFFERS = {"responses-assistant-empty-content": (500, 200),
                  "responses-metadata-17-pairs": (200, 400),
                  "responses-metadata-long-value": (200, 400)}
#: Refusals that come from the engine: the router passes vLLM's own words on.
ENGINE_WORDS = ("responses-image-text-model", "responses-unknown-model",
                "responses-max-output-beyond-context", "chat-max-completion-tokens-beyond-context",
                "chat-unknown-model", "chat-image-text-model", "messages-image-text-model",
                "messages-unknown-model", "messages-max-tokens-beyond-context")


def send_row(client: httpx.Client, root: str, model: str, path: str,
             body: dict[str, Any]) -> Answer:
    payload: dict[str, Any] = {"model": model, **body}
    try:
        return post(client, root + path, payload, lambda raw: [raw])
    except httpx.TransportError as exc:  # vLLM 0.32 drops some connections it fails on
        return Answer(599, "", set(), {"transport_error": type(exc).__name__})


@pytest.fixture(scope="module")
def row_answers(servers: Servers) -> dict[str, tuple[Answer, Answer]]:
    return both(servers, [(name, path, body) for name, (path, body) in ROWS.items()],
                send_row)


def _message(answer: Answer) -> str:
    err = answer.body.get("error") if isinstance(answer.body, dict) else None
    return err.get("message", "") if isinstance(err, dict) else ""


@pytest.mark.parametrize("name", list(ROWS))
def test_the_router_is_never_stricter_than_stock_vllm(
        row_answers: dict[str, tuple[Answer, Answer]], name: str) -> None:
    stock, router = row_answers[name]
    if name in ROUTER_DIFFERS:
        assert (stock.status, router.status) == ROUTER_DIFFERS[name], (stock.body,
                                                                       router.body)
        return
    if stock.status < 400:
        assert router.status == stock.status, router.body
        assert router.content_type.split(";")[0] == stock.content_type.split(";")[0]
    else:
        assert router.status == stock.status, (stock.body, router.body)
    if name in ENGINE_WORDS:
        assert _message(router) == _message(stock) and _message(stock), (stock.body,
                                                                         router.body)


def test_every_row_is_in_the_conformance_table() -> None:
    """The docs' table and these rows are one list."""
    from pathlib import Path

    table = (Path(__file__).parents[2] / "docs" / "conformance.md").read_text()
    ids = {line.split("`")[1] for line in table.splitlines()
           if line.startswith("| `")}
    assert ids == set(ROWS), (sorted(ids - set(ROWS)), sorted(set(ROWS) - ids))
