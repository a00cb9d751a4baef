"""Multi-turn agent workloads: generated (seeded) or replayed from a JSON file. No I/O here
except `load_replay` reading its file.

The benchmark model has random weights, so it cannot drive an agent. Each conversation is
therefore *scripted*: the workload fixes every turn's new messages (tool results, user
replies) and the tool calls the assistant "made", while the runner appends the model's real
answer text to the history. The prompt of turn k+1 is then a true token-level continuation
of turn k's prompt plus its answer, which is the property KV reuse depends on.

A turn is one request. Turn 0 sends the system prompt and the first user message; turn k>0
first closes turn k-1's answer with `Turn.assistant` (the scripted tool calls, and for
replays the recorded answer text), then appends `Turn.messages`.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import random
import string
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

Message = dict[str, Any]

#: Characters per token of the generated text under the demo model's BPE tokenizer
#: (measured: 1.8 for JSON and logs to 2.5 for prose).
DEFAULT_CHARS_PER_TOKEN = 2.2


class WorkloadSpec(BaseModel):
    """Sizes and counts of a generated workload; token sizes are estimates via chars/token."""

    model_config = ConfigDict(extra="forbid")

    seed: int = 0
    conversations: int = Field(default=4, ge=1)
    turns: int = Field(default=8, ge=1, description="Requests per conversation.")
    concurrency: int = Field(default=2, ge=1, description="Conversations in flight at once.")
    system_prompt_tokens: int = Field(default=500, ge=20)
    context_tokens: int = Field(
        default=5000, ge=0, description="Per-conversation document sent with the first turn.")
    tool_result_tokens: tuple[int, int] = (120, 500)
    user_turn_tokens: tuple[int, int] = (12, 60)
    user_turn_probability: float = Field(default=0.25, ge=0.0, le=1.0)
    parallel_tool_call_probability: float = Field(default=0.15, ge=0.0, le=1.0)
    max_tokens: int = Field(default=24, ge=1, description="Answer length cap per request.")
    chars_per_token: float = Field(default=DEFAULT_CHARS_PER_TOKEN, gt=0.5)

    @model_validator(mode="after")
    def _ranges(self) -> WorkloadSpec:
        for name in ("tool_result_tokens", "user_turn_tokens"):
            lo, hi = getattr(self, name)
            if not 1 <= lo <= hi:
                raise ValueError(f"{name}: need 1 <= min <= max, got ({lo}, {hi})")
        return self

    @classmethod
    def quick(cls, seed: int = 0) -> WorkloadSpec:
        """CI size: 2 conversations x 4 turns, ~1.5-2k tokens (1.1k of them tool schemas)."""
        return cls(seed=seed, conversations=2, turns=4, concurrency=2,
                   system_prompt_tokens=100, context_tokens=300,
                   tool_result_tokens=(40, 150), max_tokens=16)

    @classmethod
    def full(cls, seed: int = 0) -> WorkloadSpec:
        """The recorded run: 4 conversations x 8 turns, ~6-10k tokens (median ~8k)."""
        return cls(seed=seed)


class AssistantScript(BaseModel):
    """How turn k-1's answer enters the history before turn k."""

    model_config = ConfigDict(extra="forbid")

    tool_calls: list[dict[str, Any]] = Field(default_factory=list)
    #: The recorded answer (replays only); used instead of the model's answer on request.
    recorded_content: str | None = None


class Turn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    assistant: AssistantScript | None = None  # None only for turn 0
    messages: list[Message]


