"""Anthropic Messages requests as the chat completions body vLLM's own `/v1/messages` builds.

Field for field, so the rendered prompt (and with it the KV the router reuses, and the
greedy output) is the one vLLM would serve. Also the API's errors: `ApiError` and the
error body its clients parse.

Two results of vLLM's depend on the served model's chat template, which vLLM probes at
startup; they are keyword-only parameters here, defaulting to the demo model's outcome:
`merge_inline_system` (the template rejects a system message after the first turn, so
inline system messages join the leading one) and `disabled_thinking_effort` (the
`reasoning_effort` that `thinking: {"type": "disabled"}` becomes: "none" where the
template renders "none" differently from every effort, else "low").
"""

from __future__ import annotations

import json
from typing import Any

from kvagent_server.router.common.lax import coerce, ignored_once

#: Claude Code's per-request attribution block: a hash per request, so vLLM drops it from
#: the system prompt (it would defeat prefix caching).
BILLING_HEADER = "x-anthropic-billing-header"
#: The content block types vLLM accepts (others are a 400).
BLOCK_TYPES = frozenset({"text", "image", "tool_use", "tool_result", "tool_reference",
                         "thinking", "redacted_thinking", "tool_addition", "tool_removal"})
#: `output_config.effort` values, and what `thinking.type: disabled` may map to.
EFFORTS = ("low", "medium", "high", "xhigh", "max")
DISABLED_EFFORTS = ("none", *EFFORTS)
#: The demo model's template ignores `reasoning_effort` ("none" renders like any effort).
DEMO_DISABLED_THINKING_EFFORT = "low"
#: Anthropic's minimum thinking budget.
MIN_THINKING_BUDGET = 1024
_TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}
_STOP_REASONS = ("end_turn", "max_tokens", "stop_sequence", "tool_use")


# --------------------------------------------------------------------------- errors


class ApiError(Exception):
    """A client error, answered in Anthropic's error shape."""

    def __init__(self, status: int, message: str, *,
                 type_: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status = status
        self.type = type_
        self.message = message


def error_body(type_: str, message: str) -> dict[str, Any]:
    """Anthropic's error object (the body of an error answer and of a streamed `error`)."""
    return {"type": "error", "error": {"type": type_, "message": message}}


_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                402: "billing_error", 403: "permission_error", 404: "not_found_error",
                413: "request_too_large", 429: "rate_limit_error", 504: "timeout_error",
                529: "overloaded_error"}


def error_type(status: int) -> str:
    """Anthropic's error type for an HTTP status, so clients retry (or not) as they would
    against Anthropic: other 4xx are invalid requests, other 5xx `api_error`."""
    if status in _ERROR_TYPES:
        return _ERROR_TYPES[status]
    return "invalid_request_error" if 400 <= status < 500 else "api_error"


def _bad(path: str, message: str) -> ApiError:
    return ApiError(400, f"{path}: {message}")


# --------------------------------------------------------------------------- validation


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _optional(body: dict[str, Any], key: str, path: str, kind: str) -> Any:
    """`body[key]` (None when absent or null), checked to be of `kind`."""
    value = body.get(key)
    if value is None:
        return None
    ok = {"str": isinstance(value, str), "bool": isinstance(value, bool),
          "int": is_int(value), "number": _is_number(value),
          "object": isinstance(value, dict), "list": isinstance(value, list)}[kind]
    if not ok:
        article = "an" if kind[0] in "aeiou" else "a"
        raise _bad(path, f"must be {article} {kind}" if kind != "str" else "must be a string")
    return value


