"""A chat answer as the Response stock vLLM builds: output items, usage and the echoed
request fields, shared by whole answers and the stream."""

from __future__ import annotations

import json
from typing import Any

from kvagent_server.router.apis.responses.request import (
    CUSTOM_INPUT_KEY,
    NAMESPACE_SEPARATOR,
    custom_names,
    new_id,
)

#: Keys openai's models write as null, so the echoed request fields have vLLM's shape.
_FUNCTION_TOOL_KEYS = ("name", "parameters", "strict", "type", "allowed_callers", "async",
                       "defer_loading", "description", "output_schema")
_REASONING_KEYS = ("context", "effort", "generate_summary", "mode", "summary")
#: vLLM samples greedily below this temperature.
_GREEDY_BELOW = 1e-5


def response_base(request: dict[str, Any], response_id: str, created_at: int, *, model: Any,
                  status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None
                  ) -> dict[str, Any]:
    """A Response with the request fields vLLM echoes, in its field order."""
    tools = _echo_tools(request.get("tools"))
    choice = request.get("tool_choice") or "auto"
    if not tools and choice == "auto":
        choice = "none"
    reasoning = request.get("reasoning")
    text = request.get("text")
    temperature = _num(request.get("temperature"), 1.0)
    # Greedy sampling ignores top_p, and vLLM echoes the 1.0 it samples with.
    top_p = 1.0 if temperature < _GREEDY_BELOW else _num(request.get("top_p"), 1.0)
    return {
        "id": response_id, "created_at": created_at,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete"
        else None,
        "instructions": request.get("instructions"), "metadata": request.get("metadata"),
        "model": model, "object": "response", "output": output,
        "parallel_tool_calls": request.get("parallel_tool_calls", True) is not False,
        "temperature": temperature, "tool_choice": choice, "tools": tools, "top_p": top_p,
        "background": bool(request.get("background")),
        "max_output_tokens": request.get("max_output_tokens"),
        "max_tool_calls": request.get("max_tool_calls"),
        "previous_response_id": request.get("previous_response_id"), "prompt": None,
        "reasoning": _with_nulls(reasoning, _REASONING_KEYS)
        if isinstance(reasoning, dict) else None,
        "service_tier": request.get("service_tier") or "auto", "status": status,
        "text": {"format": None, "verbosity": None, **text} if isinstance(text, dict) else None,
        "top_logprobs": None, "truncation": request.get("truncation") or "disabled",
        "usage": usage, "user": request.get("user"),
        "presence_penalty": _num(request.get("presence_penalty"), 0.0),
        "frequency_penalty": _num(request.get("frequency_penalty"), 0.0),
        "kv_transfer_params": None, "ec_transfer_params": None,
        "input_messages": None, "output_messages": None,
    }


def _num(value: Any, default: float) -> float:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) \
        else default


def _with_nulls(obj: dict[str, Any], keys: tuple[str, ...]) -> dict[str, Any]:
    return {**dict.fromkeys(keys), **obj}


def _echo_tools(tools: Any) -> list[Any]:
    if not isinstance(tools, list):
        return []
    return [_with_nulls(t, _FUNCTION_TOOL_KEYS) if t.get("type") == "function" else t
            for t in tools if isinstance(t, dict)]


def usage_of(chat_usage: Any) -> dict[str, Any] | None:
    """Chat usage in Responses terms; cached tokens are what the prefill reused."""
    if not isinstance(chat_usage, dict):
        return None
    prompt = int(chat_usage.get("prompt_tokens") or 0)
    completion = int(chat_usage.get("completion_tokens") or 0)
    cached = (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    reasoning = (chat_usage.get("completion_tokens_details") or {}).get("reasoning_tokens") or 0
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0,
                                 "input_tokens_per_turn": [], "cached_tokens_per_turn": []},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": reasoning, "tool_output_tokens": 0,
                                  "output_tokens_per_turn": [],
                                  "tool_output_tokens_per_turn": []},
        "total_tokens": prompt + completion,
    }


