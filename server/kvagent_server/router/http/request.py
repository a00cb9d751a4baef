"""The client's request: parsing, validation, session and token, OpenAI-shaped errors.

Everything here runs before any node is contacted; a request that fails here never
reaches vLLM.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
from typing import Any

from kvagent.protocol import (
    BODY_CACHE_TOKEN,
    BODY_FIELD,
    BODY_SESSION_ID,
    CACHE_TOKEN_HEADER,
    CONVERSATION_ID_ALIAS,
    MAX_TOKEN_BYTES,
    SESSION_HEADER,
    valid_session_id,
)
from starlette.requests import Request
from starlette.responses import JSONResponse

from kvagent_server.router.auth.tenancy import AuthError, Tenant, TenantResolver
from kvagent_server.router.common.lax import coerce
from kvagent_server.router.reuse.transfer import INTERNAL_FIELDS

#: Body fields a client must not set: they would make a node pull or push KV blocks the
#: router did not vet (another tenant's, say). `cache_salt` is always the tenant's.
CLIENT_FORBIDDEN = INTERNAL_FIELDS
#: Fields a client must not choose for the nodes: vLLM names its request after
#: `request_id`, so a client's own could collide with another's on a node (the nodes then
#: name each request themselves).
CLIENT_DROPPED = ("request_id",)


class HTTPError(Exception):
    """An error answered to the client in OpenAI's error format."""

    def __init__(self, status: int, message: str, *, type_: str = "invalid_request_error",
                 code: str | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = (
            status, message, type_, code, param)

    def response(self) -> JSONResponse:
        resp = error_response(self.status, self.message, type_=self.type, code=self.code,
                              param=self.param)
        if self.status == 429:
            resp.headers["Retry-After"] = "1"
        return resp


def error_response(status: int, message: str, *, type_: str = "invalid_request_error",
                   code: str | None = None, param: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": type_, "param": param,
                                   "code": code if code is not None else status}},
                        status_code=status)


class ClientGone(Exception):
    """The client disconnected before its response started."""


#: A JSON escape of a UTF-16 surrogate: legal JSON, but a lone one cannot be re-encoded as
#: UTF-8 when the body is forwarded (checked precisely only when this matches).
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


async def read_json(request: Request, limit: int,
                    timeout_s: float | None = None) -> dict[str, Any]:
    """The request body as a JSON object: 413 over `limit` bytes, 400 when malformed, 408
    when it does not arrive within `timeout_s` (a slow body holds a connection and a task).

    Strict JSON only: no NaN/Infinity, no lone surrogates (both parse in Python but cannot
    be forwarded), no nesting deep enough to exhaust the parser."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise HTTPError(413, f"request body exceeds {limit} bytes", code="body_too_large")
    chunks: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise HTTPError(413, f"request body exceeds {limit} bytes",
                                    code="body_too_large")
                chunks.append(chunk)
    except TimeoutError:
        raise HTTPError(408, f"request body not received within {timeout_s:g} s",
                        code="body_timeout") from None
    return parse_json(b"".join(chunks))


def parse_json(raw: bytes) -> dict[str, Any]:
    """`raw` as a JSON object, or a 400 that says what is wrong (never the body itself)."""
    try:
        body = json.loads(raw, parse_constant=_no_constant)
    except RecursionError:
        raise HTTPError(400, "request body is nested too deeply") from None
    except UnicodeDecodeError:
        raise HTTPError(400, "request body is not valid UTF-8 JSON") from None
    except ValueError as exc:
        raise HTTPError(400, f"request body is not valid JSON: {_short(exc)}") from None
    if not isinstance(body, dict):
        raise HTTPError(400, "request body must be a JSON object")
    if _SURROGATE_ESCAPE.search(raw):
        try:
            json.dumps(body, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise HTTPError(400, "request body holds a lone UTF-16 surrogate") from None
        except RecursionError:
            raise HTTPError(400, "request body is nested too deeply") from None
    return body


def _short(exc: ValueError) -> str:
    """json's message names a position, never echoes content; keep it one short line."""
    return str(exc).splitlines()[0][:200]


