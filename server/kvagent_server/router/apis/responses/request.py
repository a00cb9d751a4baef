"""A Responses request as the chat body vLLM's `/v1/responses` would render, and the history
a chained turn starts with."""

from __future__ import annotations

import json
import uuid
from typing import Any

from kvagent_server.router.apis.responses.errors import ApiError, bad
from kvagent_server.router.apis.responses.validation import check_served
from kvagent_server.router.common.lax import ignored_once

#: Tool types that run on OpenAI's side (the Responses `Tool` union of the openai package
#: vLLM 0.32 validates with). vLLM accepts them and shows the model none of them: neither
#: does the router.
BUILTIN_TOOLS = frozenset({
    "web_search", "web_search_2025_08_26", "web_search_preview",
    "web_search_preview_2025_03_11", "file_search", "code_interpreter", "computer",
    "computer_use_preview", "image_generation", "mcp", "local_shell", "shell",
    "apply_patch", "tool_search", "programmatic_tool_calling"})
#: `tool_choice` object types that name no function: vLLM samples as with "auto" (it
#: forces a call only for "required" and a named function or custom tool).
_UNFORCED_CHOICES = frozenset({
    "allowed_tools", "file_search", "web_search_preview", "web_search_preview_2025_03_11",
    "computer", "computer_use_preview", "computer_use", "image_generation",
    "code_interpreter", "mcp", "apply_patch", "shell", "programmatic_tool_calling"})
#: How vLLM shows the model a `custom` (freeform) tool: a function of one string.
CUSTOM_INPUT_KEY = "input"
CUSTOM_PARAMETERS = {
    "type": "object",
    "properties": {CUSTOM_INPUT_KEY: {"type": "string",
                                      "description": "The freeform text payload for this tool."}},
    "required": [CUSTOM_INPUT_KEY],
    "additionalProperties": False,
}
#: vLLM sampling and rendering extras that mean the same in a chat request.
_PASSTHROUGH = ("model", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                "presence_penalty", "frequency_penalty", "seed", "stop", "stop_token_ids",
                "ignore_eos", "logit_bias", "skip_special_tokens", "include_stop_str_in_output",
                "include_reasoning", "chat_template_kwargs", "cache_salt", "priority",
                "vllm_xargs", "parallel_tool_calls")
#: Namespaced tools are shown to the model as `<namespace>__<name>`, as vLLM does.
NAMESPACE_SEPARATOR = "__"


def new_id(prefix: str) -> str:
    """An id the way vLLM makes them: a prefix and 16 random hex digits."""
    return f"{prefix}{uuid.uuid4().hex[:16]}"


def to_chat(body: dict[str, Any], *, previous: list[dict[str, Any]] | None = None
            ) -> dict[str, Any]:
    """The chat completions body whose rendered prompt is the one vLLM's `/v1/responses`
    renders for `body`, chained on `previous` (`history` of the previous response)."""
    check_served(body)
    tools = _chat_tools(body.get("tools"))
    tool_choice = _tool_choice(body.get("tool_choice"), tools,
                               declared=bool(body.get("tools")))
    raw_input = body.get("input")
    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise bad("instructions", "must be a string")
    if instructions:
        messages.append({"role": "system", "content": instructions})
    messages += [m for m in previous or () if m.get("role") != "system"]
    messages += _input_messages(raw_input)
    if not messages:
        raise bad("input", "must hold at least one item")
    chat: dict[str, Any] = {k: body[k] for k in _PASSTHROUGH if body.get(k) is not None}
    chat["messages"] = messages
    if tools:
        chat["tools"] = tools
        chat["tool_choice"] = tool_choice
    if _continues_final(raw_input):
        chat["add_generation_prompt"] = False
        chat["continue_final_message"] = True
    max_out = body.get("max_output_tokens")
    if max_out is not None:
        if not (isinstance(max_out, int) and not isinstance(max_out, bool) and max_out >= 0):
            raise bad("max_output_tokens", "must be a non-negative integer")
        chat["max_tokens"] = max_out
    effort = _reasoning_effort(body.get("reasoning"))
    if effort is not None:
        chat["reasoning_effort"] = effort
    structured = _structured_outputs(body.get("text"))
    if structured is not None:
        chat["structured_outputs"] = structured
    elif body.get("structured_outputs") is not None:
        chat["structured_outputs"] = body["structured_outputs"]
    if body.get("stream"):
        chat["stream"] = True
        chat["stream_options"] = {"include_usage": True}
    return chat


