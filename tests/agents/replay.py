"""Replay a recorded agent session (tests/agents/fixtures/*.json) against a kvagent router.

Plain functions, no pytest: `replay(load_fixture("codex"), "http://127.0.0.1:8000",
model="kvagent-demo")` sends every request of the fixture in order with its own headers,
reads the answer (SSE or whole JSON), rebuilds it the way that API's client does (Anthropic
Messages: the assistant's content blocks, text and tool_use; OpenAI Responses: the output
items, without the ids a `store: false` client drops), splices it into the later requests
that name it, and returns one `Result` per request: the HTTP status, the `kvagent` reuse
report, the usage's cached-token count.

The fixture format (placeholders, `vars`, `kind`/`reuse`) is described in
tests/agents/fixtures/README.md.
"""

from __future__ import annotations

import copy
import json
import re
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

FIXTURES = Path(__file__).with_name("fixtures")
#: The paths a reuse report may name, and those that mean the turn reused held KV.
PATHS = ("pd_reuse", "d_direct", "d_pull", "pd_fresh", "d_fresh", "recompute", "decode_only")
REUSE_PATHS = ("pd_reuse", "d_direct", "d_pull")

_ANSWER = re.compile(r"^\{\{answer:([\w.-]+)\}\}$")
_INLINE = re.compile(r"\{\{(answer_text|response_id):([\w.-]+)\}\}")
MODEL_MARK = "{{model}}"


@dataclass
class Result:
    """What one replayed request got back."""

    id: str
    agent: str
    kind: str
    reuse: str  # the fixture's expectation: first | required | any | none
    status: int
    kvagent: dict[str, Any] | None = None
    cached_tokens: int | None = None
    input_tokens: int | None = None
    #: Messages: the assistant's content blocks; Responses: the output items (as resent).
    answer: list[dict[str, Any]] = field(default_factory=list)
    text: str = ""
    response_id: str | None = None
    body: Any = None  # a non-streamed answer's JSON (count_tokens, GET /v1/responses/{id})
    error: str | None = None

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300 and self.error is None

    @property
    def reused_tokens(self) -> int:
        return int((self.kvagent or {}).get("reused_tokens") or 0)

    @property
    def path(self) -> str | None:
        return (self.kvagent or {}).get("path")

    def summary(self) -> str:
        return (f"{self.id} [{self.agent}/{self.kind}] status={self.status} path={self.path} "
                f"reused={self.reused_tokens} cached={self.cached_tokens}"
                + (f" error={self.error[:200]}" if self.error else ""))


# ----------------------------------------------------------------------------- fixtures


def load_fixture(name: str | Path) -> dict[str, Any]:
    """A fixture by name (`claude_code`, `codex`) or path."""
    path = Path(name)
    if not path.suffix:
        path = FIXTURES / f"{name}.json"
    data: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    return data


def with_fresh_ids(fixture: dict[str, Any]) -> dict[str, Any]:
    """The fixture with every `vars` value (session, thread, agent ids) replaced by a fresh
    one of the same shape, everywhere it occurs, so replays never share router state."""
    text = json.dumps(fixture)
    for value in (fixture.get("vars") or {}).values():
        text = text.replace(value, _fresh_like(value))
    fresh: dict[str, Any] = json.loads(text)
    return fresh


