"""A Responses request checked as vLLM's `ResponsesRequest` checks it before any
translation: typed fields converted as vLLM converts them (`lax`), fields vLLM does not
serve refused, `metadata` bounded, `input` present."""

from __future__ import annotations

from typing import Any

from kvagent_server.router.apis.responses.errors import ApiError, bad
from kvagent_server.router.common.lax import coerce, ignored_once

#: Request fields vLLM refuses too (in its default configuration).
_UNSERVED = {
    "background": "background responses are not served by this router; omit 'background'",
    "prompt": "prompt template is not supported",
}
#: Fields vLLM does not know and ignores; the router ignores them too.
_IGNORED = ("conversation",)
#: The OpenAI API's bounds on `metadata` (vLLM checks only that it maps strings to strings).
METADATA_MAX_PAIRS = 16
METADATA_MAX_KEY = 64
METADATA_MAX_VALUE = 512
#: Typed fields, converted as vLLM's request model converts them (`common.lax`).
_INTS = ("max_output_tokens", "max_tool_calls", "top_logprobs", "top_k", "seed",
         "priority")
_NUMBERS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
            "repetition_penalty")
_BOOLS = ("stream", "store", "background", "parallel_tool_calls", "ignore_eos",
          "skip_special_tokens", "include_stop_str_in_output", "include_reasoning")


def lax(body: dict[str, Any]) -> None:
    """Convert `body`'s typed fields in place as vLLM's `ResponsesRequest` does."""
    coerce(body, _INTS, "int")
    coerce(body, _NUMBERS, "number")
    coerce(body, _BOOLS, "bool")


def check_metadata(metadata: Any) -> None:
    """`metadata` as the OpenAI API defines it: at most 16 string pairs, keys up to 64
    characters, values up to 512. It is stored with the Response, so it is bounded."""
    if metadata is None:
        return
    if not isinstance(metadata, dict):
        raise bad("metadata", "must be an object of string keys and string values")
    if len(metadata) > METADATA_MAX_PAIRS:
        raise bad("metadata", f"may hold at most {METADATA_MAX_PAIRS} pairs")
    for key, value in metadata.items():
        if len(key) > METADATA_MAX_KEY:
            raise bad("metadata", f"keys may be at most {METADATA_MAX_KEY} characters")
        if not isinstance(value, str):
            raise bad(f"metadata.{key[:METADATA_MAX_KEY]}", "must be a string")
        if len(value) > METADATA_MAX_VALUE:
            raise bad(f"metadata.{key}",
                      f"may be at most {METADATA_MAX_VALUE} characters")


def check_served(body: dict[str, Any]) -> None:
    lax(body)
    for field, message in _UNSERVED.items():
        if body.get(field):
            raise ApiError(400, message, param=field, code="unsupported_parameter")
    for field in _IGNORED:
        if body.get(field) is not None:
            ignored_once(f"responses:{field}", "ignored the Responses field %r, as vLLM does",
                         field)
    check_metadata(body.get("metadata"))
    if "input" not in body:
        raise ApiError(400, "'input' is required", param="input")
    if not isinstance(body["input"], str | list):
        raise bad("input", "must be a string or a list of items")
