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


@pytest.mark.parametrize("message", [
    # vLLM 0.32's words, recorded from a stock node (docs/conformance.md)
    ("max_completion_tokens=100000 cannot be greater than max_model_len=16384. Please "
     "request fewer output tokens. (parameter=max_completion_tokens, value=100000)"),
    ("max_output_tokens=100000 cannot be greater than max_model_len=16384. Please request "
     "fewer output tokens. (parameter=max_output_tokens, value=100000)"),
    "The model `nope` does not exist. Valid aliases: kvagent-demo.",
    "The model `nope` does not exist. Valid aliases: meta-llama/Llama-3.1-8B, llama.",
    "kvagent-demo is not a multimodal model",
    "The engine prompt length 20000 exceeds the max_model_len 16384. Please reduce prompt.",
    ("1 validation error:\n  {'type': 'int_from_float', 'loc': 'body.max_tokens', 'msg': "
     "'Input should be a valid integer, got a number with a fractional part', "
     "'input': '4.5'}"),
])
def test_vllm_s_own_words_reach_the_client(message: str) -> None:
    from kvagent_server.router.common.node_errors import client_message

    assert client_message(message) == message


@pytest.mark.parametrize("message", [
    "connection to 10.0.0.5 refused",
    "prefill at localhost:8100 failed",
    "cannot load http://models.internal/x",
    "file /opt/models/llama/config.json not found",
    "error in C:\\models\\x",
    "engine-7f3a9c0d1e2f died",
    "EngineCore failed",
    "kv_transfer_params.remote_host is invalid",
    "cache_salt must be a string",
    "Traceback (most recent call last)",
    "request cmpl-0123456789abcdef0123 failed",
    "node [fe80::1]:8000 is gone",
    "x" * 1001,
    "bad\x00byte",
])
def test_internal_shapes_hide_the_whole_message(message: str) -> None:
    from kvagent_server.router.common.node_errors import GENERIC, client_message

    assert client_message(message) == GENERIC