def _chat_tools(tools: Any) -> list[dict[str, Any]]:
    """Responses tools as chat function tools (namespaces flattened, as vLLM shows them)."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise bad("tools", "must be a list")
    out: list[dict[str, Any]] = []
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind == "function":
            out.append(_chat_function(tool, f"tools[{i}]"))
        elif kind == "namespace" and isinstance(tool.get("name"), str):
            for j, inner in enumerate(tool.get("tools") or []):
                if isinstance(inner, dict) and inner.get("type") == "function":
                    flat = {**inner, "name": _flat_name(tool["name"], inner.get("name"))}
                    out.append(_chat_function(flat, f"tools[{i}].tools[{j}]"))
        elif kind == "custom":
            out.append(_custom_function(tool, f"tools[{i}]"))
        elif kind in BUILTIN_TOOLS:
            ignored_once(f"responses:tool:{kind}", "ignored the built-in tool %r (the model "
                         "is shown function tools only, as vLLM does)", kind)
        else:
            raise bad(f"tools[{i}].type", "must be a function, namespace, custom or "
                      "built-in tool type")
    return out


def _custom_function(tool: dict[str, Any], where: str) -> dict[str, Any]:
    """A freeform tool as the one-string function vLLM shows the model; a grammar format
    is refused in vLLM's words."""
    fmt = tool.get("format")
    if isinstance(fmt, dict) and fmt.get("type") == "grammar":
        raise ApiError(400, "Custom tools with a grammar format are not supported; only "
                       "free-form text custom tools are accepted.", param="tools")
    if not isinstance(tool.get("name"), str) or not tool["name"]:
        raise bad(f"{where}.name", "must be a non-empty string")
    return {"type": "function", "function": {
        "name": tool["name"], "description": tool.get("description"),
        "parameters": CUSTOM_PARAMETERS}}


def custom_names(tools: Any) -> frozenset[str]:
    """The names of a request's custom tools (their calls are `custom_tool_call` items)."""
    return frozenset(t["name"] for t in tools or () if isinstance(t, dict)
                     and t.get("type") == "custom" and isinstance(t.get("name"), str))


def _chat_function(tool: dict[str, Any], where: str) -> dict[str, Any]:
    if not isinstance(tool.get("name"), str) or not tool["name"]:
        raise bad(f"{where}.name", "must be a non-empty string")
    if tool.get("parameters") is not None and not isinstance(tool["parameters"], dict):
        raise bad(f"{where}.parameters", "must be an object")
    fn = {"name": tool["name"], "description": tool.get("description"),
          "parameters": tool.get("parameters")}
    for key in ("strict", "defer_loading"):
        if tool.get(key) is not None:
            fn[key] = tool[key]
    return {"type": "function", "function": fn}


def _flat_name(namespace: str, name: Any) -> str:
    if not isinstance(name, str):
        raise bad("tools", "namespace tools must have names")
    return f"{namespace}{NAMESPACE_SEPARATOR}{name}"


def _tool_choice(choice: Any, tools: list[dict[str, Any]], *, declared: bool) -> Any:
    """The chat tool_choice; without tools vLLM serves `auto`/`none` as `none`, and a
    choice that names no function (allowed tools, a built-in) as `auto`. `declared`:
    the request listed tools, callable by the model or not."""
    choice = "auto" if choice is None else choice
    names = [t["function"]["name"] for t in tools]
    if isinstance(choice, dict) and choice.get("type") in _UNFORCED_CHOICES:
        ignored_once(f"responses:tool_choice:{choice['type']}", "served tool_choice type %r "
                     "as 'auto', as vLLM does", choice["type"])
        choice = "auto"
    if isinstance(choice, str):
        if choice not in ("auto", "none", "required"):
            raise bad("tool_choice", "must be 'auto', 'none', 'required' or a function")
        if not tools and choice == "required":
            if declared:
                raise ApiError(400, "tool_choice requires a function call, but tools "
                               "contains no function tool the model can call.",
                               param="tool_choice")
            raise ApiError(400, "Tool choice 'required' must be specified with 'tools' "
                           "parameter.", param="tool_choice")
        return choice if tools else "none"
    if not isinstance(choice, dict) or choice.get("type") not in ("function", "custom"):
        raise ApiError(400, "'tool_choice': must be 'auto', 'none', 'required', a function "
                       "or custom tool, or a tool type", param="tool_choice")
    name = _resolve_tool_name(choice.get("name"), names)
    return {"type": "function", "function": {"name": name}}