def _object(value: Any, path: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise _bad(path, "must be an object")
    checked: dict[str, Any] = value
    return checked


def as_dict(value: Any) -> dict[str, Any]:
    """`value` when it is an object, else an empty one (node answers are read leniently)."""
    return value if isinstance(value, dict) else {}


def _check_block(value: Any, path: str) -> dict[str, Any]:
    """One content block, with the field types vLLM's model enforces."""
    block = _object(value, path)
    kind = block.get("type")
    if not isinstance(kind, str):
        raise _bad(f"{path}.type", "is required (a string)")
    if kind not in BLOCK_TYPES:
        raise _bad(f"{path}.type", f"unsupported content block type {kind!r} "
                   f"(expected one of {', '.join(sorted(BLOCK_TYPES))})")
    for key in ("text", "id", "tool_use_id", "name", "thinking", "signature", "data"):
        _optional(block, key, f"{path}.{key}", "str")
    _optional(block, "source", f"{path}.source", "object")
    _optional(block, "input", f"{path}.input", "object")
    _optional(block, "is_error", f"{path}.is_error", "bool")
    content = block.get("content")
    if content is not None and not isinstance(content, str):
        if not isinstance(content, list):
            raise _bad(f"{path}.content", "must be a string or a list of blocks")
        for i, item in enumerate(content):
            _object(item, f"{path}.content.{i}")
    if kind in ("tool_addition", "tool_removal"):
        _check_tool_change(block, kind, path)
    return block


def _check_tool_change(block: dict[str, Any], kind: str, path: str) -> None:
    change = _object(block.get("tool"), f"{path}.tool")
    change_type = change.get("type")
    if change_type == "tool_reference":
        if not isinstance(change.get("name"), str):
            raise _bad(f"{path}.tool.name", "is required (a string)")
    elif change_type == "tool_definition":
        if kind == "tool_removal":
            raise _bad(f"{path}.tool.type", "tool_removal only accepts a tool_reference")
        _check_tool(change.get("definition"), f"{path}.tool.definition")
    else:
        raise _bad(f"{path}.tool.type", "must be 'tool_reference' or 'tool_definition'")


def _check_content(content: Any, path: str, *, role: str) -> list[dict[str, Any]] | str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(path, "must be a string or a list of content blocks")
    blocks = [_check_block(b, f"{path}.{i}") for i, b in enumerate(content)]
    if role != "system":
        for i, b in enumerate(blocks):
            if b["type"] in ("tool_addition", "tool_removal"):
                raise _bad(f"{path}.{i}.type", f"{b['type']} blocks are only allowed in "
                           "messages with role 'system'")
    return blocks


def _check_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    messages = body.get("messages")
    if messages is None:
        raise _bad("messages", "is required")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages", "must be a non-empty list")
    for i, msg in enumerate(messages):
        msg = _object(msg, f"messages.{i}")
        role = msg.get("role")
        if role not in ("user", "assistant", "system"):
            raise _bad(f"messages.{i}.role", "must be 'user', 'assistant' or 'system'")
        if "content" not in msg:
            raise _bad(f"messages.{i}.content", "is required")
        _check_content(msg["content"], f"messages.{i}.content", role=role)
    return messages


def _check_tool(value: Any, path: str) -> dict[str, Any]:
    tool = _object(value, path)
    if not isinstance(tool.get("name"), str):
        raise _bad(f"{path}.name", "is required (a string)")
    _optional(tool, "description", f"{path}.description", "str")
    if not isinstance(tool.get("input_schema"), dict):
        raise _bad(f"{path}.input_schema", "is required (an object)")
    _optional(tool, "strict", f"{path}.strict", "bool")
    _optional(tool, "defer_loading", f"{path}.defer_loading", "bool")
    return tool


def _check_prompt_fields(body: dict[str, Any]) -> None:
    """The fields a Messages and a count_tokens request share."""
    model = body.get("model")
    if model is None:
        raise _bad("model", "is required")
    if not isinstance(model, str) or not model:
        raise _bad("model", "must be a non-empty string")
    _check_messages(body)
    system = body.get("system")
    if system is not None:
        _check_content(system, "system", role="user")
    tools = _optional(body, "tools", "tools", "list")
    for i, tool in enumerate(tools or []):
        _check_tool(tool, f"tools.{i}")
    choice = _optional(body, "tool_choice", "tool_choice", "object")
    if choice is not None:
        if choice.get("type") not in ("auto", "any", "tool", "none"):
            raise _bad("tool_choice.type", "must be 'auto', 'any', 'tool' or 'none'")
        name = _optional(choice, "name", "tool_choice.name", "str")
        if choice["type"] == "tool" and not name:
            raise _bad("tool_choice.name", "is required when type is 'tool'")
        _optional(choice, "disable_parallel_tool_use",
                  "tool_choice.disable_parallel_tool_use", "bool")
    thinking = _optional(body, "thinking", "thinking", "object")
    if thinking is not None:
        kind = thinking.get("type")
        if kind not in ("enabled", "disabled", "adaptive"):
            raise _bad("thinking.type", "must be 'enabled', 'disabled' or 'adaptive'")
        if kind == "enabled":
            budget = thinking.get("budget_tokens")
            if not is_int(budget) or budget < MIN_THINKING_BUDGET:
                raise _bad("thinking.budget_tokens",
                           f"must be an integer of at least {MIN_THINKING_BUDGET}")
    config = _optional(body, "output_config", "output_config", "object")
    if config is not None:
        effort = config.get("effort")
        if effort is not None and effort not in EFFORTS:
            raise _bad("output_config.effort", f"must be one of {', '.join(EFFORTS)}")
        fmt = _optional(config, "format", "output_config.format", "object")
        if fmt is not None:
            if fmt.get("type", "json_schema") != "json_schema":
                raise _bad("output_config.format.type", "must be 'json_schema'")
            _optional(fmt, "schema", "output_config.format.schema", "object")
    _optional(body, "chat_template_kwargs", "chat_template_kwargs", "object")


def lax(body: dict[str, Any]) -> None:
    """Convert `body`'s typed fields in place as vLLM's `AnthropicMessagesRequest` does."""
    coerce(body, ("max_tokens", "top_k"), "int")
    coerce(body, ("temperature", "top_p"), "number")
    coerce(body, ("stream", "watermarking"), "bool")
    for key, name, kind in (("thinking", "budget_tokens", "int"),
                            ("tool_choice", "disable_parallel_tool_use", "bool")):
        if isinstance(body.get(key), dict):
            coerce(body[key], (name,), kind)


def _check_request(body: dict[str, Any]) -> None:
    """A Messages request: the shared fields, then sampling."""
    lax(body)
    _check_prompt_fields(body)
    max_tokens = body.get("max_tokens")
    if max_tokens is None:
        raise _bad("max_tokens", "is required")
    if not is_int(max_tokens) or max_tokens <= 0:
        raise _bad("max_tokens", "must be a positive integer")
    stops = _optional(body, "stop_sequences", "stop_sequences", "list")
    for i, stop in enumerate(stops or []):
        if not isinstance(stop, str):
            raise _bad(f"stop_sequences.{i}", "must be a string")
    _optional(body, "stream", "stream", "bool")
    for key in ("temperature", "top_p"):
        _optional(body, key, key, "number")
    _optional(body, "top_k", "top_k", "int")
    _optional(body, "metadata", "metadata", "object")
    _optional(body, "vllm_xargs", "vllm_xargs", "object")
    _optional(body, "watermarking", "watermarking", "bool")
    thinking = body.get("thinking") or {}
    if thinking.get("type") == "enabled" and thinking["budget_tokens"] >= max_tokens:
        raise _bad("thinking.budget_tokens", "must be less than max_tokens")


# --------------------------------------------------------------------------- request


def _system_text(content: str | list[dict[str, Any]], *, strip_string: bool) -> str | None:
    """A system prompt's text: text blocks joined, Claude Code's billing header dropped
    (from a plain string only for inline system messages, as vLLM does)."""
    if isinstance(content, str):
        return None if strip_string and content.startswith(BILLING_HEADER) else content
    parts = [b["text"] for b in content if b["type"] == "text" and b.get("text")
             and not b["text"].startswith(BILLING_HEADER)]
    return "".join(parts) if parts else None


def _leading_system(body: dict[str, Any], *, merge_inline_system: bool) -> list[dict[str, Any]]:
    """The leading system message: the top-level `system`, plus the inline system
    messages when the template wants them merged."""
    parts: list[str] = []
    system = body.get("system")
    if system:
        text = _system_text(system, strip_string=False)
        if text:
            parts.append(text)
    if merge_inline_system:
        for msg in body["messages"]:
            if msg["role"] == "system":
                text = _system_text(msg["content"], strip_string=True)
                if text:
                    parts.append(text)
    return [{"role": "system", "content": "".join(parts)}] if parts else []


def _image_url(source: dict[str, Any]) -> str:
    """An image source as a URL: as given, or a base64 data URI."""
    if source.get("type") == "url":
        return str(source.get("url", ""))
    media_type = source.get("media_type", "image/jpeg")
    return f"data:{media_type};base64,{source.get('data', '')}"


def _tool_call(block: dict[str, Any], fallback_id: str) -> dict[str, Any]:
    """A `tool_use` block as a chat tool call; arguments as `json.dumps` writes them (the
    bytes the template renders must be vLLM's). A missing id gets a fixed one (vLLM's
    holds the clock's seconds)."""
    return {"id": block.get("id") or fallback_id, "type": "function",
            "function": {"name": block.get("name") or "",
                         "arguments": json.dumps(block.get("input") or {})}}


def _tool_result_messages(block: dict[str, Any], path: str) -> list[dict[str, Any]]:
    """A user's `tool_result` as a `tool` message (its text parts joined by newlines), then
    its images as a user message and its tool references as another `tool` message.
    `is_error` does not reach the prompt (vLLM renders it nowhere)."""
    content = block.get("content")
    text = content if isinstance(content, str) else ""
    images: list[str] = []
    refs: list[dict[str, Any]] = []
    if isinstance(content, list):
        texts: list[str] = []
        for i, item in enumerate(content):
            kind = item.get("type")
            if kind == "text":
                texts.append(_optional(item, "text", f"{path}.content.{i}.text", "str") or "")
            elif kind == "image":
                url = _image_url(item.get("source") or {})
                if url:
                    images.append(url)
            elif kind == "tool_reference":
                name = item.get("tool_name") or item.get("name")
                if name:
                    refs.append({"type": "tool_reference", "name": name})
        text = "\n".join(texts)
    call_id = block.get("tool_use_id") or ""
    out: list[dict[str, Any]] = [{"role": "tool", "tool_call_id": call_id, "content": text}]
    if images:
        out.append({"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": url}} for url in images]})
    if refs:
        out.append({"role": "tool", "tool_call_id": call_id, "content": refs})
    return out


