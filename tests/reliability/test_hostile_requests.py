"""Malformed, oversized and mistyped requests get clear 4xx errors in OpenAI's format, and
no response or error, for any request, carries an internal host, port, engine or block id.
"""

from __future__ import annotations

import json
import string
from typing import Any

import pytest
from fakes import FakeCluster, Reply, Stack, router_stack
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from kvagent_server.router.http.request import HTTPError, parse_json, validate
from reliability_support import LoopBridge, is_openai_error, leaks

MODEL = "fake-model"
GOOD_CHAT: dict[str, Any] = {
    "model": MODEL, "stream": True, "stream_options": {"include_usage": True},
    "messages": [{"role": "system", "content": "Be brief."},
                 {"role": "user", "content": "What is the capital of France? " * 4}],
}
GOOD_COMPLETION: dict[str, Any] = {"model": MODEL, "prompt": "Once upon a time " * 8,
                                   "max_tokens": 8}

json_leaf = (st.none() | st.booleans() | st.integers(-(2**70), 2**70)
             | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20))
json_values = st.recursive(json_leaf, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=8), inner, max_size=4),
                           max_leaves=12)
#: Fields the router type-checks, plus some it passes through untouched.
FIELDS = ["model", "messages", "prompt", "stream", "stream_options", "n", "best_of",
          "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "seed",
          "stop", "stop_token_ids", "logit_bias", "logprobs", "top_logprobs", "tools",
          "tool_choice", "response_format", "user", "return_token_ids", "vllm_xargs",
          "kvagent", "conversation_id", "kv_transfer_params", "cache_salt",
          "chat_template_kwargs", "echo", "min_p", "x_unknown_field", "guided_json"]
FUZZ = settings(max_examples=400, deadline=None,
                suppress_health_check=[HealthCheck.too_slow])


# --------------------------------------------------------------------- the parser alone


@FUZZ
@given(raw=st.binary(max_size=300) | st.text(max_size=300).map(str.encode))
def test_any_bytes_parse_or_get_a_400(raw: bytes) -> None:
    try:
        body = parse_json(raw)
    except HTTPError as exc:
        assert exc.status == 400 and exc.message
    else:
        assert isinstance(body, dict)
        json.dumps(body, ensure_ascii=False, allow_nan=False).encode()  # forwardable


@FUZZ
@given(field=st.sampled_from(FIELDS), value=json_values, chat=st.booleans(),
       extra=st.dictionaries(st.sampled_from(FIELDS), json_values, max_size=3))
def test_any_field_value_validates_or_gets_a_400(field: str, value: Any, chat: bool,
                                                  extra: dict[str, Any]) -> None:
    """Never a TypeError/KeyError (a 500): only pass, or a 400 naming a field."""
    body = json.loads(json.dumps(GOOD_CHAT if chat else GOOD_COMPLETION))
    body.update(extra)
    body[field] = value
    try:
        validate(body, chat=chat)
    except HTTPError as exc:
        assert exc.status == 400 and exc.message
        assert exc.param is None or isinstance(exc.param, str)


@pytest.mark.parametrize(("raw", "needle"), [
    (b"[" * 100_000, "nested too deeply"),
    (b'{"model": NaN, "prompt": "x"}', "not valid JSON"),
    (b'{"prompt": "x", "temperature": Infinity}', "not valid JSON"),
    (b'{"prompt": "\\ud800"}', "lone UTF-16 surrogate"),
    (b'{"prompt": "\xff\xfe"}', "UTF-8"),
    (b'"just a string"', "JSON object"),
])
def test_parser_edge_cases(raw: bytes, needle: str) -> None:
    with pytest.raises(HTTPError) as info:
        parse_json(raw)
    assert info.value.status == 400 and needle in info.value.message


def test_surrogate_pairs_are_fine() -> None:
    assert parse_json(b'{"prompt": "\\ud83d\\ude00"}') == {"prompt": "\U0001f600"}


# --------------------------------------------------------------------- through the app


