"""Everything a session does that is not I/O: history, options, requests, commits, errors.

``Session`` and ``AsyncSession`` inherit this and only send bytes and run tools. Keeping the
decisions here means the sync and async shells cannot disagree about what a turn is.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal, Self, TypedDict, Unpack

import httpx
from pydantic import BaseModel, ConfigDict

from . import _wire
from . import protocol as proto
from ._exceptions import APIConnectionError, APIStatusError
from ._logs import logger, redact_headers
from ._request import ChatRequest, build_chat_request
from ._response import check_event_stream, connection_error, request_id, status_error
from ._retry import RetryPolicy
from ._stream import StreamAccumulator
from .messages import (
    AssistantMessage,
    Message,
    MessageList,
    SystemMessage,
    UserContent,
    UserMessage,
)
from .results import TurnResult
from .tools import PreparedCall, Tool, as_tools, prepare_call

__all__ = [
    "API_KEY_ENV",
    "BASE_URL_ENV",
    "DEFAULT_TIMEOUT",
    "SessionCore",
    "SessionOptions",
    "SessionState",
    "TurnOptions",
]

#: Generous read timeout: headers arrive only after prefill, which is slow on CPU nodes.
DEFAULT_TIMEOUT = httpx.Timeout(300.0, connect=10.0)
#: Read by ``Session``/``AsyncSession`` when ``base_url``/``api_key`` are not given.
BASE_URL_ENV = "KVAGENT_BASE_URL"
API_KEY_ENV = "KVAGENT_API_KEY"
_STATE_FORMAT: Literal["kvagent.session/1"] = "kvagent.session/1"
#: Bytes read after ``[DONE]`` to reach the end of the response (so its connection can be
#: reused); a server still sending past this is cut off, costing only the connection.
DRAIN_LIMIT = 64 * 1024
_SAMPLING_KEYS = ("temperature", "top_p", "max_tokens", "seed", "stop", "logprobs",
                  "top_logprobs")
#: Options that shape how a request is sent, not its body.
_TRANSPORT_KEYS = ("timeout", "max_retries")


class TurnOptions(TypedDict, total=False):
    """Per-session defaults and per-turn overrides of the request."""

    tool_choice: _wire.ToolChoice
    temperature: float
    top_p: float
    max_tokens: int
    seed: int
    stop: str | list[str]
    #: Ask for per-token log probabilities (``TurnResult.logprobs``) and alternatives.
    logprobs: bool
    top_logprobs: int
    #: A pydantic model class (the answer is parsed into it: ``TurnResult.parsed``) or an
    #: OpenAI ``response_format`` dict, sent as is.
    response_format: type[BaseModel] | Mapping[str, Any]
    #: Any other body fields (vLLM's ``top_k``, ``return_token_ids``, ...), merged last.
    extra_body: Mapping[str, Any]
    #: Extra HTTP headers.
    headers: Mapping[str, str]
    #: Seconds (or an ``httpx.Timeout``) for this turn's request.
    timeout: float | httpx.Timeout | None
    #: Retries of this turn's request (replaces the policy's ``max_retries``).
    max_retries: int


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
    #: Earlier answers' reasoning: "strip" (default) or "send" back to the server.
    reasoning_history: _wire.ReasoningHistory


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
    timeout: float | httpx.Timeout | None
    retry: RetryPolicy
    #: The pydantic model the answer is parsed into, if any.
    response_model: type[BaseModel] | None = None


def new_session_id() -> str:
    return f"kva-{uuid.uuid4().hex}"


def _check_options(options: Mapping[str, Any]) -> dict[str, Any]:
    unknown = set(options) - set(TurnOptions.__annotations__)
    if unknown:
        raise TypeError(f"unknown option(s) {sorted(unknown)}; use extra_body for other "
                        f"body fields (known: {sorted(TurnOptions.__annotations__)})")
    return {k: v for k, v in options.items() if v is not None or k == "timeout"}


def _response_format(value: Any) -> tuple[dict[str, Any] | None, type[BaseModel] | None]:
    """The wire ``response_format`` and the model to parse into.

    No ``strict`` flag: OpenAI's strict mode rejects ordinary pydantic schemas (optional
    fields, no ``additionalProperties: false``), and vLLM constrains decoding to the schema
    either way.
    """
    if value is None:
        return None, None
    if isinstance(value, type) and issubclass(value, BaseModel):
        schema = {"name": value.__name__, "schema": value.model_json_schema()}
        return {"type": "json_schema", "json_schema": schema}, value
    if isinstance(value, Mapping):
        return dict(value), None
    raise TypeError("response_format must be a pydantic model class or an OpenAI dict")


def _user_content(content: UserContent | Message) -> tuple[Message, ...]:
    if isinstance(content, str):
        return (UserMessage(content=content),)
    if isinstance(content, Sequence):  # content parts: one user message with images etc.
        # Dict parts are validated into typed parts by the model.
        return (UserMessage.model_validate({"content": tuple(content)}),)
    return tuple(MessageList.validate_python([content]))


class _Unset:
    """Marks an argument not given (``None`` is a valid timeout: no limit)."""


_UNSET = _Unset()


class _TurnSlot:
    __slots__ = ("active",)

    def __init__(self) -> None:
        self.active: PreparedTurn | None = None


class SessionCore:
    """State and decisions shared by ``Session`` and ``AsyncSession``."""

    #: Whether closing the session closes its HTTP client (set by each subclass; never on
    #: a ``with_options`` copy).
    _owns_client: bool

    def __init__(self, base_url: str | None = None, model: str | None = None,
                 **options: Unpack[SessionOptions]) -> None:
        opts: dict[str, Any] = dict(options)
        system: str | None = opts.pop("system", None)
        messages: Iterable[Message] = opts.pop("messages", ())
        session_id: str | None = opts.pop("session_id", None)
        api_key: str | None = opts.pop("api_key", None) or os.environ.get(API_KEY_ENV) or None
        tools: Iterable[Tool | Any] = opts.pop("tools", ())
        retry: RetryPolicy | None = opts.pop("retry", None)
        max_retries: int | None = opts.pop("max_retries", None)
        timeout = opts.pop("timeout", DEFAULT_TIMEOUT)
        reasoning_history = opts.pop("reasoning_history", "strip")
        if reasoning_history not in ("strip", "send"):
            raise ValueError("reasoning_history must be 'strip' or 'send'")
        defaults = opts
        base_url = base_url or os.environ.get(BASE_URL_ENV)
        if not base_url:
            raise ValueError(f"base_url is required, e.g. 'http://127.0.0.1:8000/v1' (or set "
                             f"{BASE_URL_ENV})")
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
        self.reasoning_history: _wire.ReasoningHistory = reasoning_history
        history: list[Message] = [SystemMessage(content=system)] if system else []
        history.extend(MessageList.validate_python(list(messages)))
        self._history = history
        #: The turn in flight, shared with ``with_options`` copies (one history, one turn).
        self._turn_slot = _TurnSlot()
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
            reasoning_history=self.reasoning_history, **self._defaults,
        )

    def with_options(self, *, timeout: float | httpx.Timeout | None | _Unset = _UNSET,
                     max_retries: int | None = None, headers: Mapping[str, str] | None = None,
                     **defaults: Any) -> Self:
        """This session with other defaults, like openai-python's ``with_options``.

        The copy shares the history, the HTTP client and the turn in flight with this
        session (a turn sent through either lands in the same conversation); only timeout,
        retries, headers and the given per-turn defaults differ. Closing it closes nothing.
        """
        clone = copy.copy(self)
        clone._owns_client = False
        if not isinstance(timeout, _Unset):
            clone.timeout = timeout
        if max_retries is not None:
            clone.retry = dataclasses.replace(self.retry, max_retries=max_retries)
        merged = dict(self._defaults)
        if headers:
            merged["headers"] = {**self._defaults.get("headers", {}), **headers}
        merged.update(_check_options(defaults))
        for key in _TRANSPORT_KEYS:
            merged.pop(key, None)
        clone._defaults = merged
        return clone

    # ------------------------------------------------------------------ persistence

    def to_state(self) -> SessionState:
        options = dict(self._defaults)
        options.pop("headers", None)  # may hold secrets; pass them again on load
        if isinstance(options.get("tool_choice"), Tool):
            options["tool_choice"] = _wire.tool_choice_to_wire(options["tool_choice"])
        if "response_format" in options:  # a model class is code: save its wire form
            options["response_format"] = _response_format(options["response_format"])[0]
        if self.reasoning_history != "strip":
            options["reasoning_history"] = self.reasoning_history
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
        self._turn_slot.active = prepared

    def _release(self, prepared: PreparedTurn) -> None:
        """The turn is over (finished, failed, closed or abandoned): the session is free.
        Only that turn's own release counts, so a late close never frees a newer turn."""
        if self._turn_slot.active is prepared:
            self._turn_slot.active = None

    @property
    def _busy(self) -> bool:
        return self._turn_slot.active is not None

    def _ensure_idle(self) -> None:
        if self._busy:
            raise RuntimeError(
                "a turn is already running on this session: a stream was started and is "
                "still open (not read to its end, closed, or garbage-collected). Read it to "
                "the end, close it (a with/async with block, close()/aclose()), or use "
                "fork() for parallel branches")

    def _prepare(self, content: UserContent | Message | None, options: Mapping[str, Any]
                 ) -> PreparedTurn:
        """Build the next request; nothing is added to the history until ``_commit``."""
        self._ensure_idle()
        overrides = _check_options(options)
        turn = {**self._defaults, **overrides}
        pending: tuple[Message, ...] = () if content is None else _user_content(content)
        messages = [*self._history, *pending]
        if not messages:
            raise ValueError("nothing to send: the conversation is empty")
        token = _current_token(self._history, datetime.now(UTC))
        tool_choice = turn.get("tool_choice")
        extra_body = {**self._defaults.get("extra_body", {}), **overrides.get("extra_body", {})}
        headers = {**self._defaults.get("headers", {}), **overrides.get("headers", {})}
        response_format, response_model = _response_format(turn.get("response_format"))
        if response_format is not None:
            extra_body = {"response_format": response_format, **extra_body}
        retry = self.retry
        if "max_retries" in overrides:
            retry = dataclasses.replace(retry, max_retries=overrides["max_retries"])
        request = build_chat_request(
            base_url=self.base_url, model=self.model,
            messages=_wire.messages_to_wire(messages, self.reasoning_history),
            session_id=self.session_id, cache_token=token,
            tools=[_wire.tool_to_wire(t) for t in self._tools.values()] or None,
            tool_choice=None if tool_choice is None else _wire.tool_choice_to_wire(tool_choice),
            params={k: turn[k] for k in _SAMPLING_KEYS if k in turn},
            extra_body=extra_body, api_key=self.api_key, headers=headers,
        )
        logger.debug("turn on session %s: POST %s (%d messages, token %s)", self.session_id,
                     request.url, len(messages), "sent" if token else "none")
        return PreparedTurn(pending=pending, request=request, sent_token=token,
                            base_length=len(self._history),
                            timeout=overrides.get("timeout", self.timeout), retry=retry,
                            response_model=response_model)

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
        last = next((m for m in reversed(self._history) if isinstance(m, AssistantMessage)),
                    None)
        return status_error(response, raw, model=self.model, base_url=self.base_url,
                            last_answer_cut=last is not None and last.finish_reason == "length")

    def _check_stream_headers(self, response: httpx.Response) -> None:
        check_event_stream(response)

    # ------------------------------------------------------------------ results and logs

    def _result(self, prepared: PreparedTurn, acc: StreamAccumulator, response: httpx.Response,
                now: datetime) -> TurnResult:
        """The accumulated answer with the HTTP facts (headers, request id) attached."""
        result = acc.finish(now=now).model_copy(update={
            "headers": dict(response.headers), "request_id": request_id(response.headers)})
        result._format = prepared.response_model
        logger.debug("turn on session %s done: finish_reason=%s, path=%s, reused_tokens=%s",
                     self.session_id, result.finish_reason, result.path, result.reused_tokens)
        return result

    @staticmethod
    def _log_request(request: httpx.Request) -> None:
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("request: %s %s headers=%s", request.method, request.url,
                         redact_headers(request.headers))

    @staticmethod
    def _log_response(response: httpx.Response) -> None:
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("response: HTTP %d from %s (request id %s)", response.status_code,
                         response.request.url, request_id(response.headers))


def _current_token(history: Sequence[Message], now: datetime) -> str | None:
    for message in reversed(history):
        if isinstance(message, AssistantMessage):
            expires = message.cache_token_expires_at
            if message.cache_token and (expires is None or expires > now):
                return message.cache_token
            return None
    return None