def _block_messages(role: str, blocks: list[dict[str, Any]], index: int,
                    out: list[dict[str, Any]]) -> None:
    """A message of blocks as chat messages, appended to `out`: a user's tool results
    first (each its own message), then the message itself with its text and images,
    tool calls and reasoning. A user message left with no content is dropped."""
    parts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    reasoning: list[str] = []
    for i, block in enumerate(blocks):
        kind = block["type"]
        if kind == "text" and block.get("text"):
            parts.append({"type": "text", "text": block["text"]})
        elif kind == "image" and block.get("source"):
            parts.append({"type": "image_url",
                          "image_url": {"url": _image_url(block["source"])}})
        elif kind == "thinking" and block.get("thinking") is not None:
            reasoning.append(block["thinking"])
        elif kind == "tool_use":
            calls.append(_tool_call(block, f"call_{index}_{i}"))
        elif kind == "tool_result" and role == "user":
            out.extend(_tool_result_messages(block, f"messages.{index}.content.{i}"))
        elif kind == "tool_result":
            content = block.get("content")
            # Python's str() of the content, as vLLM writes it.
            parts.append({"type": "text", "text": f"Tool result: {content or ''!s}"})
    msg: dict[str, Any] = {"role": role}
    if reasoning:
        msg["reasoning"] = "".join(reasoning)
    if calls:
        msg["tool_calls"] = calls
    if len(parts) == 1 and parts[0]["type"] == "text":
        msg["content"] = parts[0]["text"]
    elif parts:
        msg["content"] = parts
    if role != "user" or "content" in msg:
        out.append(msg)