def _resolve_tool_name(name: Any, names: list[str]) -> str:
    """A named tool choice may name a namespaced tool by its local name, if unambiguous."""
    if isinstance(name, str) and name in names:
        return name
    local = [n for n in names if n.endswith(f"{NAMESPACE_SEPARATOR}{name}")]
    if len(local) == 1:
        return local[0]
    if len(local) > 1:
        raise ApiError(400, f"Tool choice '{name}' is ambiguous: it is defined in more than "
                       f"one namespace ({', '.join(local)}).", param="tool_choice")
    raise ApiError(400, "Tool choice 'function' not found in 'tools' parameter.",
                   param="tool_choice")


def _reasoning_effort(reasoning: Any) -> str | None:
    if reasoning is None:
        return None
    if not isinstance(reasoning, dict):
        raise bad("reasoning", "must be an object")
    effort = reasoning.get("effort")
    if effort is not None and not isinstance(effort, str):
        raise bad("reasoning.effort", "must be a string")
    return effort


def _structured_outputs(text: Any) -> dict[str, Any] | None:
    """`text.format` as vLLM's structured outputs (left out of the prompt, as vLLM does)."""
    if text is None:
        return None
    if not isinstance(text, dict):
        raise bad("text", "must be an object")
    fmt = text.get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        schema = fmt.get("schema")
        if not isinstance(schema, dict):
            raise bad("text.format.schema", "must be an object")
        return {"json": schema}
    if kind == "text":
        return None
    raise bad("text.format.type", "must be 'text', 'json_object' or 'json_schema'")


def _continues_final(raw_input: Any) -> bool:
    """vLLM continues (rather than answers) a last assistant or reasoning item that is
    still in progress or incomplete."""
    if not isinstance(raw_input, list) or not raw_input or not isinstance(raw_input[-1], dict):
        return False
    last = raw_input[-1]
    return (last.get("type") or "message") in ("message", "reasoning") and last.get(
        "status") in ("in_progress", "incomplete")


def _input_messages(raw_input: Any) -> list[dict[str, Any]]:
    """Input items as chat messages; consecutive reasoning, message and function call items
    of the assistant merge into one message, as vLLM merges them."""
    if isinstance(raw_input, str):
        return [{"role": "user", "content": raw_input}]
    out: list[dict[str, Any]] = []
    for i, item in enumerate(raw_input):
        if not isinstance(item, dict):
            raise bad(f"input[{i}]", "must be an object")
        prev = out[-1] if out and out[-1].get("role") == "assistant" else None
        message = _item_message(item, f"input[{i}]", prev)
        if message is not None:
            out.append(message)
    return out


