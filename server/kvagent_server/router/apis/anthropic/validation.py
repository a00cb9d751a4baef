"""A Messages (or count_tokens) request checked as vLLM's `AnthropicMessagesRequest` checks
it: typed fields converted as vLLM converts them (`lax`), then each field's type and
bounds, with an `ApiError` 400 naming the field."""

from __future__ import annotations

from typing import Any

from kvagent_server.router.apis.anthropic.errors import bad
from kvagent_server.router.common.lax import coerce

#: The content block types vLLM accepts (others are a 400).
BLOCK_TYPES = frozenset({"text", "image", "tool_use", "tool_result", "tool_reference",
                         "thinking", "redacted_thinking", "tool_addition", "tool_removal"})
#: `output_config.effort` values, and what `thinking.type: disabled` may map to.
EFFORTS = ("low", "medium", "high", "xhigh", "max")
DISABLED_EFFORTS = ("none", *EFFORTS)
#: Anthropic's minimum thinking budget.
MIN_THINKING_BUDGET = 1024


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def optional(body: dict[str, Any], key: str, path: str, kind: str) -> Any:
    """`body[key]` (None when absent or null), checked to be of `kind`."""
    value = body.get(key)
    if value is None:
        return None
    ok = {"str": isinstance(value, str), "bool": isinstance(value, bool),
          "int": is_int(value), "number": is_number(value),
          "object": isinstance(value, dict), "list": isinstance(value, list)}[kind]
    if not ok:
        article = "an" if kind[0] in "aeiou" else "a"
        raise bad(path, f"must be {article} {kind}" if kind != "str" else "must be a string")
    return value


