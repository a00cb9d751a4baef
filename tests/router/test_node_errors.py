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