def _chat_messages(body: dict[str, Any], *, merge_inline_system: bool) -> list[dict[str, Any]]:
    """The conversation as chat messages, in vLLM's order."""
    out = _leading_system(body, merge_inline_system=merge_inline_system)
    for i, msg in enumerate(body["messages"]):
        role, content = msg["role"], msg["content"]
        if role == "system":
            text = None if merge_inline_system else _system_text(content, strip_string=True)
            if text:
                out.append({"role": "system", "content": text})
        elif isinstance(content, str):
            out.append({"role": role, "content": content})
        else:
            _block_messages(role, content, i, out)
    return out


def _resolved_tools(body: dict[str, Any]) -> list[dict[str, Any]] | None:
    """The tools in effect at the end of the conversation: `tools`, changed by the
    `tool_addition`/`tool_removal` blocks of system messages, in order."""
    tools = body.get("tools")
    changes = [(f"messages.{i}.content.{j}", b) for i, m in enumerate(body["messages"])
               if not isinstance(m["content"], str) for j, b in enumerate(m["content"])
               if b["type"] in ("tool_addition", "tool_removal")]
    if not changes:
        return tools if tools is None else list(tools)
    by_name = {t["name"]: t for t in tools or []}
    removed: set[str] = set()
    for path, block in changes:
        change = block["tool"]
        if change["type"] == "tool_definition":
            name = change["definition"]["name"]
            by_name[name] = change["definition"]
        else:
            name = change["name"]
            if name not in by_name:
                raise _bad(f"{path}.tool.name", f"{block['type']} references tool {name!r}, "
                           "which is not declared in tools")
            if block["type"] == "tool_addition":
                by_name[name] = {k: v for k, v in by_name[name].items()
                                 if k != "defer_loading"}
        if block["type"] == "tool_removal":
            removed.add(name)
        else:
            removed.discard(name)
    return [t for name, t in by_name.items() if name not in removed]