# ------------------------------------------------------------------ validation
#
# The router checks the types of the OpenAI fields it knows, so a wrong type gets a 400
# naming the field before any node is contacted (a node's error would come after a P leg
# ran, and a fake or older server might answer 500). A value vLLM's pydantic model
# converts (`"4"`, `4.0`, `"yes"`) is converted first, as vLLM would (`common.lax`), so
# the router is never stricter than the node. Unknown top-level fields pass through
# unchanged: vLLM accepts many of its own (`top_k`, `min_p`, `guided_json`, ...) and
# ignores, with a warning in its log, those it does not know.

_NUMBERS = ("temperature", "top_p", "presence_penalty", "frequency_penalty",
            "repetition_penalty", "min_p", "length_penalty")
_INTS = ("top_k", "seed", "top_logprobs", "min_tokens", "prompt_logprobs",
         "truncate_prompt_tokens")
_BOOLS = ("stream", "echo", "return_token_ids", "ignore_eos", "skip_special_tokens",
          "add_generation_prompt", "continue_final_message", "parallel_tool_calls",
          "include_stop_str_in_output", "add_special_tokens")
_STRINGS = ("model", "user", "suffix", "chat_template", "reasoning_effort")
_OBJECTS = ("stream_options", "logit_bias", "response_format", "chat_template_kwargs",
            "vllm_xargs", "metadata")
_TOOL_CHOICES = ("none", "auto", "required")
#: Keys of `vllm_xargs` that vLLM copies over the transfer params (only the router sets them).
_XARGS_FORBIDDEN = INTERNAL_FIELDS


def _bad(param: str, message: str) -> HTTPError:
    return HTTPError(400, f"'{param}' {message}", param=param)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return (isinstance(value, int | float) and not isinstance(value, bool)
            and math.isfinite(value))


def validate(body: dict[str, Any], *, chat: bool, max_tokens_limit: int = 1 << 20,
             max_messages: int | None = None, max_tools: int | None = None) -> None:
    """Type checks of the OpenAI fields the router knows; 400 naming the first bad field.

    vLLM still validates values against the model (context length, vocabulary).
    Converts, in place, what vLLM's model would convert (`lax`).
    """
    lax(body, chat=chat)
    if chat:
        _messages(body.get("messages"))
        if max_messages is not None and len(body["messages"]) > max_messages:
            raise HTTPError(400, f"'messages' holds more than {max_messages} messages",
                            param="messages", code="too_many_messages")
        if body.get("tools") is not None:
            _tools(body["tools"])
            if max_tools is not None and len(body["tools"]) > max_tools:
                raise HTTPError(400, f"'tools' holds more than {max_tools} tools",
                                param="tools", code="too_many_tools")
        if body.get("tool_choice") is not None:
            _tool_choice(body["tool_choice"])
        if body.get("logprobs") is not None and not isinstance(body["logprobs"], bool):
            raise _bad("logprobs", "must be a boolean")
    else:
        if "prompt" not in body:
            raise HTTPError(400, "'prompt' is required", param="prompt")
        _prompt(body["prompt"])
        if body.get("logprobs") is not None and not (_is_int(body["logprobs"])
                                                     and body["logprobs"] >= 0):
            raise _bad("logprobs", "must be a non-negative integer")
    _scalars(body)
    for name in ("n", "best_of"):
        value = body.get(name)
        if value is not None and not (_is_int(value) and 1 <= value <= 128):
            raise _bad(name, "must be an integer from 1 to 128")
    for name in ("max_tokens", "max_completion_tokens"):
        value = body.get(name)
        if value is not None and not (_is_int(value) and value >= 0):
            raise _bad(name, "must be a positive integer")
        if value is not None and value > max_tokens_limit:
            raise HTTPError(400, f"'{name}' exceeds this router's limit of {max_tokens_limit}",
                            param=name, code="max_tokens_too_large")
    opts = body.get("stream_options")
    if opts is not None and opts.get("include_usage") is not None and not isinstance(
            opts["include_usage"], bool):
        raise _bad("stream_options.include_usage", "must be a boolean")
    stop = body.get("stop")
    if stop is not None and not (isinstance(stop, str) or (
            isinstance(stop, list) and all(isinstance(s, str) for s in stop))):
        raise _bad("stop", "must be a string or a list of strings")
    ids = body.get("stop_token_ids")
    if ids is not None and not (isinstance(ids, list) and all(_is_int(i) and i >= 0
                                                               for i in ids)):
        raise _bad("stop_token_ids", "must be a list of token ids")
    bias = body.get("logit_bias")
    if bias is not None and not all(_is_number(v) for v in bias.values()):
        raise _bad("logit_bias", "must map token ids to numbers")


