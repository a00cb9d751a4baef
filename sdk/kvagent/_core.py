"""Everything a session does that is not I/O: history, options, requests, commits, errors.

``Session`` and ``AsyncSession`` inherit this and only send bytes and run tools. Keeping the
decisions here means the sync and async shells cannot disagree about what a turn is.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal, Self, TypedDict, Unpack

import httpx
from pydantic import BaseModel, ConfigDict

from . import protocol as proto
from . import _wire
from ._exceptions import APIConnectionError, APIStatusError
from ._request import ChatRequest, build_chat_request
from ._response import check_event_stream, connection_error, status_error
from ._retry import RetryPolicy
from ._stream import StreamAccumulator
from .messages import AssistantMessage, Message, MessageList, SystemMessage, UserMessage
from .tools import PreparedCall, Tool, as_tools, prepare_call

__all__ = ["DEFAULT_TIMEOUT", "SessionCore", "SessionOptions", "SessionState", "TurnOptions"]

#: Generous read timeout: headers arrive only after prefill, which is slow on CPU nodes.
DEFAULT_TIMEOUT = httpx.Timeout(300.0, connect=10.0)
_STATE_FORMAT = "kvagent.session/1"
_SAMPLING_KEYS = ("temperature", "top_p", "max_tokens", "seed", "stop")


class TurnOptions(TypedDict, total=False):
    """Per-session defaults and per-turn overrides of the request body."""

    tool_choice: _wire.ToolChoice
    temperature: float
    top_p: float
    max_tokens: int
    seed: int
    stop: str | list[str]
    #: Any other body fields (vLLM's ``top_k``, ``return_token_ids``, ...), merged last.
    extra_body: Mapping[str, Any]
    #: Extra HTTP headers.
    headers: Mapping[str, str]


class SessionOptions(TurnOptions, total=False):
    """Constructor options of ``Session``/``AsyncSession`` (plus the per-turn defaults)."""

    #: System prompt, added as the first message.
    system: str
    #: Initial history (e.g. from another session).
    messages: Iterable[Message]
    #: Stable conversation id sent as ``X-Session-ID``; generated when omitted.
    session_id: str
    #: Sent as ``Authorization: Bearer <api_key>``.
    api_key: str
    tools: Iterable[Tool | Callable[..., Any]]
    retry: RetryPolicy
    #: Shortcut for ``retry=RetryPolicy(max_retries=...)``.
    max_retries: int
    timeout: float | httpx.Timeout | None


class SessionState(BaseModel):
    """What ``save()`` writes: enough to resume the conversation, cache token included."""

    model_config = ConfigDict(extra="ignore")

    format: Literal["kvagent.session/1"] = _STATE_FORMAT
    session_id: str
    model: str
    base_url: str | None = None
    options: dict[str, Any] = {}
    messages: list[Message]


@dataclass(frozen=True, slots=True)
class PreparedTurn:
    """A turn ready to send: the messages it will add and the request that carries them."""

    pending: tuple[Message, ...]
    request: ChatRequest
    sent_token: str | None
    #: History length it was built on: a turn never commits onto a changed history.
    base_length: int


def new_session_id() -> str:
    return f"kva-{uuid.uuid4().hex}"


def _check_options(options: Mapping[str, Any]) -> dict[str, Any]:
    unknown = set(options) - set(TurnOptions.__annotations__)
    if unknown:
        raise TypeError(f"unknown option(s) {sorted(unknown)}; use extra_body for other "
                        f"body fields (known: {sorted(TurnOptions.__annotations__)})")
    return {k: v for k, v in options.items() if v is not None}


class SessionCore:
    """State and decisions shared by ``Session`` and ``AsyncSession``."""

    def __init__(self, base_url: str, model: str, **options: Unpack[SessionOptions]) -> None:
        opts: dict[str, Any] = dict(options)
        system: str | None = opts.pop("system", None)
        messages: Iterable[Message] = opts.pop("messages", ())
        session_id: str | None = opts.pop("session_id", None)
        api_key: str | None = opts.pop("api_key", None)
        tools: Iterable[Tool | Any] = opts.pop("tools", ())
        retry: RetryPolicy | None = opts.pop("retry", None)
        max_retries: int | None = opts.pop("max_retries", None)
        timeout = opts.pop("timeout", DEFAULT_TIMEOUT)
        defaults = opts
        if not base_url:
            raise ValueError("base_url is required, e.g. 'http://127.0.0.1:8000/v1'")
        if not model:
            raise ValueError("model is required: the name the server serves (GET /v1/models)")
        if session_id is not None and not proto.valid_session_id(session_id):
            raise ValueError(f"session_id {session_id!r} is invalid: 1-128 characters "
                             "from [A-Za-z0-9._:-]")
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.session_id = session_id or new_session_id()
        self.api_key = api_key
        self._tools = as_tools(tools)
        self._defaults = _check_options(defaults)
        if retry is not None and max_retries is not None:
            raise ValueError("pass retry=RetryPolicy(...) or max_retries=, not both")
        self.retry = retry or (RetryPolicy(max_retries=max_retries) if max_retries is not None
                               else RetryPolicy())
        self.timeout = timeout
        history: list[Message] = [SystemMessage(content=system)] if system else []
        history.extend(MessageList.validate_python(list(messages)))
        self._history = history
        self._busy = False
        self._clock = time.perf_counter

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(base_url={self.base_url!r}, model={self.model!r}, "
                f"session_id={self.session_id!r}, messages={len(self._history)})")

    # ------------------------------------------------------------------ history

    @property
    def messages(self) -> tuple[Message, ...]:
        """The conversation so far (immutable messages; use ``add``/``truncate`` to change)."""
        return tuple(self._history)

    @property
    def tools(self) -> tuple[Tool, ...]:
        return tuple(self._tools.values())

    @property
    def cache_token(self) -> str | None:
        """The token the next turn will send: the last assistant answer's, unless expired."""
        return _current_token(self._history, datetime.now(UTC))

    def add(self, *messages: Message) -> None:
        """Append messages (e.g. tool results you computed yourself)."""
        self._history.extend(MessageList.validate_python(list(messages)))

    def truncate(self, length: int) -> None:
        """Keep the first ``length`` messages (negative counts from the end, like slicing)."""
        self._ensure_idle()
        del self._history[length:]

    def _fork_kwargs(self, at: int | None, session_id: str | None) -> dict[str, Any]:
        return dict(
            base_url=self.base_url, model=self.model, messages=self._history[:at],
            session_id=session_id or self.session_id, api_key=self.api_key,
            tools=list(self._tools.values()), retry=self.retry, timeout=self.timeout,
            **self._defaults,
        )

    # ------------------------------------------------------------------ persistence

    def to_state(self) -> SessionState:
        options = dict(self._defaults)
        options.pop("headers", None)  # may hold secrets; pass them again on load
        if isinstance(options.get("tool_choice"), Tool):
            options["tool_choice"] = _wire.tool_choice_to_wire(options["tool_choice"])
        return SessionState(session_id=self.session_id, model=self.model,
                            base_url=self.base_url, options=options,
                            messages=list(self._history))

    def to_json(self) -> str:
        """The session as JSON (no API key, no headers, no tools: those are code/secrets)."""
        return self.to_state().model_dump_json(indent=2)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json(), encoding="utf-8")

    @classmethod
    def from_json(cls, text: str, **kwargs: Any) -> Self:
        """Rebuild a saved session; ``kwargs`` (tools, api_key, transport, ...) are passed to
        the constructor and override what was saved."""
        state = SessionState.model_validate_json(text)
        init: dict[str, Any] = {"base_url": state.base_url, "model": state.model,
                                "session_id": state.session_id, "messages": state.messages,
                                **state.options}
        init.update(kwargs)
        return cls(**init)

    @classmethod
    def load(cls, path: str | Path, **kwargs: Any) -> Self:
        return cls.from_json(Path(path).read_text(encoding="utf-8"), **kwargs)

    # ------------------------------------------------------------------ turns

    def _begin(self, prepared: PreparedTurn) -> None:
        self._ensure_idle()
        if len(self._history) != prepared.base_length:
            raise RuntimeError("the history changed since this turn was prepared; "
                               "call stream()/send() again")
        self._busy = True

    def _ensure_idle(self) -> None:
        if self._busy:
            raise RuntimeError("a turn is already running on this session; use fork() for "
                               "parallel branches")

    def _prepare(self, content: str | Message | None, options: Mapping[str, Any]
                 ) -> PreparedTurn:
        """Build the next request; nothing is added to the history until ``_commit``."""
        self._ensure_idle()
        overrides = _check_options(options)
        turn = {**self._defaults, **overrides}
        pending: tuple[Message, ...] = ()
        if isinstance(content, str):
            pending = (UserMessage(content=content),)
        elif content is not None:
            pending = tuple(MessageList.validate_python([content]))
        messages = [*self._history, *pending]
        if not messages:
            raise ValueError("nothing to send: the conversation is empty")
        token = _current_token(self._history, datetime.now(UTC))
        tool_choice = turn.get("tool_choice")
        extra_body = {**self._defaults.get("extra_body", {}), **overrides.get("extra_body", {})}
        headers = {**self._defaults.get("headers", {}), **overrides.get("headers", {})}
        request = build_chat_request(
            base_url=self.base_url, model=self.model, messages=_wire.messages_to_wire(messages),
            session_id=self.session_id, cache_token=token,
            tools=[_wire.tool_to_wire(t) for t in self._tools.values()] or None,
            tool_choice=None if tool_choice is None else _wire.tool_choice_to_wire(tool_choice),
            params={k: turn[k] for k in _SAMPLING_KEYS if k in turn},
            extra_body=extra_body, api_key=self.api_key, headers=headers,
        )
        return PreparedTurn(pending=pending, request=request, sent_token=token,
                            base_length=len(self._history))

    def _accumulator(self, started_at: float) -> StreamAccumulator:
        return StreamAccumulator(clock=self._clock, started_at=started_at)

    def _commit(self, prepared: PreparedTurn, message: AssistantMessage) -> None:
        """The turn succeeded: its user message and the answer join the history together."""
        if len(self._history) != prepared.base_length:
            raise RuntimeError("the history changed while this turn was in flight; "
                               "its answer was not added")
        self._history.extend(prepared.pending)
        self._history.append(message)

    def _prepare_tool_calls(self, message: AssistantMessage) -> list[PreparedCall]:
        return [prepare_call(self._tools, call) for call in message.tool_calls]

    # ------------------------------------------------------------------ errors

    def _connection_error(self, exc: httpx.TransportError, request: ChatRequest
                          ) -> APIConnectionError:
        return connection_error(exc, request.url)

    def _status_error(self, response: httpx.Response, raw: bytes) -> APIStatusError:
        return status_error(response, raw, model=self.model, base_url=self.base_url)

    def _check_stream_headers(self, response: httpx.Response) -> None:
        check_event_stream(response)


def _current_token(history: Sequence[Message], now: datetime) -> str | None:
    for message in reversed(history):
        if isinstance(message, AssistantMessage):
            expires = message.cache_token_expires_at
            if message.cache_token and (expires is None or expires > now):
                return message.cache_token
            return None
    return None