def _chat_tool(tool: dict[str, Any]) -> dict[str, Any]:
    """A Messages tool as a chat function tool (a schema without `type` is an object's)."""
    schema = dict(tool["input_schema"])
    schema.setdefault("type", "object")
    function: dict[str, Any] = {"name": tool["name"]}
    if tool.get("description") is not None:
        function["description"] = tool["description"]
    function["parameters"] = schema
    for key in ("strict", "defer_loading"):
        if tool.get(key) is not None:
            function[key] = tool[key]
    return {"type": "function", "function": function}


def _tool_fields(body: dict[str, Any]) -> dict[str, Any]:
    """`tools`, `tool_choice` and `parallel_tool_calls` of the chat body.

    With tools and no choice, vLLM's default "auto". An empty tool list is no tools (chat
    rejects `[]`); a choice other than "none" without tools is a 400 here, where vLLM's
    own translation would pass it on unchecked."""
    out: dict[str, Any] = {}
    tools = _resolved_tools(body)
    choice = body.get("tool_choice")
    if choice is not None:
        out["parallel_tool_calls"] = not choice.get("disable_parallel_tool_use")
        kind = choice["type"]
        if kind == "tool":
            names = {t["name"] for t in tools or []}
            if choice["name"] not in names:
                raise _bad("tool_choice.name", f"no tool named {choice['name']!r} in tools")
            out["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
        elif kind == "any" and not tools:
            ignored_once("messages:any_without_tools", "served tool_choice 'any' without "
                         "tools as no tool choice, as vLLM does")
        elif tools or kind == "none":
            out["tool_choice"] = _TOOL_CHOICES[kind]
    if tools:
        out["tools"] = [_chat_tool(t) for t in tools]
        out.setdefault("tool_choice", "auto")
    return out


def _reasoning_effort(body: dict[str, Any], disabled_thinking_effort: str) -> str | None:
    """`output_config.effort`, overridden by `thinking.type: disabled`."""
    effort = (body.get("output_config") or {}).get("effort")
    if (body.get("thinking") or {}).get("type") == "disabled":
        effort = disabled_thinking_effort
    return effort


def _response_format(body: dict[str, Any]) -> dict[str, Any] | None:
    fmt = (body.get("output_config") or {}).get("format") or {}
    if not fmt.get("schema"):
        return None
    return {"type": "json_schema", "json_schema": {"name": "json_schema",
                                                   "schema": fmt["schema"]}}


def _check_options(disabled_thinking_effort: str) -> None:
    if disabled_thinking_effort not in DISABLED_EFFORTS:
        raise ValueError(f"disabled_thinking_effort must be one of {DISABLED_EFFORTS}")


def to_chat(body: dict[str, Any], *, merge_inline_system: bool = False,
            disabled_thinking_effort: str = DEMO_DISABLED_THINKING_EFFORT,
            continuous_usage: bool = False) -> dict[str, Any]:
    """The chat completions body vLLM's `/v1/messages` builds from `body` (ApiError 400
    naming the field when `body` is not a valid Messages request).

    Dropped: what only Anthropic reads (`metadata`, `cache_control`, `is_error`,
    `thinking.display`, billing headers) and what only the router may set
    (`kv_transfer_params`, `ec_transfer_params`, `cache_salt`). A stream asks for the
    usage chunk; vLLM asks for per-chunk usage as well (`continuous_usage`), which only
    fills `message_start`'s usage and costs the relay a JSON rewrite per chunk.
    """
    _check_options(disabled_thinking_effort)
    _check_request(body)
    out: dict[str, Any] = {
        "model": body["model"],
        "messages": _chat_messages(body, merge_inline_system=merge_inline_system),
        "max_tokens": body["max_tokens"],
        "max_completion_tokens": body["max_tokens"],
    }
    if body.get("stop_sequences") is not None:
        out["stop"] = list(body["stop_sequences"])
    for key in ("temperature", "top_p", "top_k", "watermarking", "vllm_xargs",
                "chat_template_kwargs"):
        if body.get(key) is not None:
            out[key] = body[key]
    out["stream"] = bool(body.get("stream"))
    if out["stream"]:
        out["stream_options"] = {"include_usage": True}
        if continuous_usage:
            out["stream_options"]["continuous_usage_stats"] = True
    response_format = _response_format(body)
    if response_format is not None:
        out["response_format"] = response_format
    effort = _reasoning_effort(body, disabled_thinking_effort)
    if effort is not None:
        out["reasoning_effort"] = effort
    thinking = body.get("thinking") or {}
    if thinking.get("type") == "enabled":
        out["thinking_token_budget"] = thinking["budget_tokens"]
    out.update(_tool_fields(body))
    return out


def count_tokens_chat(body: dict[str, Any], *, merge_inline_system: bool = False,
                      disabled_thinking_effort: str = DEMO_DISABLED_THINKING_EFFORT
                      ) -> dict[str, Any]:
    """The `/tokenize` chat body whose token count is what vLLM's `count_tokens` answers:
    the prompt `to_chat` would render, with the generation prompt. `/tokenize` takes no
    `reasoning_effort`, so the effort (and the `enable_thinking` vLLM derives from it)
    rides in `chat_template_kwargs`, where vLLM's chat rendering puts it."""
    _check_options(disabled_thinking_effort)
    lax(body)
    _check_prompt_fields(body)
    out: dict[str, Any] = {
        "model": body["model"],
        "messages": _chat_messages(body, merge_inline_system=merge_inline_system),
        "add_generation_prompt": True,
    }
    tools = _tool_fields(body).get("tools")
    if tools:
        out["tools"] = tools
    kwargs = dict(body.get("chat_template_kwargs") or {})
    effort = _reasoning_effort(body, disabled_thinking_effort)
    if effort is not None:
        if "enable_thinking" not in kwargs:
            kwargs["enable_thinking"] = effort != "none"
        kwargs["reasoning_effort"] = effort
    if kwargs:
        out["chat_template_kwargs"] = kwargs
    return out


