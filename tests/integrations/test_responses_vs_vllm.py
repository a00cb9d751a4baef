"""The router's Responses translation against stock vLLM's own `/v1/responses`, on one node.

For each request the node answers `/v1/responses` itself, and the translation's chat body
goes to the same node's `/v1/chat/completions` and is translated back: the prompt must have
the same length (the same rendering) and, greedy, the answer the same items and status.
Streamed, the chat stream run through `ResponseStream` must give vLLM's event sequence.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from kvagent_server.router.apis import sse
from kvagent_server.router.apis.responses import (
    ApiError,
    ResponseStream,
    history,
    response_from_chat,
    to_chat,
)
from support import VLLMNode

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

#: Bounded parameters, so the random demo model completes a call when one is required.
CITY = {"type": "function", "name": "get_weather", "description": "Weather for a city",
        "parameters": {"type": "object", "required": ["city", "metric"],
                       "properties": {"city": {"type": "string", "enum": ["paris", "rome"]},
                                      "metric": {"type": "boolean"}}}}
#: Codex's freeform tool.
PATCH = {"type": "custom", "name": "apply_patch", "description": "Edit files with a patch.",
         "format": {"type": "text"}}
CLOCK = {"type": "function", "name": "get_time", "description": "The time",
         "parameters": {"type": "object", "properties": {}}}
HISTORY = [
    {"role": "user", "content": "weather in paris?"},
    {"type": "function_call", "call_id": "call_1", "name": "get_weather",
     "arguments": '{"city":"paris","metric":true}'},
    {"type": "function_call_output", "call_id": "call_1", "output": "sunny, 21C"},
]
#: Fields of a Response that differ between any two answers, or that vLLM derives from the
#: engine (the output-token cap it applied when the request set none).
VOLATILE = {"id", "created_at", "output", "usage", "kvagent"}
#: vLLM echoes, as `text`, the JSON schema it constrains a required or named call with.
TOOL_TEXT = {"text"}


@pytest.fixture(scope="module")
def node(vllm_node: VLLMNode) -> VLLMNode:
    """The suite's stock node: its `/v1/responses` stores responses, so it can chain them."""
    return vllm_node


@pytest.fixture(scope="module")
def client(node: VLLMNode) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=node.root_url, timeout=120) as c:
        yield c


def _body(node: VLLMNode, **fields: Any) -> dict[str, Any]:
    return {"model": node.model, "temperature": 0, "max_output_tokens": 16, **fields}


def _items(response: dict[str, Any]) -> list[dict[str, Any]]:
    """Output items without their random ids."""
    return [{k: v for k, v in item.items() if k not in ("id", "call_id")}
            for item in response["output"]]


def _via_chat(client: httpx.Client, body: dict[str, Any],
              previous: list[dict[str, Any]] | None = None
              ) -> tuple[dict[str, Any], dict[str, Any]]:
    """The translation's answer: (chat body sent, Response built)."""
    chat = to_chat(body, previous=previous)
    r = client.post("/v1/chat/completions", json=chat)
    assert r.status_code == 200, r.text
    return chat, response_from_chat(r.json(), request=body, response_id="resp_x",
                                    created_at=int(time.time()))


def _set(tool: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in tool.items() if v is not None}


def _assert_same(ours: dict[str, Any], theirs: dict[str, Any]) -> None:
    assert ours["usage"]["input_tokens"] == theirs["usage"]["input_tokens"]
    assert ours["usage"]["output_tokens"] == theirs["usage"]["output_tokens"]
    assert set(ours["usage"]) == set(theirs["usage"])
    assert _items(ours) == _items(theirs)
    assert ours.keys() - {"kvagent"} == theirs.keys()
    assert {k: v for k, v in ours.items() if k not in VOLATILE | TOOL_TEXT | {"tools"}} == {
        k: v for k, v in theirs.items() if k not in VOLATILE | TOOL_TEXT | {"tools"}}
    # vLLM echoes a built-in or custom tool with every field of its model (unset ones as
    # null); the router echoes what was sent. Function tools echo alike.
    assert [_set(t) for t in ours["tools"]] == [_set(t) for t in theirs["tools"]]
    if ours["tool_choice"] in ("auto", "none"):
        assert ours["text"] == theirs["text"]