def as_object(value: Any, path: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise bad(path, "must be an object")
    checked: dict[str, Any] = value
    return checked


def as_dict(value: Any) -> dict[str, Any]:
    """`value` when it is an object, else an empty one (node answers are read leniently)."""
    return value if isinstance(value, dict) else {}


def _check_block(value: Any, path: str) -> dict[str, Any]:
    """One content block, with the field types vLLM's model enforces."""
    block = as_object(value, path)
    kind = block.get("type")
    if not isinstance(kind, str):
        raise bad(f"{path}.type", "is required (a string)")
    if kind not in BLOCK_TYPES:
        raise bad(f"{path}.type", f"unsupported content block type {kind!r} "
                  f"(expected one of {', '.join(sorted(BLOCK_TYPES))})")
    for key in ("text", "id", "tool_use_id", "name", "thinking", "signature", "data"):
        optional(block, key, f"{path}.{key}", "str")
    optional(block, "source", f"{path}.source", "object")
    optional(block, "input", f"{path}.input", "object")
    optional(block, "is_error", f"{path}.is_error", "bool")
    content = block.get("content")
    if content is not None and not isinstance(content, str):
        if not isinstance(content, list):
            raise bad(f"{path}.content", "must be a string or a list of blocks")
        for i, item in enumerate(content):
            as_object(item, f"{path}.content.{i}")
    if kind in ("tool_addition", "tool_removal"):
        _check_tool_change(block, kind, path)
    return block


def _check_tool_change(block: dict[str, Any], kind: str, path: str) -> None:
    change = as_object(block.get("tool"), f"{path}.tool")
    change_type = change.get("type")
    if change_type == "tool_reference":
        if not isinstance(change.get("name"), str):
            raise bad(f"{path}.tool.name", "is required (a string)")
    elif change_type == "tool_definition":
        if kind == "tool_removal":
            raise bad(f"{path}.tool.type", "tool_removal only accepts a tool_reference")
        _check_tool(change.get("definition"), f"{path}.tool.definition")
    else:
        raise bad(f"{path}.tool.type", "must be 'tool_reference' or 'tool_definition'")


def _check_content(content: Any, path: str, *, role: str) -> list[dict[str, Any]] | str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad(path, "must be a string or a list of content blocks")
    blocks = [_check_block(b, f"{path}.{i}") for i, b in enumerate(content)]
    if role != "system":
        for i, b in enumerate(blocks):
            if b["type"] in ("tool_addition", "tool_removal"):
                raise bad(f"{path}.{i}.type", f"{b['type']} blocks are only allowed in "
                          "messages with role 'system'")
    return blocks


def _check_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    messages = body.get("messages")
    if messages is None:
        raise bad("messages", "is required")
    if not isinstance(messages, list) or not messages:
        raise bad("messages", "must be a non-empty list")
    for i, msg in enumerate(messages):
        msg = as_object(msg, f"messages.{i}")
        role = msg.get("role")
        if role not in ("user", "assistant", "system"):
            raise bad(f"messages.{i}.role", "must be 'user', 'assistant' or 'system'")
        if "content" not in msg:
            raise bad(f"messages.{i}.content", "is required")
        _check_content(msg["content"], f"messages.{i}.content", role=role)
    return messages


def _check_tool(value: Any, path: str) -> dict[str, Any]:
    tool = as_object(value, path)
    if not isinstance(tool.get("name"), str):
        raise bad(f"{path}.name", "is required (a string)")
    optional(tool, "description", f"{path}.description", "str")
    if not isinstance(tool.get("input_schema"), dict):
        raise bad(f"{path}.input_schema", "is required (an object)")
    optional(tool, "strict", f"{path}.strict", "bool")
    optional(tool, "defer_loading", f"{path}.defer_loading", "bool")
    return tool


def check_prompt_fields(body: dict[str, Any]) -> None:
    """The fields a Messages and a count_tokens request share."""
    model = body.get("model")
    if model is None:
        raise bad("model", "is required")
    if not isinstance(model, str) or not model:
        raise bad("model", "must be a non-empty string")
    _check_messages(body)
    system = body.get("system")
    if system is not None:
        _check_content(system, "system", role="user")
    tools = optional(body, "tools", "tools", "list")
    for i, tool in enumerate(tools or []):
        _check_tool(tool, f"tools.{i}")
    choice = optional(body, "tool_choice", "tool_choice", "object")
    if choice is not None:
        if choice.get("type") not in ("auto", "any", "tool", "none"):
            raise bad("tool_choice.type", "must be 'auto', 'any', 'tool' or 'none'")
        name = optional(choice, "name", "tool_choice.name", "str")
        if choice["type"] == "tool" and not name:
            raise bad("tool_choice.name", "is required when type is 'tool'")
        optional(choice, "disable_parallel_tool_use",
                 "tool_choice.disable_parallel_tool_use", "bool")
    thinking = optional(body, "thinking", "thinking", "object")
    if thinking is not None:
        kind = thinking.get("type")
        if kind not in ("enabled", "disabled", "adaptive"):
            raise bad("thinking.type", "must be 'enabled', 'disabled' or 'adaptive'")
        if kind == "enabled":
            budget = thinking.get("budget_tokens")
            if not is_int(budget) or budget < MIN_THINKING_BUDGET:
                raise bad("thinking.budget_tokens",
                          f"must be an integer of at least {MIN_THINKING_BUDGET}")
    config = optional(body, "output_config", "output_config", "object")
    if config is not None:
        effort = config.get("effort")
        if effort is not None and effort not in EFFORTS:
            raise bad("output_config.effort", f"must be one of {', '.join(EFFORTS)}")
        fmt = optional(config, "format", "output_config.format", "object")
        if fmt is not None:
            if fmt.get("type", "json_schema") != "json_schema":
                raise bad("output_config.format.type", "must be 'json_schema'")
            optional(fmt, "schema", "output_config.format.schema", "object")
    optional(body, "chat_template_kwargs", "chat_template_kwargs", "object")


def lax(body: dict[str, Any]) -> None:
    """Convert `body`'s typed fields in place as vLLM's `AnthropicMessagesRequest` does."""
    coerce(body, ("max_tokens", "top_k"), "int")
    coerce(body, ("temperature", "top_p"), "number")
    coerce(body, ("stream", "watermarking"), "bool")
    for key, name, kind in (("thinking", "budget_tokens", "int"),
                            ("tool_choice", "disable_parallel_tool_use", "bool")):
        if isinstance(body.get(key), dict):
            coerce(body[key], (name,), kind)


def check_request(body: dict[str, Any]) -> None:
    """A Messages request: the shared fields, then sampling."""
    lax(body)
    check_prompt_fields(body)
    max_tokens = body.get("max_tokens")
    if max_tokens is None:
        raise bad("max_tokens", "is required")
    if not is_int(max_tokens) or max_tokens <= 0:
        raise bad("max_tokens", "must be a positive integer")
    stops = optional(body, "stop_sequences", "stop_sequences", "list")
    for i, stop in enumerate(stops or []):
        if not isinstance(stop, str):
            raise bad(f"stop_sequences.{i}", "must be a string")
    optional(body, "stream", "stream", "bool")
    for key in ("temperature", "top_p"):
        optional(body, key, key, "number")
    optional(body, "top_k", "top_k", "int")
    optional(body, "metadata", "metadata", "object")
    optional(body, "vllm_xargs", "vllm_xargs", "object")
    optional(body, "watermarking", "watermarking", "bool")
    thinking = body.get("thinking") or {}
    if thinking.get("type") == "enabled" and thinking["budget_tokens"] >= max_tokens:
        raise bad("thinking.budget_tokens", "must be less than max_tokens")


def check_options(disabled_thinking_effort: str) -> None:
    if disabled_thinking_effort not in DISABLED_EFFORTS:
        raise ValueError(f"disabled_thinking_effort must be one of {DISABLED_EFFORTS}")
