"""The asynchronous session: ``httpx.AsyncClient``, tools run concurrently with gather."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable
from datetime import UTC, datetime
from types import TracebackType
from typing import Self, Unpack

import httpx

from . import _telemetry as telemetry
from ._core import DRAIN_LIMIT, PreparedTurn, SessionCore, SessionOptions, TurnOptions
from ._exceptions import StreamInterrupted
from ._retry import async_retrying
from ._sse import SSEDecoder
from .events import Done, StreamEvent
from .messages import Message, ToolResultMessage, UserContent
from .results import RunResult, TurnResult
from .tools import PreparedCall, execute_async

__all__ = ["AsyncSession", "AsyncTurnStream"]


class AsyncTurnStream:
    """The events of one turn (``async for``); ``async with`` closes the connection when you
    stop early (the history is then left unchanged).

    A stream abandoned without closing (``break`` out of ``async for``) frees its session as
    soon as it is garbage-collected; its connection is closed by the event loop shortly
    after, as for any async generator.
    """

    __slots__ = ("_events", "_release", "result")

    def __init__(self, events: AsyncGenerator[StreamEvent, None],
                 release: Callable[[], None] | None = None) -> None:
        self._events = events
        self._release = release
        #: Set once ``Done`` has been yielded.
        self.result: TurnResult | None = None

    def __del__(self) -> None:
        if self._release is not None:
            self._release()

    def __aiter__(self) -> AsyncTurnStream:
        return self

    async def __anext__(self) -> StreamEvent:
        event = await self._events.__anext__()
        if type(event) is Done:
            self.result = event.result
        return event

    async def until_done(self) -> TurnResult:
        """Consume the remaining events and return the result."""
        async for _ in self:
            pass
        assert self.result is not None
        return self.result

    async def aclose(self) -> None:
        try:
            await self._events.aclose()
        finally:
            if self._release is not None:
                self._release()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


class AsyncSession(SessionCore):
    """A multi-turn conversation with an OpenAI-compatible server (async).

    Pass ``transport=httpx.MockTransport(...)`` in tests, or your own ``http_client``
    (which the session then does not close).
    """

    def __init__(self, base_url: str | None = None, model: str | None = None, *,
                 http_client: httpx.AsyncClient | None = None,
                 transport: httpx.AsyncBaseTransport | None = None,
                 **options: Unpack[SessionOptions]) -> None:
        super().__init__(base_url, model, **options)
        if http_client is not None and transport is not None:
            raise ValueError("pass http_client= or transport=, not both")
        self._owns_client = http_client is None
        if http_client is not None and "timeout" not in options:
            self.timeout = http_client.timeout  # your client's setting, unless you pass one
        self._client = http_client or httpx.AsyncClient(transport=transport, timeout=self.timeout)

    # ------------------------------------------------------------------ lifecycle

    async def aclose(self) -> None:
        if self._owns_client:
            await self._client.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.aclose()

    def fork(self, at: int | None = None, *, session_id: str | None = None) -> AsyncSession:
        """A new session with a copy of the history (``[:at]``) sharing this HTTP client.

        It keeps the session id (so its next turn can use the cache token) unless you pass
        another; the token is single-use, so only the first branch to send reuses it.
        """
        return AsyncSession(http_client=self._client, **self._fork_kwargs(at, session_id))

    # ------------------------------------------------------------------ turns

    def stream(self, content: UserContent | Message | None = None, **options: Unpack[TurnOptions]
               ) -> AsyncTurnStream:
        """Send ``content`` (a user message; none to just continue) and stream the answer."""
        prepared = self._prepare(content, options)
        return AsyncTurnStream(self._turn(prepared), lambda: self._release(prepared))

    async def send(self, content: UserContent | Message | None = None,
                   **options: Unpack[TurnOptions]) -> TurnResult:
        """Send ``content`` and return the whole answer (streamed underneath)."""
        async with self.stream(content, **options) as events:
            return await events.until_done()

    async def run(self, content: UserContent | Message | None = None, *, max_steps: int = 10,
                  parallel_tool_calls: bool = True, **options: Unpack[TurnOptions]
                  ) -> RunResult:
        """Tool loop: send, run the requested tools, feed results back, until the model
        answers without tool calls or ``max_steps`` model turns were made (the last turn's
        tool calls are still executed, so the history stays valid to continue)."""
        if max_steps < 1:
            raise ValueError("max_steps must be >= 1")
        steps: list[TurnResult] = []
        results: list[ToolResultMessage] = []
        with telemetry.run_span(model=self.model, session_id=self.session_id):
            for step in range(max_steps):
                result = await self.send(content if step == 0 else None, **options)
                steps.append(result)
                if not result.tool_calls:
                    return RunResult(steps=tuple(steps), tool_results=tuple(results),
                                     stop_reason="final")
                calls = self._prepare_tool_calls(result.message)
                if parallel_tool_calls:
                    messages = list(await asyncio.gather(*(_execute(c) for c in calls)))
                else:
                    messages = [await _execute(c) for c in calls]
                self.add(*messages)
                results.extend(messages)
        return RunResult(steps=tuple(steps), tool_results=tuple(results), stop_reason="max_steps")

    # ------------------------------------------------------------------ I/O

    async def _open(self, prepared: PreparedTurn) -> httpx.Response:
        """Send until a 2xx head arrives; only this part is ever retried."""
        req = prepared.request
        async for attempt in async_retrying(prepared.retry):
            with attempt:
                request = self._client.build_request("POST", req.url, headers=req.headers,
                                                     content=req.body, timeout=prepared.timeout)
                self._log_request(request)
                try:
                    response = await self._client.send(request, stream=True)
                except httpx.TransportError as exc:
                    raise self._connection_error(exc, req) from exc
                self._log_response(response)
                if response.status_code >= 400:
                    try:
                        raw = await response.aread()
                    except httpx.HTTPError:
                        raw = b""
                    finally:
                        await response.aclose()
                    raise self._status_error(response, raw)
                return response
        raise AssertionError("unreachable")  # pragma: no cover

    async def _turn(self, prepared: PreparedTurn) -> AsyncGenerator[StreamEvent, None]:
        self._begin(prepared)
        req = prepared.request
        span = telemetry.start_turn(model=self.model, session_id=self.session_id, url=req.url,
                                    body=req.json, sent_token=prepared.sent_token is not None)
        try:
            started = self._clock()
            response = await self._open(prepared)
            acc = self._accumulator(started)
            try:
                self._check_stream_headers(response)
                decoder = SSEDecoder()
                drained = 0
                try:
                    # Read to the end, past [DONE]: only a response read to its end goes
                    # back to the pool, so the next turn reuses the connection.
                    async for raw in response.aiter_bytes():
                        if acc.done:
                            drained += len(raw)
                            if drained > DRAIN_LIMIT:
                                break
                            continue
                        for event in decoder.feed(raw):
                            for delta in acc.feed_event(event):
                                yield delta
                    else:
                        for event in decoder.close():
                            for delta in acc.feed_event(event):
                                yield delta
                except httpx.HTTPError as exc:
                    if not acc.complete:
                        raise StreamInterrupted(f"the stream broke after it started: {exc!r}",
                                                partial_text=acc.text) from exc
            finally:
                await response.aclose()
            result = self._result(prepared, acc, response, datetime.now(UTC))
            self._commit(prepared, result.message)
            telemetry.end_turn(span, result)
        except BaseException as exc:
            telemetry.fail_turn(span, exc)
            raise
        finally:
            self._release(prepared)
        yield Done(result)


async def _execute(call: PreparedCall) -> ToolResultMessage:
    with telemetry.tool_span(call.call.name, call.call.id) as span:
        message = await execute_async(call)
        if message.is_error:
            telemetry.mark_tool_error(span, message.content)
        return message