CASES: dict[str, dict[str, Any]] = {
    "string": {"input": "hello there", "instructions": "Be terse."},
    "items": {"input": [
        {"role": "developer", "content": "Answer in French."},
        {"type": "message", "role": "system", "content": [{"type": "input_text", "text": "s"}]},
        {"type": "message", "role": "user",
         "content": [{"type": "input_text", "text": "one"}, {"type": "input_text", "text": "two"}]},
        {"type": "message", "role": "assistant", "status": "completed",
         "content": [{"type": "output_text", "text": "un", "annotations": []}]},
        {"role": "user", "content": "three"}]},
    "tools_auto": {"input": "weather?", "tools": [CITY, CLOCK]},
    "tools_none": {"input": "weather?", "tools": [CITY], "tool_choice": "none"},
    "tools_required": {"input": "weather?", "tools": [CITY], "tool_choice": "required",
                       "parallel_tool_calls": False, "max_output_tokens": 48},
    "tools_named": {"input": "weather?", "tools": [CITY, CLOCK],
                    "tool_choice": {"type": "function", "name": "get_weather"},
                    "max_output_tokens": 48},
    "tool_history": {"input": HISTORY, "tools": [CITY], "instructions": "Use tools."},
    "reasoning_item": {"input": [
        HISTORY[0],
        {"type": "reasoning", "id": "rs_1", "summary": [],
         "content": [{"type": "reasoning_text", "text": "I should call the tool."}]},
        *HISTORY[1:],
        {"type": "reasoning", "id": "rs_2", "encrypted_content": None,
         "summary": [{"type": "summary_text", "text": "Now answer."}]}], "tools": [CITY]},
    "incomplete": {"input": "tell me a long story", "max_output_tokens": 8},
    # What vLLM accepts and shows the model differently from the request (docs/conformance.md)
    "builtin_tools": {"input": "weather?", "tools": [
        CITY, {"type": "web_search"}, {"type": "file_search", "vector_store_ids": ["vs_1"]},
        {"type": "local_shell"}, {"type": "mcp", "server_label": "x",
                                  "server_url": "http://127.0.0.1:1"}]},
    "builtin_only": {"input": "weather?", "tools": [{"type": "web_search"}]},
    "custom_tool": {"input": "patch it", "tools": [CITY, PATCH]},
    "custom_tool_named": {"input": "patch it", "tools": [CITY, PATCH], "max_output_tokens": 48,
                          "tool_choice": {"type": "custom", "name": "apply_patch"}},
    "allowed_tools": {"input": "weather?", "tools": [CITY], "tool_choice": {
        "type": "allowed_tools", "mode": "required",
        "tools": [{"type": "function", "name": "get_weather"}]}},
    "hosted_tool_choice": {"input": "weather?", "tools": [CITY],
                           "tool_choice": {"type": "web_search_preview"}},
    "conversation": {"input": "hi", "conversation": {"id": "conv_1"}},
    "lax_scalars": {"input": "hi", "max_output_tokens": "12", "temperature": "0",
                    "top_k": "5", "stream": "false"},
    "echoes": {"input": "hi", "max_output_tokens": 12, "stop": ["."], "top_p": 0.9,
               "metadata": {"k": "v"}, "user": "u1", "reasoning": {"effort": "low"},
               "text": {"format": {"type": "text"}}, "truncation": "disabled"},
}


@pytest.mark.parametrize("case", list(CASES))
def test_whole_answers_match_vllm(client: httpx.Client, node: VLLMNode, case: str) -> None:
    body = _body(node, **CASES[case])
    r = client.post("/v1/responses", json=body)
    assert r.status_code == 200, r.text
    theirs = r.json()
    _, ours = _via_chat(client, body)
    _assert_same(ours, theirs)
    if case == "incomplete":
        assert ours["status"] == "incomplete"
    if case in ("tools_required", "tools_named"):
        assert [i["type"] for i in ours["output"]] == ["function_call"]
    if case == "custom_tool_named":
        assert [i["type"] for i in ours["output"]] == ["custom_tool_call"]


def test_encrypted_reasoning_is_refused_by_both(client: httpx.Client, node: VLLMNode) -> None:
    body = _body(node, input=[{"role": "user", "content": "hi"},
                              {"type": "reasoning", "id": "rs_1", "summary": [],
                               "encrypted_content": "gAAAAB"}])
    r = client.post("/v1/responses", json=body)
    assert r.status_code == 400
    with pytest.raises(ApiError) as err:
        to_chat(body)
    assert err.value.status == 400
    assert r.json()["error"]["message"].startswith(err.value.message)
    assert r.json()["error"]["param"] == err.value.param


