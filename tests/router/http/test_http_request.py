"""Request parsing before any node is contacted: precedence, removal, validation."""

from __future__ import annotations

import pytest
from kvagent_server.router.http.request import HTTPError, session_and_token, validate


def test_header_wins_then_body_object_then_alias_and_body_forms_removed() -> None:
    body = {"messages": [], "kvagent": {"session_id": "b", "cache_token": "tb"},
            "conversation_id": "c"}
    assert session_and_token({"X-Session-ID": "h", "X-KVAgent-Cache-Token": "th"}, body) == (
        "h", "th")
    assert "kvagent" not in body and "conversation_id" not in body
    body = {"kvagent": {"session_id": "b", "cache_token": "tb"}, "conversation_id": "c"}
    assert session_and_token({}, body) == ("b", "tb")
    body = {"conversation_id": "c"}
    assert session_and_token({}, body) == ("c", None)
    assert session_and_token({}, {}) == (None, None)


@pytest.mark.parametrize("bad", ["", "has space", "x" * 129, "a/b", 42])
def test_invalid_session_ids_rejected(bad: object) -> None:
    with pytest.raises(HTTPError) as info:
        session_and_token({}, {"conversation_id": bad})
    assert info.value.status == 400


def test_oversized_token_becomes_a_rejected_token_not_an_error() -> None:
    session, token = session_and_token({"X-Session-ID": "s",
                                        "X-KVAgent-Cache-Token": "k" * 5000}, {})
    assert session == "s" and token is not None and len(token) < 100


def test_kvagent_field_must_be_an_object() -> None:
    with pytest.raises(HTTPError):
        session_and_token({}, {"kvagent": "s1"})


@pytest.mark.parametrize(("body", "chat", "param"), [
    ({"messages": "hi"}, True, "messages"),
    ({"messages": ["hi"]}, True, "messages"),
    ({}, False, "prompt"),
    ({"prompt": "x", "stream": "sometimes"}, False, "stream"),
    ({"prompt": "x", "max_tokens": 4.5}, False, "max_tokens"),
    ({"prompt": "x", "top_k": "five"}, False, "top_k"),
    ({"prompt": "x", "max_tokens": -1}, False, "max_tokens"),
    ({"prompt": "x", "n": 0}, False, "n"),
    ({"prompt": "x", "stream_options": []}, False, "stream_options"),
])
def test_validation_names_the_field(body: dict, chat: bool, param: str) -> None:
    with pytest.raises(HTTPError) as info:
        validate(body, chat=chat)
    assert info.value.status == 400 and info.value.param == param


@pytest.mark.parametrize(("field", "sent", "served"), [
    ("max_tokens", "4", 4), ("max_tokens", 4.0, 4), ("top_k", "5", 5),
    ("stream", "yes", True), ("temperature", "0.5", 0.5), ("seed", "3", 3), ("n", "1", 1),
    ("logprobs", "true", True), ("parallel_tool_calls", "false", False)])
def test_values_vllm_converts_are_converted_and_forwarded(field: str, sent: object,
                                                          served: object) -> None:
    """vLLM's pydantic models convert these (lax mode): the router converts them the same
    way and forwards the converted value, instead of refusing them."""
    body = {"messages": [{"role": "user", "content": "hi"}], field: sent}
    validate(body, chat=True)
    assert body[field] == served and type(body[field]) is type(served)