def _item_message(item: dict[str, Any], where: str, prev: dict[str, Any] | None
                  ) -> dict[str, Any] | None:
    """One input item as a new chat message, or None when it merged into `prev`."""
    kind = item.get("type")
    if kind in ("function_call", "custom_tool_call"):
        call = _tool_call(item, where)
        if prev is not None:
            prev.setdefault("tool_calls", []).append(call)
            return None
        return {"role": "assistant", "tool_calls": [call]}
    if kind == "reasoning":
        text = _reasoning_text(item, where)
        if prev is not None and prev.get("reasoning") is None:
            prev["reasoning"] = text
            return None
        return {"role": "assistant", "reasoning": text}
    if kind in ("function_call_output", "custom_tool_call_output"):
        if not isinstance(item.get("call_id"), str):
            raise bad(f"{where}.call_id", "must be a string")
        return {"role": "tool", "content": _content(item.get("output"), f"{where}.output"),
                "tool_call_id": item["call_id"]}
    if kind not in (None, "message"):
        raise ApiError(400, f"Unsupported input item type: {kind}", param="input")
    role = item.get("role")
    if role == "assistant":
        text = _assistant_text(item.get("content"), f"{where}.content")
        if prev is not None and prev.get("content") is None:
            prev["content"] = text
            return None
        return {"role": "assistant", "content": text}
    if role not in ("user", "system", "developer"):
        raise bad(f"{where}.role", "must be 'user', 'assistant', 'system' or 'developer'")
    return {"role": role, "content": _content(item.get("content"), f"{where}.content")}


def _tool_call(item: dict[str, Any], where: str) -> dict[str, Any]:
    for key in ("call_id", "name"):
        if not isinstance(item.get(key), str):
            raise bad(f"{where}.{key}", "must be a string")
    name = item["name"]
    if item["type"] == "custom_tool_call":
        args = json.dumps({"input": item.get("input") or ""}, ensure_ascii=False)
    else:
        if not isinstance(item.get("arguments"), str):
            raise bad(f"{where}.arguments", "must be a string")
        args = item["arguments"]
        if item.get("namespace"):
            name = _flat_name(item["namespace"], name)
    return {"id": item["call_id"], "type": "function",
            "function": {"name": name, "arguments": args}}


def _reasoning_text(item: dict[str, Any], where: str) -> str:
    """vLLM replays a reasoning item's first content text, else its first summary text;
    it cannot read encrypted reasoning, and says so."""
    if item.get("encrypted_content"):
        raise ApiError(400, "Encrypted content is not supported.", param="input")
    for key in ("content", "summary"):
        parts = item.get(key)
        if parts:
            if not isinstance(parts, list) or not isinstance(parts[0], dict):
                raise bad(f"{where}.{key}", "must be a list of parts")
            text = parts[0].get("text")
            if not isinstance(text, str):
                raise bad(f"{where}.{key}[0].text", "must be a string")
            return text
    return ""


def _assistant_text(content: Any, where: str) -> str:
    """vLLM replays only the first part of an assistant message. An empty list is an
    empty message (vLLM 0.32 fails on it with a 500)."""
    if isinstance(content, str):
        return content
    if content == [] or content is None:
        return ""
    if not isinstance(content, list) or not isinstance(content[0], dict):
        raise bad(where, "must be a string or a list of parts")
    text = content[0].get("text", content[0].get("refusal"))
    if not isinstance(text, str):
        raise bad(f"{where}[0].text", "must be a string")
    return text


def _content(content: Any, where: str) -> str | list[dict[str, Any]]:
    """Message or tool output content as chat content: vLLM renders `input_text` and
    `output_text` parts as text parts, `input_image` as an image."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad(where, "must be a string or a list of parts")
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text"):
            if not isinstance(part.get("text"), str):
                raise bad(f"{where}[{j}].text", "must be a string")
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "input_image" and isinstance(part.get("image_url"), str):
            parts.append({"type": "image_url", "image_url": {"url": part["image_url"]}})
        else:
            raise bad(f"{where}[{j}].type", "must be 'input_text' or 'input_image' "
                      "(with an image_url)")
    return parts


def history(chat_body: dict[str, Any], response: dict[str, Any]) -> list[dict[str, Any]]:
    """The messages a turn chained on `response` starts with: this turn's messages without
    `system` ones (instructions do not carry over), then the response's output items as a
    client that keeps its own history would send them back as input.

    So a chained turn's prompt is the prompt of the same conversation sent whole, and either
    style reuses the other's KV. vLLM 0.32's own `previous_response_id` differs here: it
    replays only the output's text, dropping its function calls and reasoning, so a
    `function_call_output` that follows reaches the model with no call before it."""
    out = [m for m in chat_body.get("messages", ()) if m.get("role") != "system"]
    return out + _input_messages(list(response.get("output") or ()))
