"""A node's error `type` reaches the client as vLLM wrote it, when it is a plain name."""

from __future__ import annotations

import pytest
from kvagent_server.router.common.node_errors import client_type


@pytest.mark.parametrize("given", ["BadRequestError", "NotFoundError", "Bad Request"])
def test_vllm_error_types_pass(given: str) -> None:
    assert client_type(given) == given


@pytest.mark.parametrize("given", [None, 3, "", "a/b", "x" * 60, "engine abc", "10.0.0.1"])
def test_anything_else_is_openais_name(given: object) -> None:
    assert client_type(given) == "invalid_request_error"


def test_a_streamed_error_event_keeps_only_safe_parts() -> None:
    from kvagent_server.router.common.node_errors import STREAM_GENERIC, client_error_event

    leaky = {"error": {"message": "engine-d0 at 10.0.0.5:8100 failed", "type": "a/b",
                       "param": "10.0.0.5:8100", "code": "engine-7f3a9c0d1e2f", "x": 1},
             "id": "cmpl-1"}
    assert client_error_event(leaky) == {"error": {
        "message": STREAM_GENERIC, "type": "server_error", "param": None, "code": None}}
    ok = {"error": {"message": "temperature must be non-negative, got -1.0.",
                    "type": "BadRequestError", "param": "temperature", "code": 400}}
    assert client_error_event(ok) == ok
    assert client_error_event({"error": "engine at 10.0.0.5:8100 died"}) == {"error": {
        "message": STREAM_GENERIC, "type": "server_error", "param": None, "code": None}}
    older = {"object": "error", "message": "boom at 10.0.0.5", "type": "InternalServerError",
             "param": None, "code": 500}
    assert client_error_event(older) == {"object": "error", "message": STREAM_GENERIC,
                                         "type": "InternalServerError", "param": None,
                                         "code": 500}
    assert client_error_event({"choices": [], "usage": {}}) is None


@pytest.mark.parametrize("message", [
    # vLLM 0.32's wording (recorded from a real node: a prompt one token too long)
    ("This model's maximum context length is 16384 tokens. However, your prompt contains at "
     "least 16385 input tokens, which exceeds this limit even without any output tokens. "
     "Please reduce the length of the input prompt. (parameter=input_tokens, value=16385)"),
    # the older wording
    ("This model's maximum context length is 2048 tokens. However, you requested 4000 tokens "
     "(3000 in the messages, 1000 in the completion). Please reduce the length of the "
     "messages or completion."),
])
def test_context_length_messages_reach_the_client(message: str) -> None:
    from kvagent_server.router.common.node_errors import client_message

    assert client_message(message) == message


def test_an_internal_value_still_hides_the_message() -> None:
    from kvagent_server.router.common.node_errors import GENERIC, client_message

    leaky = ("This model's maximum context length is 16384 tokens. (parameter=input_tokens, "
             "value=10.0.0.5)")
    assert client_message(leaky) == GENERIC