CASES: list[tuple[str, str, dict[str, Any] | bytes, int, str | None]] = [
    # (name, endpoint, body, status, error param or code)
    ("huge max_tokens", "chat", {**GOOD_CHAT, "max_tokens": 10**12}, 400,
     "max_tokens_too_large"),
    ("huge int", "chat", {**GOOD_CHAT, "max_completion_tokens": 2**80}, 400,
     "max_tokens_too_large"),
    ("negative max_tokens", "completions", {**GOOD_COMPLETION, "max_tokens": -5}, 400,
     "max_tokens"),
    # vLLM converts "4", 4.0 and true for an int, "yes" for a bool (pydantic's lax mode),
    # and so does the router (docs/conformance.md); what neither can convert is refused.
    ("word as int", "chat", {**GOOD_CHAT, "n": "two"}, 400, "n"),
    ("temperature string", "chat", {**GOOD_CHAT, "temperature": "hot"}, 400, "temperature"),
    ("stream word", "chat", {**GOOD_CHAT, "stream": "perhaps"}, 400, "stream"),
    ("messages not list", "chat", {**GOOD_CHAT, "messages": {"role": "user"}}, 400,
     "messages"),
    ("role missing", "chat", {**GOOD_CHAT, "messages": [{"content": "hi"}]}, 400,
     "messages[0].role"),
    ("content number", "chat", {**GOOD_CHAT, "messages": [{"role": "user", "content": 7}]},
     400, "messages[0].content"),
    ("content part w/o type", "chat",
     {**GOOD_CHAT, "messages": [{"role": "user", "content": [{"text": "x"}]}]}, 400,
     "messages[0].content[0]"),
    ("tools not list", "chat", {**GOOD_CHAT, "tools": {"type": "function"}}, 400, "tools"),
    ("tool without name", "chat",
     {**GOOD_CHAT, "tools": [{"type": "function", "function": {"parameters": {}}}]}, 400,
     "tools[0].function.name"),
    ("tool params not object", "chat",
     {**GOOD_CHAT, "tools": [{"type": "function",
                              "function": {"name": "f", "parameters": "{}"}}]}, 400,
     "tools[0].function.parameters"),
    ("tool wrong type", "chat",
     {**GOOD_CHAT, "tools": [{"type": "retrieval", "function": {"name": "f"}}]}, 400,
     "tools[0].type"),
    ("tool_choice bogus", "chat", {**GOOD_CHAT, "tool_choice": "sometimes"}, 400,
     "tool_choice"),
    ("tool call args object", "chat",
     {**GOOD_CHAT, "messages": [{"role": "assistant", "content": None, "tool_calls": [
         {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {}}}]}]},
     400, "messages[0].tool_calls[0].function.arguments"),
    ("prompt mixed list", "completions", {**GOOD_COMPLETION, "prompt": ["a", 1]}, 400,
     "prompt"),
    ("stop list of ints", "completions", {**GOOD_COMPLETION, "stop": [1, 2]}, 400, "stop"),
    ("kvagent not object", "chat", {**GOOD_CHAT, "kvagent": "s1"}, 400, "kvagent"),
    ("bad session id", "chat", {**GOOD_CHAT, "conversation_id": "a b"}, 400, None),
    ("malformed json", "chat", b'{"model": "m", "messages": [', 400, None),
    ("NaN", "chat", b'{"model": "m", "messages": [], "temperature": NaN}', 400, None),
    ("deep nesting", "chat", b'{"messages": ' + b"[" * 50_000 + b"]" * 50_000 + b"}", 400,
     None),
    ("lone surrogate", "chat",
     b'{"model": "m", "messages": [{"role": "user", "content": "\\udc80"}]}', 400, None),
    ("array body", "chat", b"[1, 2, 3]", 400, None),
    ("empty body", "chat", b"", 400, None),
]


async def test_bad_requests_get_clear_openai_errors_before_any_node() -> None:
    async with router_stack(limits={"max_body_bytes": 256 * 1024}) as stack:
        for name, endpoint, body, status, ident in CASES:
            content = body if isinstance(body, bytes) else json.dumps(body).encode()
            r = await stack.client.post(f"/v1/{'chat/' if endpoint == 'chat' else ''}"
                                        "completions", content=content,
                                        headers={"content-type": "application/json"})
            assert r.status_code == status, (name, r.status_code, r.text)
            err = r.json()
            assert is_openai_error(err), (name, err)
            if ident is not None:
                assert ident in (err["error"]["param"], err["error"]["code"]), (name, err)
            assert not leaks(stack, r.content), name
            assert len(r.content) < 1024, (name, "an error must not echo the request")
        assert not any(n.requests for n in stack.nodes), "a rejected request reached a node"


