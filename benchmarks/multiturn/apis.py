"""The workload's chat history as each client API's request. Pure: no I/O.

The driver keeps one chat-format history per conversation (what `/v1/chat/completions`
gets); the other APIs' requests are built from it, so every API sends the same
conversation and only the wire shape and the identity differ. Identity is what each API's
own clients send, never kvagent's session header: chat carries `X-Session-ID` and the
cache token; Messages, Claude Code's `X-Claude-Code-Session-Id`; chained Responses, the
previous response's id (only the new items are sent); full Responses (`responses-full`,
the OpenAI Agents SDK's default) resend every item and name nothing, so the router finds
the conversation by content. A chained turn cannot replace the model's answer with a
replay's recorded one (`--keep-assistant`): the router's stored response holds the answer.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvagent.protocol import CACHE_TOKEN_HEADER, SESSION_HEADER

from .client import chat_body

Message = dict[str, Any]

CHAT, MESSAGES, RESPONSES, RESPONSES_FULL = "chat", "messages", "responses", "responses-full"
APIS = (CHAT, MESSAGES, RESPONSES, RESPONSES_FULL)
#: Request path under the base URL (`.../v1`).
PATHS = {CHAT: "/chat/completions", MESSAGES: "/messages", RESPONSES: "/responses",
         RESPONSES_FULL: "/responses"}
CLAUDE_CODE_SESSION_HEADER = "X-Claude-Code-Session-Id"


def parse_apis(text: str) -> list[str]:
    """`chat,messages,...` as a list in the given order; ValueError names what is wrong."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in APIS]
    if unknown or not names:
        raise ValueError(f"unknown {unknown or 'empty'}; choose from {', '.join(APIS)}")
    if len(set(names)) != len(names):
        raise ValueError(f"an API named twice in {text!r}")
    return names


def row_name(config: str, api: str) -> str:
    """A configuration's row for an API: chat keeps the configuration's own name (so the
    targets and the reference still find `kvagent`), the others get `config:api`."""
    return config if api == CHAT else f"{config}:{api}"


# =========================================================================== translation


def split_system(history: Sequence[Message]) -> tuple[str | None, list[Message]]:
    """Leading system (or developer) messages as one text, and the rest."""
    texts: list[str] = []
    i = 0
    while i < len(history) and history[i].get("role") in ("system", "developer"):
        texts.append(_text(history[i].get("content")))
        i += 1
    return ("\n\n".join(texts) if texts else None), list(history[i:])


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return ""


