"""Anthropic Messages requests as the chat completions body vLLM's own `/v1/messages` builds.

Field for field, so the rendered prompt (and with it the KV the router reuses, and the
greedy output) is the one vLLM would serve. The request is checked first (`validation`);
its errors are `errors.ApiError`.

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

from kvagent_server.router.apis.anthropic.errors import bad
from kvagent_server.router.apis.anthropic.validation import (
    check_options,
    check_prompt_fields,
    check_request,
    lax,
    optional,
)
from kvagent_server.router.common.lax import ignored_once

#: Claude Code's per-request attribution block: a hash per request, so vLLM drops it from
#: the system prompt (it would defeat prefix caching).
BILLING_HEADER = "x-anthropic-billing-header"
#: The demo model's template ignores `reasoning_effort` ("none" renders like any effort).
DEMO_DISABLED_THINKING_EFFORT = "low"
_TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}


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
                texts.append(optional(item, "text", f"{path}.content.{i}.text", "str") or "")
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
                raise bad(f"{path}.tool.name", f"{block['type']} references tool {name!r}, "
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
                raise bad("tool_choice.name", f"no tool named {choice['name']!r} in tools")
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
    check_options(disabled_thinking_effort)
    check_request(body)
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
    check_options(disabled_thinking_effort)
    lax(body)
    check_prompt_fields(body)
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