async def test_unknown_fields_pass_through_but_transfer_fields_never_do() -> None:
    """vLLM accepts its own extensions (top_k, guided_json, ...) and ignores unknown ones
    with a warning, so the router forwards every field it does not own; only the fields
    that steer KV transfers are removed (also when smuggled through `vllm_xargs`)."""
    async with router_stack(policy={"params": {"skip_prefill_max_tokens": 0}}) as stack:
        body = {**GOOD_CHAT, "top_k": 5, "min_p": 0.1, "guided_json": {"type": "object"},
                "x_vendor_extension": {"deep": [1, 2]},
                "vllm_xargs": {"kv_transfer_params": "x", "ec_transfer_params": "y",
                               "my_arg": 3},
                "kv_transfer_params": {"do_remote_prefill": True},
                "ec_transfer_params": {"a": 1}, "cache_salt": "steal"}
        r = await stack.client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        assert not leaks(stack, r.content)
        for sent in (stack.prefill[0].requests[-1], stack.decode[0].requests[-1]):
            assert sent["top_k"] == 5 and sent["min_p"] == 0.1
            assert sent["guided_json"] == {"type": "object"}
            assert sent["x_vendor_extension"] == {"deep": [1, 2]}
            assert sent["vllm_xargs"] == {"my_arg": 3}
            assert sent["cache_salt"] != "steal" and "ec_transfer_params" not in sent
        assert stack.prefill[0].requests[-1]["kv_transfer_params"] == {
            "do_remote_decode": True, "do_remote_prefill": False}


# --------------------------------------------------------------------- nothing leaks


def _hostile_body(data: st.DataObject) -> tuple[str, dict[str, Any]]:
    chat = data.draw(st.booleans(), label="chat")
    body = json.loads(json.dumps(GOOD_CHAT if chat else GOOD_COMPLETION))
    body["stream"] = data.draw(st.booleans(), label="stream")
    for _ in range(data.draw(st.integers(0, 3), label="edits")):
        body[data.draw(st.sampled_from(FIELDS))] = data.draw(json_values)
    return ("/v1/chat/completions" if chat else "/v1/completions"), body


async def test_no_response_or_error_leaks_internals() -> None:
    """Hypothesis-built requests (valid, mistyped, with session forms, unknown fields and
    tokens) against nodes that sometimes fail and echo the request they got (like a
    validation error quoting its input): every byte back is scanned for internals."""
    cluster = FakeCluster(reply=lambda p: Reply(content="fine answer " * 10))
    async with router_stack(cluster=cluster,
                            policy={"params": {"skip_prefill_max_tokens": 0}}) as stack:
        for node in stack.nodes:
            node.echo_errors = True
        bridge = LoopBridge()
        statuses: dict[int, int] = {}

        @settings(max_examples=80, deadline=None, derandomize=True, phases=[Phase.generate],
                  suppress_health_check=list(HealthCheck))
        @given(data=st.data())
        def run(data: st.DataObject) -> None:
            path, body = _hostile_body(data)
            headers = {"content-type": "application/json"}
            if data.draw(st.booleans(), label="session"):
                headers["X-Session-ID"] = data.draw(st.text(
                    alphabet=string.ascii_letters + string.digits + "._:- ", min_size=1,
                    max_size=20))
            if data.draw(st.booleans(), label="token"):
                headers["X-KVAgent-Cache-Token"] = data.draw(st.text(
                    alphabet=string.ascii_letters + string.digits + "-_.", max_size=60))
            fault = data.draw(st.sampled_from([None, None, 400, 422, 500, 503]), label="fault")
            node = stack.nodes[data.draw(st.integers(0, len(stack.nodes) - 1))]
            node.fail_next = [fault] * 3 if fault else []
            r = bridge(_post(stack, path, body, headers))
            node.fail_next = []
            statuses[r[0]] = statuses.get(r[0], 0) + 1
            assert r[0] == 200 or is_openai_error(json.loads(r[1])), r
            assert r[0] != 500, r  # 500 is the router's own bug
            # `token_ids` is public when the client asked for it (or its error names it).
            assert not leaks(stack, r[1], allow_token_ids="return_token_ids" in body), r

        await bridge.start(run)
        assert statuses.get(200) and any(400 <= s < 500 for s in statuses), statuses
        assert not stack.cluster.events_of("wrong_kv")


async def _post(stack: Stack, path: str, body: dict[str, Any],
                headers: dict[str, str]) -> tuple[int, bytes]:
    r = await stack.client.post(path, content=json.dumps(body).encode(), headers=headers)
    return r.status_code, r.content