def _arguments(call: Message) -> dict[str, Any]:
    """A chat tool call's arguments as an object (`{}` when they are not one)."""
    raw = (call.get("function") or {}).get("arguments")
    try:
        value = json.loads(raw) if isinstance(raw, str) else raw
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def messages_tools(tools: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chat function tools as Messages tools (`input_schema` is the parameters schema)."""
    out = []
    for t in tools:
        fn = t.get("function") or {}
        tool: dict[str, Any] = {"name": fn.get("name", "")}
        if fn.get("description") is not None:
            tool["description"] = fn["description"]
        tool["input_schema"] = fn.get("parameters") or {"type": "object"}
        out.append(tool)
    return out


def messages_messages(history: Sequence[Message]) -> list[Message]:
    """Chat messages (after the leading system ones) as Messages messages.

    An assistant message becomes a text block and one `tool_use` block per call; each run
    of `tool` messages becomes one user message of `tool_result` blocks (Anthropic puts
    parallel results in one message). Other system messages stay inline (the router
    accepts them)."""
    out: list[Message] = []
    for msg in history:
        role = msg.get("role")
        if role == "tool":
            block = {"type": "tool_result", "tool_use_id": msg.get("tool_call_id", ""),
                     "content": _text(msg.get("content"))}
            last = out[-1] if out else None
            if (last is not None and last["role"] == "user" and isinstance(last["content"], list)
                    and all(b.get("type") == "tool_result" for b in last["content"])):
                last["content"].append(block)
            else:
                out.append({"role": "user", "content": [block]})
        elif role == "assistant":
            text = _text(msg.get("content"))
            calls = msg.get("tool_calls") or []
            if not calls:
                out.append({"role": "assistant", "content": text})
                continue
            blocks: list[dict[str, Any]] = [{"type": "text", "text": text}] if text else []
            blocks += [{"type": "tool_use", "id": c.get("id", ""),
                        "name": (c.get("function") or {}).get("name", ""),
                        "input": _arguments(c)} for c in calls]
            out.append({"role": "assistant", "content": blocks})
        else:
            out.append({"role": "system" if role == "developer" else role or "user",
                        "content": msg.get("content") if msg.get("content") is not None
                        else ""})
    return out


def messages_body(model: str, history: Sequence[Message], tools: Sequence[dict[str, Any]],
                  max_tokens: int) -> dict[str, Any]:
    """The whole conversation as one streamed Messages request (greedy, like chat's)."""
    system, rest = split_system(history)
    body: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "stream": True,
                            "temperature": 0.0, "messages": messages_messages(rest)}
    if system is not None:
        body["system"] = system
    if tools:
        body["tools"] = messages_tools(tools)
    return body


def responses_tools(tools: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chat function tools as Responses function tools (flat: name, parameters, ...)."""
    out = []
    for t in tools:
        fn = t.get("function") or {}
        tool: dict[str, Any] = {"type": "function", "name": fn.get("name", "")}
        if fn.get("description") is not None:
            tool["description"] = fn["description"]
        tool["parameters"] = fn.get("parameters") or {"type": "object"}
        out.append(tool)
    return out


def response_items(messages: Sequence[Message]) -> list[dict[str, Any]]:
    """Chat messages as Responses input items: an assistant message becomes its text
    (an `output_text` message, if any) then one `function_call` per call; a tool message,
    a `function_call_output`."""
    out: list[dict[str, Any]] = []
    for msg in messages:
        role = msg.get("role")
        if role == "tool":
            out.append({"type": "function_call_output", "call_id": msg.get("tool_call_id", ""),
                        "output": _text(msg.get("content"))})
        elif role == "assistant":
            text = msg.get("content")
            if text is not None and (text or not msg.get("tool_calls")):
                out.append({"type": "message", "role": "assistant",
                            "content": [{"type": "output_text", "text": _text(text)}]})
            out += [{"type": "function_call", "call_id": c.get("id", ""),
                     "name": (c.get("function") or {}).get("name", ""),
                     "arguments": (c.get("function") or {}).get("arguments", "")}
                    for c in msg.get("tool_calls") or []]
        else:
            out.append({"type": "message", "role": role or "user",
                        "content": msg.get("content") if msg.get("content") is not None
                        else ""})
    return out


def responses_body(model: str, instructions: str | None, items: list[dict[str, Any]],
                   tools: Sequence[dict[str, Any]], max_tokens: int,
                   previous_response_id: str | None = None) -> dict[str, Any]:
    """One streamed Responses request. `instructions` and tools go with every turn (a
    chained response does not inherit them)."""
    body: dict[str, Any] = {"model": model, "input": items, "stream": True,
                            "max_output_tokens": max_tokens, "temperature": 0.0}
    if instructions is not None:
        body["instructions"] = instructions
    if tools:
        body["tools"] = responses_tools(tools)
    if previous_response_id is not None:
        body["previous_response_id"] = previous_response_id
    return body


# =========================================================================== one conversation


@dataclass(frozen=True)
class Request:
    """What one turn sends: the path under the base URL, the body, the headers."""

    path: str
    body: dict[str, Any]
    headers: dict[str, str]


@dataclass
class ConversationRequests:
    """Builds each turn's request of one conversation for one API, and keeps what an API
    carries from an answer to the next turn (chat's cache token, the response id).

    `request(history, new)`: `history` is the whole chat history to send, `new` the
    messages this turn added to it (the previous answer's assistant message first, on
    turns after the first). `answered(...)` after a successful turn."""

    api: str
    model: str
    session_id: str
    tools: list[dict[str, Any]]
    max_tokens: int
    cache_token: str | None = None
    response_id: str | None = None

    def __post_init__(self) -> None:
        if self.api not in APIS:
            raise ValueError(f"unknown API {self.api!r}")

    def request(self, history: Sequence[Message], new: Sequence[Message]) -> Request:
        path = PATHS[self.api]
        if self.api == CHAT:
            headers = {SESSION_HEADER: self.session_id}
            if self.cache_token:
                headers[CACHE_TOKEN_HEADER] = self.cache_token
            return Request(path, chat_body(self.model, list(history), self.tools,
                                           self.max_tokens), headers)
        if self.api == MESSAGES:
            return Request(path, messages_body(self.model, history, self.tools,
                                               self.max_tokens),
                           {CLAUDE_CODE_SESSION_HEADER: self.session_id})
        instructions, rest = split_system(history)
        if self.api == RESPONSES_FULL or self.response_id is None:
            return Request(path, responses_body(self.model, instructions, response_items(rest),
                                                self.tools, self.max_tokens), {})
        # Chained: the stored response holds the history and the previous answer's text;
        # send that answer's tool calls (the workload's script, not the model's output) and
        # what came after.
        items = response_items([_calls_only(m) if i == 0 and m.get("role") == "assistant"
                                else m for i, m in enumerate(new)])
        return Request(path, responses_body(self.model, instructions, items, self.tools,
                                            self.max_tokens, self.response_id), {})

    def answered(self, *, cache_token: str | None = None,
                 response_id: str | None = None) -> None:
        self.cache_token = cache_token or None
        self.response_id = response_id or None


def _calls_only(msg: Message) -> Message:
    return {"role": "assistant", "content": None, "tool_calls": msg.get("tool_calls") or []}