def lax(body: dict[str, Any], *, chat: bool) -> None:
    """Convert the typed fields the router knows as vLLM's request models do."""
    coerce(body, _NUMBERS, "number")
    coerce(body, (*_INTS, "n", "best_of", "max_tokens", "max_completion_tokens"), "int")
    coerce(body, _BOOLS, "bool")
    coerce(body, ("logprobs",), "bool" if chat else "int")
    if isinstance(body.get("stream_options"), dict):
        coerce(body["stream_options"], ("include_usage", "continuous_usage_stats"), "bool")


def _scalars(body: dict[str, Any]) -> None:
    for name in _NUMBERS:
        if body.get(name) is not None and not _is_number(body[name]):
            raise _bad(name, "must be a number")
    for name in _INTS:
        if body.get(name) is not None and not _is_int(body[name]):
            raise _bad(name, "must be an integer")
    for name in _BOOLS:
        if body.get(name) is not None and not isinstance(body[name], bool):
            raise _bad(name, "must be a boolean")
    for name in _STRINGS:
        if body.get(name) is not None and not isinstance(body[name], str):
            raise _bad(name, "must be a string")
    for name in _OBJECTS:
        if body.get(name) is not None and not isinstance(body[name], dict):
            raise _bad(name, "must be an object")


def _messages(messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise HTTPError(400, "'messages' must be a non-empty list", param="messages")
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise HTTPError(400, "every message must be an object", param="messages")
        if not isinstance(m.get("role"), str) or not m["role"]:
            raise _bad(f"{where}.role", "must be a non-empty string")
        content = m.get("content")
        if content is not None and not isinstance(content, str):
            if not isinstance(content, list):
                raise _bad(f"{where}.content", "must be a string, a list of parts or null")
            for j, part in enumerate(content):
                if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                    raise _bad(f"{where}.content[{j}]", "must be an object with a 'type'")
                if part["type"] == "text" and not isinstance(part.get("text"), str):
                    raise _bad(f"{where}.content[{j}].text", "must be a string")
        for name in ("name", "tool_call_id", "reasoning", "reasoning_content"):
            if m.get(name) is not None and not isinstance(m[name], str):
                raise _bad(f"{where}.{name}", "must be a string")
        calls = m.get("tool_calls")
        if calls is not None:
            if not isinstance(calls, list):
                raise _bad(f"{where}.tool_calls", "must be a list")
            for j, call in enumerate(calls):
                fn = call.get("function") if isinstance(call, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                    raise _bad(f"{where}.tool_calls[{j}].function.name", "must be a string")
                if not isinstance(fn.get("arguments"), str):
                    raise _bad(f"{where}.tool_calls[{j}].function.arguments",
                               "must be a JSON string")


def _tools(tools: Any) -> None:
    if not isinstance(tools, list):
        raise _bad("tools", "must be a list")
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise _bad(f"{where}.type", "must be 'function'")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise _bad(f"{where}.function", "must be an object")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise _bad(f"{where}.function.name", "must be a non-empty string")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise _bad(f"{where}.function.parameters", "must be a JSON Schema object")
        if fn.get("description") is not None and not isinstance(fn["description"], str):
            raise _bad(f"{where}.function.description", "must be a string")
        if fn.get("strict") is not None and not isinstance(fn["strict"], bool):
            raise _bad(f"{where}.function.strict", "must be a boolean")


def _tool_choice(choice: Any) -> None:
    if isinstance(choice, str):
        if choice not in _TOOL_CHOICES:
            raise _bad("tool_choice", f"must be one of {', '.join(_TOOL_CHOICES)} or an object")
        return
    fn = choice.get("function") if isinstance(choice, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise _bad("tool_choice", "must name a function: {'type': 'function', "
                                  "'function': {'name': ...}}")


def _prompt(prompt: Any) -> None:
    ok = isinstance(prompt, str) or (isinstance(prompt, list) and prompt and (
        all(isinstance(p, str) for p in prompt)
        or all(_is_int(t) and t >= 0 for t in prompt)
        or all(isinstance(p, list) and p and all(_is_int(t) and t >= 0 for t in p)
               for p in prompt)))
    if not ok:
        raise _bad("prompt", "must be a string, a list of strings, or token ids")


#: Where each inline media part type carries its bytes (a URL only when it is `data:`).
_INLINE_PAYLOADS = {"image_url": "url", "video_url": "url", "audio_url": "url",
                    "input_audio": "data", "file": "file_data"}


def check_media(body: dict[str, Any], limit: int) -> None:
    """413 naming the part when one inline media item (a `data:` URL, `input_audio`
    data, `file` data) is over `limit` characters. URLs are not fetched here: the nodes
    load them, so only their string is checked (by the body limit)."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        return
    for i, m in enumerate(messages):
        content = m.get("content") if isinstance(m, dict) else None
        if not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            key = _INLINE_PAYLOADS.get(kind) if isinstance(kind, str) else None
            payload = part.get(kind) if key else None
            data = payload.get(key) if isinstance(payload, dict) else payload
            if not isinstance(data, str):
                continue
            if key == "url" and not data.startswith("data:"):
                continue
            if len(data) > limit:
                param = f"messages[{i}].content[{j}].{kind}.{key}"
                raise HTTPError(413, f"'{param}' is {len(data)} characters; inline media "
                                f"is limited to {limit} per item", param=param,
                                code="media_too_large")


def sanitize(body: dict[str, Any]) -> None:
    """Remove what only the router may set: transfer params, also via `vllm_xargs`."""
    for name in CLIENT_FORBIDDEN + CLIENT_DROPPED:
        body.pop(name, None)
    xargs = body.get("vllm_xargs")
    if isinstance(xargs, dict):
        for name in _XARGS_FORBIDDEN:
            xargs.pop(name, None)


def session_and_token(headers: Any, body: dict[str, Any]) -> tuple[str | None, str | None]:
    """Session id and cache token: headers, then the body `kvagent` object, then
    `conversation_id`. The body forms are removed from `body` (vLLM must not see them)."""
    extra = body.pop(BODY_FIELD, None)
    alias = body.pop(CONVERSATION_ID_ALIAS, None)
    if extra is not None and not isinstance(extra, dict):
        raise HTTPError(400, f"'{BODY_FIELD}' must be an object", param=BODY_FIELD)
    extra = extra or {}
    session = (headers.get(SESSION_HEADER) or extra.get(BODY_SESSION_ID)
               or (alias if alias is not None else None))
    token = headers.get(CACHE_TOKEN_HEADER) or extra.get(BODY_CACHE_TOKEN)
    if session is not None and (not isinstance(session, str) or not valid_session_id(session)):
        raise HTTPError(400, "session id must be 1-128 characters of [A-Za-z0-9._:-]",
                        param=SESSION_HEADER)
    if token is not None and (not isinstance(token, str) or not token):
        token = None
    if token is not None and len(token.encode()) > MAX_TOKEN_BYTES:
        token = "x"  # over-long: rejected as malformed, the turn is recomputed
    return session, token


def tenant_of(request: Request, tenants: TenantResolver) -> Tenant:
    """The caller's tenant, from `Authorization: Bearer` or, as Anthropic's clients send
    their key, `x-api-key`."""
    auth = request.headers.get("authorization")
    api_key = request.headers.get("x-api-key")
    if not auth and api_key:
        auth = f"Bearer {api_key}"
    try:
        return tenants.resolve(auth)
    except AuthError as exc:
        raise HTTPError(401, str(exc), type_="authentication_error", code=exc.reason) from None
