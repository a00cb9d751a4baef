"""A whole chat completion as the Anthropic message vLLM's `/v1/messages` returns."""

from __future__ import annotations

import json
import uuid
from typing import Any

from kvagent_server.router.apis.anthropic.errors import error_body, error_type
from kvagent_server.router.apis.anthropic.validation import as_dict, is_int


def message_id(chat_id: Any) -> str:
    """The message id for a chat completion id: `chatcmpl-X` becomes `msg_X` (vLLM keeps
    the chat id; Anthropic's ids start with `msg_`)."""
    if not isinstance(chat_id, str) or not chat_id:
        return f"msg_{uuid.uuid4().hex}"
    if chat_id.startswith("msg_"):
        return chat_id
    return "msg_" + chat_id.removeprefix("chatcmpl-")


def usage(chat_usage: Any) -> dict[str, int]:
    """Anthropic usage from chat usage: `input_tokens` excludes the cached (read or
    created) tokens, which are reported only when the node reports them."""
    if not isinstance(chat_usage, dict):
        return {"input_tokens": 0, "output_tokens": 0}
    out = {"output_tokens": int(chat_usage.get("completion_tokens") or 0)}
    prompt = int(chat_usage.get("prompt_tokens") or 0)
    details = chat_usage.get("prompt_tokens_details")
    if isinstance(details, dict):
        for src, dst in (("cached_tokens", "cache_read_input_tokens"),
                         ("created_cache_tokens", "cache_creation_input_tokens")):
            if details.get(src) is not None:
                prompt -= int(details[src])
                out[dst] = int(details[src])
    return {"input_tokens": max(0, prompt), **out}


def stop_reason(finish_reason: Any, chat_stop_reason: Any, *, tool_used: bool,
                tool_complete: bool) -> tuple[str | None, str | None]:
    """(stop_reason, stop_sequence): the token limit wins; then complete tool calls; then
    a matched stop string (chat's `stop_reason` as a string; a stop token id is not one);
    then any tool call, which a stop string may have cut short."""
    if finish_reason == "length":
        return "max_tokens", None
    if finish_reason not in ("stop", "tool_calls"):
        return None, None
    if tool_complete:
        return "tool_use", None
    if isinstance(chat_stop_reason, str):
        return "stop_sequence", chat_stop_reason
    if finish_reason == "tool_calls" or tool_used:
        return "tool_use", None
    return "end_turn", None


def _tool_input(arguments: Any) -> dict[str, Any]:
    """A tool call's arguments as the `input` object (`{}` when they are not one: a
    client would otherwise fail on the whole answer)."""
    if isinstance(arguments, dict):
        return arguments
    try:
        value = json.loads(arguments) if isinstance(arguments, str) else None
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def reasoning_of(message: dict[str, Any]) -> Any:
    return message.get("reasoning") or message.get("reasoning_content")


def message_from_chat(chat: dict[str, Any], *, model: str) -> dict[str, Any]:
    """A whole chat completion as the message vLLM's `/v1/messages` returns (which leaves
    out a null `stop_reason` and `stop_sequence`; Anthropic's clients read them as null)."""
    choices = chat.get("choices") or [{}]
    choice = as_dict(choices[0])
    message = as_dict(choice.get("message"))
    calls = [c for c in message.get("tool_calls") or [] if isinstance(c, dict)]
    content: list[dict[str, Any]] = []
    reasoning = reasoning_of(message)
    if reasoning:
        content.append({"type": "thinking", "thinking": reasoning,
                        "signature": uuid.uuid4().hex})
    if message.get("content"):
        content.append({"type": "text", "text": message["content"]})
    for call in calls:
        function = call.get("function") or {}
        content.append({"type": "tool_use", "id": call.get("id") or "",
                        "name": function.get("name") or "",
                        "input": _tool_input(function.get("arguments"))})
    if not content:
        content.append({"type": "text", "text": ""})
    reason, sequence = stop_reason(choice.get("finish_reason"), choice.get("stop_reason"),
                                   tool_used=bool(calls), tool_complete=bool(calls))
    out: dict[str, Any] = {
        "id": message_id(chat.get("id")), "type": "message", "role": "assistant",
        "model": model, "content": content, "stop_reason": reason,
        "stop_sequence": sequence, "usage": usage(chat.get("usage")),
    }
    for name in ("stop_reason", "stop_sequence"):
        if out[name] is None:
            del out[name]
    if "kvagent" in chat:
        out["kvagent"] = chat["kvagent"]
    return out


def is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def stream_error(error: Any) -> dict[str, Any]:
    """A chat stream's error object as Anthropic's: the type from its status code."""
    error = error if isinstance(error, dict) else {"message": str(error)}
    code = error.get("code")
    kind = error_type(code) if is_int(code) else "api_error"
    return error_body(kind, str(error.get("message") or "internal error"))