def status_of(finish_reason: Any) -> str:
    """vLLM reports only running out of tokens as incomplete."""
    return "incomplete" if finish_reason == "length" else "completed"


def namespaced(flat: str, request: dict[str, Any]) -> tuple[str, str | None]:
    """A namespaced tool's call carries its local name and namespace, as vLLM reports it."""
    for tool in request.get("tools") or ():
        if not (isinstance(tool, dict) and tool.get("type") == "namespace"):
            continue
        prefix = f"{tool.get('name')}{NAMESPACE_SEPARATOR}"
        inner = flat[len(prefix):]
        names = {t.get("name") for t in tool.get("tools") or () if isinstance(t, dict)}
        if flat.startswith(prefix) and inner in names:
            return inner, tool["name"]
    return flat, None


def reasoning_item(item_id: str, text: str, status: str | None) -> dict[str, Any]:
    return {"id": item_id, "summary": [], "type": "reasoning",
            "content": [{"text": text, "type": "reasoning_text"}], "encrypted_content": None,
            "status": status}


def text_part(text: str, logprobs: list[Any] | None) -> dict[str, Any]:
    return {"annotations": [], "text": text, "type": "output_text", "logprobs": logprobs}


def message_item(item_id: str, parts: list[dict[str, Any]], status: str) -> dict[str, Any]:
    return {"id": item_id, "content": parts, "role": "assistant", "status": status,
            "type": "message", "phase": None}


def call_item(item_id: str, call_id: str, name: str, namespace: str | None, arguments: str,
              status: str) -> dict[str, Any]:
    return {"arguments": arguments, "call_id": call_id, "name": name, "type": "function_call",
            "id": item_id, "async": None, "caller": None, "namespace": namespace,
            "status": status}


def custom_call_item(item_id: str, call_id: str, name: str, arguments: str) -> dict[str, Any]:
    """A call of a custom (freeform) tool as vLLM reports it: the one-string function's
    argument as the call's `input` (arguments that are not that shape, as they are)."""
    return {"call_id": call_id, "input": custom_input(arguments), "name": name,
            "type": "custom_tool_call", "id": item_id, "async": None, "caller": None,
            "namespace": None}


def custom_input(arguments: str) -> str:
    try:
        parsed = json.loads(arguments)
    except ValueError:
        return arguments
    value = parsed.get(CUSTOM_INPUT_KEY) if isinstance(parsed, dict) else None
    return value if isinstance(value, str) else arguments


def new_call_id(given: Any) -> str:
    return given if isinstance(given, str) and given else new_id("chatcmpl-tool-")


def response_from_chat(chat: dict[str, Any], *, request: dict[str, Any], response_id: str,
                       created_at: int) -> dict[str, Any]:
    """A whole chat completion as the Response stock vLLM returns for `request`."""
    choices = chat.get("choices") or [{}]
    choice = choices[0]
    message = choice.get("message") or {}
    output: list[dict[str, Any]] = []
    reasoning = message.get("reasoning") or message.get("reasoning_content")
    if reasoning:
        output.append(reasoning_item(new_id("rs_"), reasoning, None))
    if message.get("content"):
        output.append(message_item(new_id("msg_"), [text_part(message["content"], None)],
                                   "completed"))
    custom = custom_names(request.get("tools"))
    for call in message.get("tool_calls") or ():
        fn = call.get("function") or {}
        if fn.get("name") in custom:
            output.append(custom_call_item(new_id("ctc_"), new_call_id(call.get("id")),
                                           fn["name"], fn.get("arguments") or ""))
            continue
        name, namespace = namespaced(fn.get("name") or "", request)
        output.append(call_item(new_id("fc_"), new_call_id(call.get("id")), name, namespace,
                                fn.get("arguments") or "", "completed"))
    response = response_base(request, response_id, created_at,
                             model=chat.get("model", request.get("model")),
                             status=status_of(choice.get("finish_reason")), output=output,
                             usage=usage_of(chat.get("usage")))
    if "kvagent" in chat:
        response["kvagent"] = chat["kvagent"]
    return response