class Conversation(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str
    tools: list[dict[str, Any]] = Field(default_factory=list)
    turns: list[Turn]


class Workload(BaseModel):
    model_config = ConfigDict(extra="forbid")

    source: str  # "generated" or the replay file's name
    spec: WorkloadSpec | None = None
    max_tokens: int = Field(ge=1)
    concurrency: int = Field(ge=1)
    conversations: list[Conversation]

    def fingerprint(self) -> str:
        """Short hash of the whole workload: equal fingerprints, equal requests."""
        blob = json.dumps(self.model_dump(mode="json"), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def max_turns(self) -> int:
        return max((len(c.turns) for c in self.conversations), default=0)


def assistant_message(script: AssistantScript, answer: str, *, keep_recorded: bool,
                      text_with_tool_calls: bool = True) -> Message:
    """The assistant message that closes a turn: the model's answer plus scripted tool calls.

    `text_with_tool_calls=False` is for chat formats whose assistant message is either text
    or tool calls (Mistral's): a message with tool calls then carries no text."""
    content: str | None = answer
    if keep_recorded and script.recorded_content is not None:
        content = script.recorded_content
    if script.tool_calls and not text_with_tool_calls:
        content = None
    msg: Message = {"role": "assistant", "content": content}
    if script.tool_calls:
        msg["tool_calls"] = script.tool_calls
    return msg


def estimate_tokens(text: str, chars_per_token: float = DEFAULT_CHARS_PER_TOKEN) -> int:
    return round(len(text) / chars_per_token)


# =========================================================================== generation

_WORD_TEXT = (
    "agent cache config module service request response handler session token prefix "
    "decode prefill node router block memory worker queue stream chunk retry timeout "
    "error value key name path file line function class method return state update "
    "create delete list read write search build test deploy release version client "
    "server database index table record field schema user tenant metric latency "
    "throughput batch limit window buffer offset cursor page result status health"
)
_WORDS = tuple(_WORD_TEXT.split())
_VERBS = ("check", "fix", "update", "refactor", "explain", "test", "profile", "rename",
          "document", "review", "simplify", "remove")
_LEVELS = ("INFO", "INFO", "INFO", "DEBUG", "WARNING", "ERROR")
_EXTS = (".py", ".py", ".ts", ".go", ".yaml", ".md")


def tool_definitions() -> list[dict[str, Any]]:
    """OpenAI tool schemas of a coding agent; fixed, shared by every generated conversation."""

    def tool(name: str, desc: str, props: dict[str, Any], required: list[str]) -> dict:
        return {"type": "function", "function": {
            "name": name, "description": desc,
            "parameters": {"type": "object", "properties": props, "required": required}}}

    s = {"type": "string"}
    return [
        tool("read_file", "Read a text file from the repository and return its content.",
             {"path": {**s, "description": "Path relative to the repository root."},
              "start_line": {"type": "integer"}, "end_line": {"type": "integer"}}, ["path"]),
        tool("search_code", "Search the repository for a regular expression; returns "
             "matches as JSON with path, line number and snippet.",
             {"query": s, "path": {**s, "description": "Directory to search."},
              "max_results": {"type": "integer"}}, ["query"]),
        tool("run_command", "Run a shell command in the sandbox and return its output.",
             {"command": s, "timeout_s": {"type": "integer"}}, ["command"]),
        tool("list_directory", "List a directory as JSON entries with name, type and size.",
             {"path": s, "recursive": {"type": "boolean"}}, ["path"]),
        tool("http_get", "Fetch a URL of the internal API and return the JSON body.",
             {"url": s, "headers": {"type": "object"}}, ["url"]),
        tool("write_file", "Write a file, replacing its content.",
             {"path": s, "content": s}, ["path", "content"]),
    ]


class _Gen:
    """Seeded text generators; every method draws only from `self.rng`."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    def words(self, lo: int, hi: int) -> str:
        return " ".join(self.rng.choice(_WORDS) for _ in range(self.rng.randint(lo, hi)))

    def ident(self) -> str:
        return "_".join(self.rng.choice(_WORDS) for _ in range(self.rng.randint(1, 3)))

    def path(self) -> str:
        parts = [self.rng.choice(_WORDS) for _ in range(self.rng.randint(1, 3))]
        return "src/" + "/".join(parts) + "/" + self.ident() + self.rng.choice(_EXTS)

    def hexid(self, n: int = 8) -> str:
        return "".join(self.rng.choice("0123456789abcdef") for _ in range(n))

    # -- line sources (endless; `_fill` cuts them to size) --------------------------------

    def prose_lines(self):
        while True:
            if self.rng.random() < 0.15:
                yield f"## {self.words(2, 5).title()}"
            yield self.words(8, 30).capitalize() + "."

    def code_lines(self):
        while True:
            name, a, b = self.ident(), self.rng.choice(_WORDS), self.rng.choice(_WORDS)
            yield f"def {name}({a}, {b}=None):"
            yield f'    """{self.words(4, 12).capitalize()}."""'
            for _ in range(self.rng.randint(1, 5)):
                kind = self.rng.random()
                if kind < 0.3:
                    yield f"    if {a} is None:\n        raise ValueError(\"{self.words(2, 6)}\")"
                elif kind < 0.6:
                    yield f"    {self.ident()} = {a}.{self.ident()}({b}, {self.rng.randint(0, 999)})"
                else:
                    yield f"    # {self.words(3, 10)}"
            yield f"    return {a}\n"

    def log_lines(self):
        t = self.rng.randint(0, 80000)
        while True:
            t += self.rng.randint(0, 3)
            hh, mm, ss = t // 3600 % 24, t // 60 % 60, t % 60
            level = self.rng.choice(_LEVELS)
            yield (f"2026-11-30T{hh:02d}:{mm:02d}:{ss:02d}.{self.rng.randint(0, 999):03d}Z "
                   f"{level:<7} [{self.rng.choice(_WORDS)}] {self.words(4, 14)} "
                   f"request_id={self.hexid()} took={self.rng.randint(1, 900)}ms")

    # -- sized content ----------------------------------------------------------------------

    def document(self, chars: int) -> str:
        """A per-conversation context document: a design note with code excerpts."""
        prose, code = self.prose_lines(), self.code_lines()
        out: list[str] = []
        size = 0
        while size < chars:
            src = code if self.rng.random() < 0.35 else prose
            block = "\n".join(next(src) for _ in range(self.rng.randint(2, 8)))
            out.append(block)
            size += len(block) + 2
        return "\n\n".join(out)[:chars]

    def tool_result(self, name: str, chars: int) -> str:
        if name == "read_file":
            return _fill(self.code_lines(), chars)
        if name == "run_command":
            return _fill(self.log_lines(), chars)
        if name == "search_code":
            items = ({"path": self.path(), "line": self.rng.randint(1, 2000),
                      "snippet": self.words(4, 16)} for _ in itertools.count())
            return _fill_json({"query": self.ident(), "matches": []}, "matches", items, chars,
                              self)
        if name == "list_directory":
            items = ({"name": self.ident() + self.rng.choice(_EXTS),
                      "type": self.rng.choice(("file", "file", "dir")),
                      "size": self.rng.randint(0, 90000)} for _ in itertools.count())
            return _fill_json({"path": self.path().rsplit("/", 1)[0], "entries": []},
                              "entries", items, chars, self)
        items = ({"id": self.hexid(12), "name": self.ident(), "status":
                  self.rng.choice(("ok", "degraded", "failed")), "latency_ms":
                  self.rng.randint(1, 5000), "labels": {self.rng.choice(_WORDS):
                  self.rng.choice(_WORDS)}} for _ in itertools.count())
        return _fill_json({"status": 200, "data": []}, "data", items, chars, self)

    def tool_args(self, name: str) -> dict[str, Any]:
        if name == "read_file":
            return {"path": self.path()}
        if name == "search_code":
            return {"query": self.ident(), "path": "src/"}
        if name == "run_command":
            return {"command": self.rng.choice(("pytest -x -q", "make build", "git log -n 20",
                                                "journalctl -u worker --since -1h")),
                    "timeout_s": 120}
        if name == "list_directory":
            return {"path": self.path().rsplit("/", 1)[0]}
        return {"url": f"http://api.internal/v1/{self.rng.choice(_WORDS)}s?limit=50"}

    def user_text(self, chars: int) -> str:
        text = f"Thanks. Now {self.rng.choice(_VERBS)} the {self.ident()} in {self.path()}."
        while len(text) < chars:
            text += " " + self.words(6, 14).capitalize() + "."
        return text[:chars]


def _fill(lines, chars: int) -> str:
    """Join lines until exactly `chars` characters (the last line cut, like `head -c`)."""
    out: list[str] = []
    size = 0
    while size < chars:
        line = next(lines)
        out.append(line)
        size += len(line) + 1
    return "\n".join(out)[:chars]


def _fill_json(skeleton: dict[str, Any], key: str, items, chars: int, gen: _Gen) -> str:
    """A JSON document of exactly `chars` characters (when `chars` exceeds the skeleton):
    items are added while they fit, then a `next_cursor` pads the rest, as paginated APIs do."""
    doc = dict(skeleton)
    doc[key] = []
    doc["next_cursor"] = ""
    while True:
        item = next(items)
        doc[key].append(item)
        if len(json.dumps(doc)) > chars:
            doc[key].pop()
            break
    pad = chars - len(json.dumps(doc))
    if pad > 0:
        doc["next_cursor"] = "".join(gen.rng.choice(string.ascii_letters) for _ in range(pad))
    return json.dumps(doc)


def _chars(tokens: int, spec: WorkloadSpec) -> int:
    return max(1, round(tokens * spec.chars_per_token))


def generate(spec: WorkloadSpec) -> Workload:
    """The generated workload for `spec`: same spec (seed included), identical workload."""
    rng = random.Random(spec.seed)
    shared = _Gen(random.Random(rng.getrandbits(64)))
    system = ("You are a coding agent working in a large repository. Use the tools to read, "
              "search and run code before you answer. Keep answers short.\n\n"
              + shared.document(_chars(spec.system_prompt_tokens, spec)))
    tools = tool_definitions()
    names = [t["function"]["name"] for t in tools if t["function"]["name"] != "write_file"]
    conversations = []
    for ci in range(spec.conversations):
        g = _Gen(random.Random(rng.getrandbits(64)))
        conv_id = f"conv-{spec.seed}-{ci}"
        doc_path = g.path()
        first = (f"I am working on `{doc_path}` and its design note below. "
                 f"Please {g.rng.choice(_VERBS)} the {g.ident()} handling.\n\n"
                 f"```\n{g.document(_chars(spec.context_tokens, spec))}\n```")
        turns = [Turn(messages=[{"role": "system", "content": system},
                                {"role": "user", "content": first}])]
        for ti in range(1, spec.turns):
            if g.rng.random() < spec.user_turn_probability:
                chars = _chars(g.rng.randint(*spec.user_turn_tokens), spec)
                turns.append(Turn(assistant=AssistantScript(),
                                  messages=[{"role": "user", "content": g.user_text(chars)}]))
                continue
            n_calls = 2 if g.rng.random() < spec.parallel_tool_call_probability else 1
            calls, results = [], []
            for j in range(n_calls):
                name = g.rng.choice(names)
                # 9 alphanumerics: the one id form every chat format accepts (Mistral's
                # requires exactly that).
                call_id = f"c{ci % 1000:03d}t{ti % 100:02d}n{j % 100:02d}"
                calls.append({"id": call_id, "type": "function", "function": {
                    "name": name, "arguments": json.dumps(g.tool_args(name))}})
                chars = _chars(g.rng.randint(*spec.tool_result_tokens), spec)
                results.append({"role": "tool", "tool_call_id": call_id,
                                "content": g.tool_result(name, chars)})
            turns.append(Turn(assistant=AssistantScript(tool_calls=calls), messages=results))
        conversations.append(Conversation(id=conv_id, tools=tools, turns=turns))
    return Workload(source="generated", spec=spec, max_tokens=spec.max_tokens,
                    concurrency=spec.concurrency, conversations=conversations)


# =========================================================================== replay

_ROLES = {"system", "developer", "user", "assistant", "tool"}


class ReplayError(ValueError):
    """A replay file that is not a list of OpenAI-format conversations."""


def parse_replay(data: Any, *, max_tokens: int = 24, concurrency: int = 2,
                 source: str = "replay") -> Workload:
    """Turn OpenAI-format conversations into scripted turns.

    Accepted shapes: a list of conversations, or `{"conversations": [...], "tools": [...]}`;
    a conversation is a list of messages or `{"id": ..., "messages": [...], "tools": [...]}`.
    Every assistant message that answers a user or tool message ends a turn: its text is the
    recorded answer, its tool calls are replayed as-is. Other assistant messages (e.g. a
    greeting before any user message) stay in the history verbatim.
    """
    default_tools: list[dict[str, Any]] = []
    if isinstance(data, dict):
        if "conversations" not in data:
            raise ReplayError("top level: expected a list of conversations or an object with "
                              "a 'conversations' list")
        default_tools = _tools(data.get("tools"), "top level")
        data = data["conversations"]
    if not isinstance(data, list) or not data:
        raise ReplayError("top level: expected a non-empty list of conversations")
    conversations = []
    for ci, raw in enumerate(data):
        where = f"conversation {ci}"
        conv_id, tools = f"replay-{ci}", default_tools
        if isinstance(raw, dict):
            if not isinstance(raw.get("messages"), list):
                raise ReplayError(f"{where}: an object conversation needs a 'messages' list")
            conv_id = str(raw.get("id", conv_id))
            tools = _tools(raw.get("tools"), where) or default_tools
            raw = raw["messages"]
        if not isinstance(raw, list):
            raise ReplayError(f"{where}: expected a list of messages, got {type(raw).__name__}")
        turns = _split_turns(raw, where)
        if not turns:
            raise ReplayError(f"{where}: no user or tool message to send")
        conversations.append(Conversation(id=conv_id, tools=tools, turns=turns))
    return Workload(source=source, max_tokens=max_tokens, concurrency=concurrency,
                    conversations=conversations)


def load_replay(path: Path, **kwargs: Any) -> Workload:
    try:
        data = json.loads(Path(path).read_text())
    except OSError as exc:
        raise ReplayError(f"{path}: cannot read ({exc.strerror})") from None
    except json.JSONDecodeError as exc:
        raise ReplayError(f"{path}: invalid JSON: {exc}") from None
    return parse_replay(data, source=Path(path).name, **kwargs)


def _tools(value: Any, where: str) -> list[dict[str, Any]]:
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(t, dict) for t in value):
        raise ReplayError(f"{where}: 'tools' must be a list of tool objects")
    return value


def _split_turns(messages: list[Any], where: str) -> list[Turn]:
    turns: list[Turn] = []
    pending: list[Message] = []
    asks = False  # pending holds a user/tool message the next assistant message answers
    before: AssistantScript | None = None
    for mi, msg in enumerate(messages):
        if not isinstance(msg, dict) or msg.get("role") not in _ROLES:
            raise ReplayError(f"{where} message {mi}: expected an object with role in "
                              f"{sorted(_ROLES)}, got {msg!r:.80}")
        if msg["role"] == "tool" and not msg.get("tool_call_id"):
            raise ReplayError(f"{where} message {mi}: a tool message needs 'tool_call_id'")
        if msg["role"] == "assistant" and asks:
            turns.append(Turn(assistant=before, messages=pending))
            content = msg.get("content")
            before = AssistantScript(
                tool_calls=list(msg.get("tool_calls") or []),
                recorded_content=content if isinstance(content, str) else _text(content))
            pending, asks = [], False
            continue
        pending.append(msg)
        asks = asks or msg["role"] in ("user", "tool")
    if asks:
        turns.append(Turn(assistant=before, messages=pending))
    return turns


def _text(content: Any) -> str | None:
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return None