def _fresh_like(value: str) -> str:
    if re.fullmatch(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", value):
        return str(uuid.uuid4())
    hexdigits = "".join(uuid.uuid4().hex for _ in range(len(value) // 32 + 1))
    return "".join(hexdigits[i] if ch in "0123456789abcdef" else ch
                   for i, ch in enumerate(value))


def check_fixture(fixture: dict[str, Any]) -> list[str]:
    """Problems with a fixture's placeholders: a reference to an unknown or later request,
    or an answer spliced into another agent's history. Empty when the fixture is sound."""
    problems: list[str] = []
    seen: dict[str, str] = {}
    for req in fixture["requests"]:
        for kind, ref in _references(req.get("body")):
            if ref not in seen:
                problems.append(f"{req['id']}: {kind} of unknown or later request {ref!r}")
            elif kind == "answer" and seen[ref] != req["agent"]:
                problems.append(f"{req['id']}: splices the answer of {ref!r}, which belongs "
                                f"to agent {seen[ref]!r}, not {req['agent']!r}")
        if req["id"] in seen:
            problems.append(f"duplicate request id {req['id']!r}")
        seen[req["id"]] = req["agent"]
    return problems


def _references(node: Any) -> Iterator[tuple[str, str]]:
    if isinstance(node, str):
        m = _ANSWER.match(node)
        if m:
            yield "answer", m[1]
        for m in _INLINE.finditer(node):
            yield m[1], m[2]
    elif isinstance(node, list):
        for item in node:
            yield from _references(item)
    elif isinstance(node, dict):
        for value in node.values():
            yield from _references(value)


# ----------------------------------------------------------------------------- splicing


def materialize(node: Any, done: dict[str, Result], *, model: str) -> Any:
    """The request body with every placeholder filled from the earlier results."""
    if isinstance(node, list):
        out: list[Any] = []
        for item in node:
            spliced = _splice_item(item, done, model=model)
            if spliced is None:
                out.append(materialize(item, done, model=model))
            else:
                out.extend(spliced)
        return out
    if isinstance(node, dict):
        return {k: materialize(v, done, model=model) for k, v in node.items()}
    if isinstance(node, str):
        if node == MODEL_MARK:
            return model
        return _INLINE.sub(lambda m: _inline(m[1], m[2], done), node)
    return node


def _inline(kind: str, ref: str, done: dict[str, Result]) -> str:
    result = done[ref]
    if kind == "answer_text":
        return result.text
    return result.response_id or ""


def _splice_item(item: Any, done: dict[str, Result],
                 *, model: str) -> list[dict[str, Any]] | None:
    """A placeholder list item -> the items it stands for; None for an ordinary item.

    Messages: `{"role": "assistant", "content": "{{answer:ID}}", "before": [...],
    "after": [...]}` becomes one assistant message whose content is `before` + the answer's
    blocks + `after`. Responses: `{"type": "{{answer:ID}}", "before": [...], "after": [...]}`
    becomes the items `before` + the answer's output items + `after`."""
    if not isinstance(item, dict):
        return None
    before = materialize(item.get("before") or [], done, model=model)
    after = materialize(item.get("after") or [], done, model=model)
    content = item.get("content")
    if item.get("role") == "assistant" and isinstance(content, str) and _ANSWER.match(content):
        blocks = copy.deepcopy(done[_ANSWER.match(content)[1]].answer)  # type: ignore[index]
        message = {k: v for k, v in item.items() if k not in ("content", "before", "after")}
        message["content"] = [*before, *blocks, *after]
        return [message]
    kind = item.get("type")
    if isinstance(kind, str) and _ANSWER.match(kind):
        items = copy.deepcopy(done[_ANSWER.match(kind)[1]].answer)  # type: ignore[index]
        return [*before, *items, *after]
    return None


def _cap_output(body: dict[str, Any], path: str, max_tokens: int | None) -> None:
    """Bound the answer's length (the demo model's context is small and its answers are
    noise); the only change the harness makes to what the client sent."""
    if max_tokens is None or not isinstance(body, dict):
        return
    if path.startswith("/v1/messages") and not path.endswith("count_tokens"):
        body["max_tokens"] = min(int(body.get("max_tokens") or max_tokens), max_tokens)
    elif path.startswith("/v1/responses") and "input" in body:
        body["max_output_tokens"] = min(int(body.get("max_output_tokens") or max_tokens),
                                        max_tokens)


# ----------------------------------------------------------------------------- reading answers


def sse_events(lines: Iterator[str]) -> Iterator[tuple[str | None, Any]]:
    """(event name, parsed data) of each server-sent event; `[DONE]` is skipped."""
    name: str | None = None
    data: list[str] = []
    for raw in lines:
        line = raw.rstrip("\r")
        if not line:
            if data:
                payload = "\n".join(data)
                if payload.strip() != "[DONE]":
                    yield name, json.loads(payload)
            name, data = None, []
            continue
        if line.startswith(":"):
            continue
        key, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if key == "event":
            name = value
        elif key == "data":
            data.append(value)
    if data and "\n".join(data).strip() != "[DONE]":
        yield name, json.loads("\n".join(data))


class MessagesReader:
    """Rebuilds an Anthropic Messages answer from its stream, as Claude Code does: content
    blocks (text, tool_use with its input JSON assembled, thinking with its signature)."""

    def __init__(self) -> None:
        self.blocks: dict[int, dict[str, Any]] = {}
        self.partial: dict[int, str] = {}
        self.usage: dict[str, Any] = {}
        self.kvagent: dict[str, Any] | None = None
        self.message_id: str | None = None
        self.error: str | None = None

    def feed(self, event: dict[str, Any]) -> None:
        kind = event.get("type")
        if isinstance(event.get("kvagent"), dict):
            self.kvagent = event["kvagent"]
        if kind == "message_start":
            message = event.get("message") or {}
            self.message_id = message.get("id")
            self.usage.update(message.get("usage") or {})
            if isinstance(message.get("kvagent"), dict):
                self.kvagent = message["kvagent"]
        elif kind == "content_block_start":
            self.blocks[event["index"]] = copy.deepcopy(event["content_block"])
            self.partial[event["index"]] = ""
        elif kind == "content_block_delta":
            block, delta = self.blocks[event["index"]], event.get("delta") or {}
            dtype = delta.get("type")
            if dtype == "text_delta":
                block["text"] = block.get("text", "") + delta.get("text", "")
            elif dtype == "input_json_delta":
                self.partial[event["index"]] += delta.get("partial_json", "")
            elif dtype == "thinking_delta":
                block["thinking"] = block.get("thinking", "") + delta.get("thinking", "")
            elif dtype == "signature_delta":
                block["signature"] = delta.get("signature", "")
        elif kind == "content_block_stop":
            raw = self.partial.get(event["index"], "")
            block = self.blocks.get(event["index"], {})
            if block.get("type") == "tool_use" and raw:
                block["input"] = json.loads(raw)
        elif kind == "message_delta":
            for key, value in (event.get("usage") or {}).items():
                if value is not None:
                    self.usage[key] = value
        elif kind == "error":
            self.error = json.dumps(event.get("error"))

    def whole(self, message: dict[str, Any]) -> None:
        self.message_id = message.get("id")
        self.blocks = dict(enumerate(copy.deepcopy(message.get("content") or [])))
        self.usage = dict(message.get("usage") or {})
        if isinstance(message.get("kvagent"), dict):
            self.kvagent = message["kvagent"]

    def fill(self, result: Result) -> None:
        # Claude Code resends every block it received, citations and all, minus nothing.
        result.answer = [self.blocks[i] for i in sorted(self.blocks)]
        result.text = "".join(b.get("text", "") for b in result.answer if b.get("type") == "text")
        result.kvagent = self.kvagent
        cached = self.usage.get("cache_read_input_tokens")
        result.cached_tokens = int(cached) if cached is not None else None
        result.input_tokens = self.usage.get("input_tokens")
        result.response_id = self.message_id
        result.error = result.error or self.error


#: Fields of a Responses output item that a `store: false` client (Codex) does not resend.
_DROPPED_ITEM_FIELDS = ("id", "status")


class ResponsesReader:
    """Rebuilds an OpenAI Responses answer from its stream, as Codex does: the output items
    of `response.output_item.done` (falling back to `response.completed`'s output)."""

    def __init__(self) -> None:
        self.items: dict[int, dict[str, Any]] = {}
        self.response: dict[str, Any] = {}
        self.kvagent: dict[str, Any] | None = None
        self.error: str | None = None

    def feed(self, event: dict[str, Any]) -> None:
        kind = event.get("type")
        if isinstance(event.get("kvagent"), dict):
            self.kvagent = event["kvagent"]
        if kind == "response.output_item.done":
            self.items[int(event.get("output_index", len(self.items)))] = event["item"]
        elif kind in ("response.created", "response.in_progress", "response.completed",
                      "response.incomplete", "response.failed"):
            self.response = event.get("response") or {}
            if isinstance(self.response.get("kvagent"), dict):
                self.kvagent = self.response["kvagent"]
            if kind == "response.failed":
                self.error = json.dumps(self.response.get("error"))
        elif kind == "error":
            self.error = json.dumps(event)

    def whole(self, response: dict[str, Any]) -> None:
        self.response = response
        self.items = dict(enumerate(response.get("output") or []))
        if isinstance(response.get("kvagent"), dict):
            self.kvagent = response["kvagent"]

    def fill(self, result: Result) -> None:
        items = [self.items[i] for i in sorted(self.items)] or list(
            self.response.get("output") or [])
        result.answer = [_resent_item(item) for item in items]
        result.text = "".join(
            part.get("text", "") for item in items if item.get("type") == "message"
            for part in item.get("content") or [] if part.get("type") == "output_text")
        result.kvagent = self.kvagent
        usage = self.response.get("usage") or {}
        cached = (usage.get("input_tokens_details") or {}).get("cached_tokens")
        result.cached_tokens = int(cached) if cached is not None else None
        result.input_tokens = usage.get("input_tokens")
        result.response_id = self.response.get("id")
        result.error = result.error or self.error


def _resent_item(item: dict[str, Any]) -> dict[str, Any]:
    """An output item as Codex resends it: parsed into its own item type and serialized
    again, so ids and status go, and so do fields that are null."""
    out = {k: v for k, v in item.items() if k not in _DROPPED_ITEM_FIELDS and v is not None}
    if out.get("type") == "message":
        out["content"] = [{k: v for k, v in part.items() if k in ("type", "text")}
                          for part in out.get("content") or []]
    return out


# ----------------------------------------------------------------------------- replay


def replay(fixture: dict[str, Any], base_url: str, *, model: str,
           max_tokens: int | None = 24, fresh_ids: bool = True,
           client: httpx.Client | None = None, timeout: float = 600.0) -> list[Result]:
    """Send the fixture's requests to `base_url` (the router's root, without `/v1`) in order;
    one `Result` per request. A failed request is recorded and replay goes on (a request
    that splices its answer gets an empty answer), so one run reports every status."""
    problems = check_fixture(fixture)
    if problems:
        raise ValueError("unsound fixture: " + "; ".join(problems))
    if fresh_ids:
        fixture = with_fresh_ids(fixture)
    own = client is None
    http = client or httpx.Client(timeout=timeout)
    done: dict[str, Result] = {}
    try:
        for req in fixture["requests"]:
            done[req["id"]] = send(http, base_url, req, done, model=model, max_tokens=max_tokens)
    finally:
        if own:
            http.close()
    return list(done.values())


def send(http: httpx.Client, base_url: str, req: dict[str, Any], done: dict[str, Result],
         *, model: str, max_tokens: int | None) -> Result:
    """One fixture request: send it, read the answer, return its `Result`."""
    path = materialize(req["path"], done, model=model)
    body = materialize(req.get("body"), done, model=model)
    _cap_output(body, path, max_tokens)
    result = Result(req["id"], req["agent"], req.get("kind", "turn"), req.get("reuse", "any"),
                    status=0)
    reader: MessagesReader | ResponsesReader = (
        MessagesReader() if path.startswith("/v1/messages") else ResponsesReader())
    method = req.get("method", "POST")
    kwargs: dict[str, Any] = {"headers": req.get("headers") or {}}
    if method != "GET":
        kwargs["json"] = body
    try:
        with http.stream(method, base_url.rstrip("/") + path, **kwargs) as resp:
            result.status = resp.status_code
            ctype = resp.headers.get("content-type", "")
            if resp.status_code >= 400:
                result.error = resp.read().decode(errors="replace")
            elif ctype.startswith("text/event-stream"):
                for _name, event in sse_events(resp.iter_lines()):
                    if isinstance(event, dict):
                        reader.feed(event)
            else:
                data = json.loads(resp.read() or b"null")
                result.body = data
                if isinstance(data, dict) and ("content" in data or "output" in data):
                    reader.whole(data)
    except (httpx.HTTPError, json.JSONDecodeError, KeyError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    if result.status < 400:
        reader.fill(result)
    return result


def report(results: list[Result]) -> str:
    """One line per request, for assertion messages."""
    return "\n".join(r.summary() for r in results)
