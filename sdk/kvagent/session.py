"""The synchronous session: sends requests with ``httpx.Client`` and runs tools in threads."""

from __future__ import annotations

from collections.abc import Generator
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from types import TracebackType
from typing import Any, Self, Unpack

import httpx

from . import _telemetry as telemetry
from ._core import DRAIN_LIMIT, PreparedTurn, SessionCore, SessionOptions, TurnOptions
from ._exceptions import StreamInterrupted
from ._retry import retrying
from ._sse import SSEDecoder
from .events import Done, StreamEvent
from .messages import Message, ToolResultMessage, UserContent
from .results import RunResult, TurnResult
from .tools import PreparedCall, execute_sync

__all__ = ["Session", "TurnStream"]


class TurnStream:
    """The events of one turn. Iterate it; use it as a context manager to always close the
    connection when you stop early (the history is then left unchanged)."""

    __slots__ = ("_events", "result")

    def __init__(self, events: Generator[StreamEvent, None, None]) -> None:
        self._events = events
        #: Set once ``Done`` has been yielded.
        self.result: TurnResult | None = None

    def __iter__(self) -> TurnStream:
        return self

    def __next__(self) -> StreamEvent:
        event = next(self._events)
        if type(event) is Done:
            self.result = event.result
        return event

    def until_done(self) -> TurnResult:
        """Consume the remaining events and return the result."""
        for _ in self:
            pass
        assert self.result is not None
        return self.result

    def close(self) -> None:
        self._events.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Session(SessionCore):
    """A multi-turn conversation with an OpenAI-compatible server (sync).

    Pass ``transport=httpx.MockTransport(...)`` in tests, or your own ``http_client``
    (which the session then does not close).
    """

    def __init__(self, base_url: str | None = None, model: str | None = None, *,
                 http_client: httpx.Client | None = None,
                 transport: httpx.BaseTransport | None = None,
                 **options: Unpack[SessionOptions]) -> None:
        super().__init__(base_url, model, **options)
        if http_client is not None and transport is not None:
            raise ValueError("pass http_client= or transport=, not both")
        self._owns_client = http_client is None
        if http_client is not None and "timeout" not in options:
            self.timeout = http_client.timeout  # your client's setting, unless you pass one
        self._client = http_client or httpx.Client(transport=transport, timeout=self.timeout)

    # ------------------------------------------------------------------ lifecycle

    def close(self) -> None:
        if self._owns_client:
            self._client.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def fork(self, at: int | None = None, *, session_id: str | None = None) -> Session:
        """A new session with a copy of the history (``[:at]``) sharing this HTTP client.

        It keeps the session id (so its next turn can use the cache token) unless you pass
        another; the token is single-use, so only the first branch to send reuses it.
        """
        return Session(http_client=self._client, **self._fork_kwargs(at, session_id))

    # ------------------------------------------------------------------ turns

    def stream(self, content: UserContent | Message | None = None, **options: Unpack[TurnOptions]
               ) -> TurnStream:
        """Send ``content`` (a user message; none to just continue) and stream the answer."""
        return TurnStream(self._turn(self._prepare(content, options)))

    def send(self, content: UserContent | Message | None = None, **options: Unpack[TurnOptions]
             ) -> TurnResult:
        """Send ``content`` and return the whole answer (streamed underneath)."""
        with self.stream(content, **options) as events:
            return events.until_done()

    def run(self, content: UserContent | Message | None = None, *, max_steps: int = 10,
            parallel_tool_calls: bool = True, **options: Unpack[TurnOptions]) -> RunResult:
        """Tool loop: send, run the requested tools, feed results back, until the model
        answers without tool calls or ``max_steps`` model turns were made (the last turn's
        tool calls are still executed, so the history stays valid to continue)."""
        if max_steps < 1:
            raise ValueError("max_steps must be >= 1")
        steps: list[TurnResult] = []
        results: list[ToolResultMessage] = []
        with telemetry.run_span(model=self.model, session_id=self.session_id):
            for step in range(max_steps):
                result = self.send(content if step == 0 else None, **options)
                steps.append(result)
                if not result.tool_calls:
                    return RunResult(steps=tuple(steps), tool_results=tuple(results),
                                     stop_reason="final")
                messages = self._run_tools(self._prepare_tool_calls(result.message),
                                           parallel_tool_calls)
                self.add(*messages)
                results.extend(messages)
        return RunResult(steps=tuple(steps), tool_results=tuple(results), stop_reason="max_steps")

    def _run_tools(self, calls: list[PreparedCall], parallel: bool) -> list[ToolResultMessage]:
        parent = telemetry.current_context()
        if parallel and len(calls) > 1:
            with ThreadPoolExecutor(max_workers=min(8, len(calls))) as pool:
                return list(pool.map(lambda c: _execute(c, parent), calls))
        return [_execute(c, parent) for c in calls]

    # ------------------------------------------------------------------ I/O

    def _open(self, prepared: PreparedTurn) -> httpx.Response:
        """Send until a 2xx head arrives; only this part is ever retried."""
        req = prepared.request
        for attempt in retrying(prepared.retry):
            with attempt:
                request = self._client.build_request("POST", req.url, headers=req.headers,
                                                     content=req.body, timeout=prepared.timeout)
                self._log_request(request)
                try:
                    response = self._client.send(request, stream=True)
                except httpx.TransportError as exc:
                    raise self._connection_error(exc, req) from exc
                self._log_response(response)
                if response.status_code >= 400:
                    try:
                        raw = response.read()
                    except httpx.HTTPError:
                        raw = b""
                    finally:
                        response.close()
                    raise self._status_error(response, raw)
                return response
        raise AssertionError("unreachable")  # pragma: no cover

    def _turn(self, prepared: PreparedTurn) -> Generator[StreamEvent, None, None]:
        self._begin(prepared)
        req = prepared.request
        span = telemetry.start_turn(model=self.model, session_id=self.session_id, url=req.url,
                                    body=req.json, sent_token=prepared.sent_token is not None)
        try:
            started = self._clock()
            response = self._open(prepared)
            acc = self._accumulator(started)
            try:
                self._check_stream_headers(response)
                decoder = SSEDecoder()
                drained = 0
                try:
                    # Read to the end, past [DONE]: only a response read to its end goes
                    # back to the pool, so the next turn reuses the connection.
                    for raw in response.iter_bytes():
                        if acc.done:
                            drained += len(raw)
                            if drained > DRAIN_LIMIT:
                                break
                            continue
                        for event in decoder.feed(raw):
                            yield from acc.feed_event(event)
                    else:
                        for event in decoder.close():
                            yield from acc.feed_event(event)
                except httpx.HTTPError as exc:
                    if not acc.complete:
                        raise StreamInterrupted(f"the stream broke after it started: {exc!r}",
                                                partial_text=acc.text) from exc
            finally:
                response.close()
            result = self._result(prepared, acc, response, datetime.now(UTC))
            self._commit(prepared, result.message)
            telemetry.end_turn(span, result)
        except BaseException as exc:
            telemetry.fail_turn(span, exc)
            raise
        finally:
            self._release(prepared)
        yield Done(result)


def _execute(call: PreparedCall, parent: Any) -> ToolResultMessage:
    with telemetry.tool_span(call.call.name, call.call.id, parent) as span:
        message = execute_sync(call)
        if message.is_error:
            telemetry.mark_tool_error(span, message.content)
        return message