@pytest.mark.parametrize("first", ["text", "tool_call"])
def test_chained_turns_render_as_the_whole_history_does(client: httpx.Client, node: VLLMNode,
                                                        first: str) -> None:
    """A turn chained by `previous_response_id` gets the prompt of the same conversation
    sent whole (vLLM's own chaining agrees after a text answer; after a function call it
    drops the call, which kvagent keeps)."""
    one = _body(node, input="hello", instructions="Old rules.", store=True)
    if first == "tool_call":
        one.update(tools=[CITY], tool_choice="required", parallel_tool_calls=False,
                   max_output_tokens=120)  # the call takes about 50 tokens
    r1 = client.post("/v1/responses", json=one)
    assert r1.status_code == 200, r1.text
    chat1, ours1 = _via_chat(client, one)
    _assert_same(ours1, r1.json())
    if first == "tool_call":
        call = r1.json()["output"][-1]
        two_input: Any = [{"type": "function_call_output", "call_id": call["call_id"],
                           "output": "sunny"}]
    else:
        two_input = [{"role": "user", "content": "and again"}]
    chained = _body(node, input=two_input, instructions="New rules.",
                    previous_response_id=r1.json()["id"], tools=one.get("tools", []))
    _, ours2 = _via_chat(client, chained, previous=history(chat1, ours1))
    whole = _body(node, instructions="New rules.", tools=one.get("tools", []),
                  input=[{"role": "user", "content": "hello"}, *r1.json()["output"], *two_input])
    r2 = client.post("/v1/responses", json=whole)
    assert r2.status_code == 200, r2.text
    _assert_same({**ours2, "previous_response_id": None}, r2.json())  # sent whole: no chain
    if first == "text":
        r2_chained = client.post("/v1/responses", json=chained)
        assert r2_chained.status_code == 200, r2_chained.text
        _assert_same(ours2, r2_chained.json())
    got = client.get(f"/v1/responses/{r1.json()['id']}")
    assert got.status_code == 200 and got.json()["output"] == r1.json()["output"]


# ------------------------------------------------------------------------ streams

def _named_events(raw: bytes) -> list[dict[str, Any]]:
    out = []
    for block in raw.decode().split("\n\n"):
        lines = block.strip().split("\n")
        if len(lines) == 2 and lines[0].startswith("event: "):
            data = json.loads(lines[1][len("data: "):])
            assert data["type"] == lines[0][len("event: "):]
            out.append(data)
    return out


def _vllm_stream(client: httpx.Client, body: dict[str, Any]) -> list[dict[str, Any]]:
    with client.stream("POST", "/v1/responses", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        return _named_events(r.read())


def _our_stream(client: httpx.Client, body: dict[str, Any]
                ) -> tuple[list[dict[str, Any]], ResponseStream]:
    chat = to_chat({**body, "stream": True})
    stream = ResponseStream(request=body, response_id="resp_x", created_at=int(time.time()))
    reader = sse.ChatEvents()
    raw: list[bytes] = []
    with client.stream("POST", "/v1/chat/completions", json=chat) as r:
        assert r.status_code == 200
        for data in r.iter_bytes():
            for chunk in reader.feed(data):
                raw += stream.feed(chunk)
    return _named_events(b"".join(raw)), stream


def _shape(event: dict[str, Any]) -> dict[str, Any]:
    """What must match between two streams of the same greedy answer (not ids)."""
    keep = {k: v for k, v in event.items()
            if k not in ("item_id", "item", "response", "sequence_number")}
    if "item" in event:
        keep["item"] = {k: v for k, v in event["item"].items() if k not in ("id", "call_id")}
    if "response" in event:
        response = event["response"]
        keep["response"] = {k: v for k, v in response.items()
                            if k not in VOLATILE | TOOL_TEXT} | {
            "output": _items(response), "tools": [_set(t) for t in response["tools"]]}
    return keep


def _joined(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each run of delta events as one: vLLM's own stream may batch engine steps that the
    chat stream sends one by one, so only the text of a run is comparable."""
    out: list[dict[str, Any]] = []
    for e in events:
        shape = _shape(e)
        if e["type"].endswith(".delta") and out and out[-1]["type"] == e["type"] and (
                out[-1]["output_index"] == e["output_index"]):
            out[-1]["delta"] += e["delta"]
        else:
            out.append(shape)
    return out


@pytest.mark.parametrize("case", ["string", "tools_auto", "tools_required", "tools_named",
                                  "tool_history", "incomplete", "custom_tool_named"])
def test_streams_match_vllm(client: httpx.Client, node: VLLMNode, case: str) -> None:
    body = _body(node, **CASES[case])
    theirs = _vllm_stream(client, body)
    ours, stream = _our_stream(client, body)
    assert [e["sequence_number"] for e in ours] == list(range(len(ours)))
    assert [set(e) for e in ours if not e["type"].endswith(".delta")] == [
        set(e) for e in theirs if not e["type"].endswith(".delta")]
    assert _joined(ours) == _joined(theirs)
    final, their_final = ours[-1]["response"], theirs[-1]["response"]
    assert final["usage"]["input_tokens"] == their_final["usage"]["input_tokens"]
    assert final["usage"]["output_tokens"] == their_final["usage"]["output_tokens"]
    assert stream.response == final
    # Ids are consistent within our stream: the done item is the added item.
    added = {e["output_index"]: e["item"]["id"] for e in ours
             if e["type"] == "response.output_item.added"}
    assert [o["id"] for o in final["output"]] == [added[i] for i in sorted(added)]
