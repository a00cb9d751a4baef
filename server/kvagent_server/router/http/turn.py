"""The turn's HTTP shell: one request through any front door becomes a streamed or whole
response. It opens the turn (`turns.pipeline`: gather, decide, execute), relays D's answer
(`turns.relay`), settles it (`turns.settle`) and writes the answer's tail; what fails on
the way becomes the front door's error.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any, TypeVar

from kvagent.protocol import BODY_FIELD, BODY_SESSION_ID, SESSION_HEADER
from starlette.background import BackgroundTask
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

from kvagent_server.router.auth.tenancy import Tenant, TenantResolver
from kvagent_server.router.common import fastjson, node_errors
from kvagent_server.router.http import conversation
from kvagent_server.router.http.fronts import Front, MessagesFront, ResponsesFront
from kvagent_server.router.http.limits import Admission, GuardedStream, Refused
from kvagent_server.router.http.parts import AppParts
from kvagent_server.router.http.request import (
    ClientGone,
    HTTPError,
    check_media,
    error_response,
    read_json,
    sanitize,
    session_and_token,
    tenant_of,
    validate,
)
from kvagent_server.router.nodes.client import UpstreamError
from kvagent_server.router.nodes.legs import LegError
from kvagent_server.router.telemetry import budget as time_budget
from kvagent_server.router.telemetry.spans import record_error, record_outcome, start_turn
from kvagent_server.router.turns.context import Router
from kvagent_server.router.turns.pipeline import open_turn, settle
from kvagent_server.router.turns.relay import Scrubber, SseRelay, rewrite_response
from kvagent_server.router.turns.shapes import Turn, TurnRequest

#: Test-only negative-control header (settings.test_shift_blocks_header).
SHIFT_BLOCKS_HEADER = "x-kvagent-test-shift-blocks"

log = logging.getLogger("kvagent.router")
T = TypeVar("T")

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


async def completions_turn(request: Request) -> Response:
    return await _turn(request, None)


async def messages_turn(request: Request) -> Response:
    return await _turn(request, MessagesFront())


async def responses_turn(request: Request) -> Response:
    parts: AppParts = request.app.state.parts
    return await _turn(request, ResponsesFront(parts.store, parts.settings))


async def _turn(request: Request, front: Front | None) -> Response:
    """One turn through any front door: chat and completions as they are, the other APIs
    translated to chat (`front`)."""
    arrived = time.perf_counter()
    endpoint = request.url.path
    parts: AppParts = request.app.state.parts
    r: Router = request.app.state.router
    metrics = parts.metrics
    metrics.in_flight.inc()
    try:
        response = await _serve(request, r, endpoint, parts.tenants, parts.admission,
                                arrived, front)
    except HTTPError as exc:
        response = exc.response() if front is None else front.error(exc)
    except ClientGone:
        metrics.client_disconnects.inc()
        response = Response(status_code=499)
    except Exception:  # a bug: still an OpenAI error, and nothing internal in it
        log.exception("unexpected error serving %s", endpoint)
        response = error_response(500, "internal router error", type_="server_error",
                                  code="internal_error")
    finally:
        metrics.in_flight.dec()
    metrics.requests.labels(endpoint=endpoint, status=str(response.status_code)).inc()
    return response


def _own_session(headers: Any, body: dict[str, Any]) -> bool:
    """Whether the request names its session kvagent's own way (header or body object),
    which comes before any agent's id; `conversation_id` comes after them."""
    extra = body.get(BODY_FIELD)
    return bool(headers.get(SESSION_HEADER)) or (
        isinstance(extra, dict) and extra.get(BODY_SESSION_ID) is not None)


def _conversation(tenant: Tenant, request: Request, raw: dict[str, Any], body: dict[str, Any],
                  api_session: str | None) -> tuple[str | None, str | None, str | None]:
    """The turn's session as the store knows it, its source, and the cache token
    (`http.conversation` gives the order)."""
    own = _own_session(request.headers, body)
    session, token = session_and_token(request.headers, body)  # validates kvagent's own
    if session is not None and own:
        return tenant.session_key(session), "kvagent", token
    if api_session is not None:  # already the caller's: it was stored under their key
        return api_session, "previous_response", token
    agent = conversation.from_agents(request.headers, raw)
    if agent is not None:
        return tenant.session_key(agent.key), agent.source, token
    if session is not None:
        return tenant.session_key(session), "conversation_id", token
    return None, None, token


async def _serve(request: Request, r: Router, endpoint: str, tenants: TenantResolver,
                 admission: Admission, arrived: float, front: Front | None) -> Response:
    tenant = tenant_of(request, tenants)
    try:
        limits = r.settings.limits
        raw = await read_json(request, limits.max_body_bytes, limits.body_timeout_s)
    except ClientDisconnect:
        raise ClientGone from None
    api_session = None
    if front is None:
        body = raw
    else:  # another API's request becomes the chat request every turn runs as
        prepared = await front.prepare(raw, tenant)
        body, api_session, endpoint = prepared.chat, prepared.session, CHAT
    chat = endpoint == CHAT
    validate(body, chat=chat, max_tokens_limit=r.settings.limits.max_tokens_limit,
             max_messages=r.settings.limits.max_messages, max_tools=r.settings.limits.max_tools)
    if chat:
        check_media(body, r.settings.limits.max_inline_media_bytes)
    session, source, token = _conversation(tenant, request, raw, body, api_session)
    wants_usage = bool((body.get("stream_options") or {}).get("include_usage"))
    keep_ids = bool(body.get("return_token_ids"))
    sanitize(body)  # only the router may steer KV transfers
    body["cache_salt"] = tenant.cache_salt
    try:
        slot = admission.admit(tenant.name, tenant.max_concurrent_streams,
                               request.client.host if request.client else "?")
    except Refused as exc:
        raise HTTPError(429, str(exc), type_="rate_limit_error",
                        code="rate_limit_exceeded") from None
    span = start_turn(endpoint=request.url.path, model=body.get("model"), session=session,
                      tenant=tenant.name, arrived=arrived)
    # The store and the tokens know the session by the caller's key, not its id alone.
    req = TurnRequest.build(
        endpoint=endpoint, body=body, tenant=tenant, session=session, token=token,
        source=source, span=span, budget=time_budget.TurnBudget(arrived=arrived),
        shift_blocks=(r.settings.test_shift_blocks_header
                      and SHIFT_BLOCKS_HEADER in request.headers))

    async def cleanup(turn: Turn | None = None) -> None:
        """Idempotent: close the turn's D leg, free the request's slots, end the span."""
        if turn is not None:
            await turn.close()
        if slot.release():
            span.end()

    handed_off = False
    try:
        turn = await _until_disconnect(request, open_turn(r, req),
                                       r.settings.limits.first_byte_timeout_s)
        scrubber = Scrubber(keep_token_ids=keep_ids, keep_usage=wants_usage or not req.stream,
                            stream=req.stream)
        if req.stream:
            handed_off = True
            headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
            if r.settings.server_timing:  # the stages before the headers (docs/router.md)
                headers[time_budget.HEADER] = req.budget.server_timing()
            relayed = _stream(r, turn, scrubber, cleanup)
            return GuardedStream(
                relayed if front is None else front.stream(relayed, turn.facts.session),
                media_type="text/event-stream", headers=headers,
                background=BackgroundTask(cleanup, turn),
                write_timeout_s=r.settings.limits.stream_write_timeout_s,
                on_stall=r.metrics.slow_clients.inc)
        try:
            return await _whole(r, turn, scrubber, front)
        finally:
            await turn.close()
    except LegError as exc:
        record_error(span, str(exc))
        raise _leg_error(exc) from None
    except BaseException as exc:
        record_error(span, type(exc).__name__)
        raise
    finally:
        if not handed_off:
            await cleanup()


def _leg_error(exc: LegError) -> HTTPError:
    if 400 <= exc.status < 500 and exc.body and isinstance(exc.body.get("error"), dict):
        err = exc.body["error"]  # a node's words, unless they name something internal
        return HTTPError(exc.status, node_errors.client_message(err.get("message")),
                         type_=node_errors.client_type(err.get("type")),
                         param=node_errors.client_param(err.get("param")))
    if 400 <= exc.status < 500:
        return HTTPError(exc.status, "the model server rejected the request")
    if exc.status == 504:
        return HTTPError(504, f"{exc.leg} leg timed out: no node answered within the request "
                         "timeout", type_="server_error", code="upstream_timeout")
    status = 503 if exc.status == 503 else 502
    return HTTPError(status, f"{exc.leg} leg failed: no node could serve the request",
                     type_="server_error", code="upstream_unavailable")


async def _until_disconnect(request: Request, work: Awaitable[T], seconds: float) -> T:
    """Run `work` (planning and opening the legs): cancelled if the client disconnects
    first (ClientGone), or a 504 once `seconds` have passed. Cancelling the turn closes
    its legs (a P leg whose D leg never came is released)."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    watch = asyncio.ensure_future(disconnected())
    try:
        done, _ = await asyncio.wait({task, watch}, timeout=seconds,
                                     return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watch.cancel()
    if task in done:
        return task.result()
    task.cancel()
    with contextlib.suppress(BaseException):
        await task
    if watch in done:
        raise ClientGone
    raise HTTPError(504, f"the model servers did not start answering within {seconds:g} s",
                    type_="server_error", code="upstream_timeout")


async def _whole(r: Router, turn: Turn, scrubber: Scrubber, front: Front | None) -> Response:
    """A whole answer: read D's body, scrub it (the relay), settle, then write it."""
    req = turn.req
    resp = turn.decode.response
    r.metrics.ttft.observe(turn.mark_first_byte() - turn.started)
    assert resp.content is not None  # a non-streamed leg's body is read whole
    data, std = fastjson.parse(resp.content)
    scrubber.scrub(data)
    final = await settle(r, turn, scrubber.capture)
    out = rewrite_response(data, scrubber, final)
    usage = out.get("usage") or {}
    record_outcome(req.span, path=turn.path, reused=final.reused,
                   prompt_tokens=usage.get("prompt_tokens"),
                   completion_tokens=usage.get("completion_tokens"), reason=turn.plan.reuse.label)
    req.budget.record(req.span)
    headers = ({time_budget.HEADER: req.budget.server_timing()}
               if r.settings.server_timing else None)
    if front is not None:
        return JSONResponse(await front.whole(out, turn.facts.session), headers=headers)
    if std:  # NaN/Infinity: starlette's encoder refuses them, as it always has
        return JSONResponse(out, headers=headers)
    return Response(fastjson.dumps(out), media_type="application/json", headers=headers)


async def _stream(r: Router, turn: Turn, scrubber: Scrubber,
                  cleanup: Callable[[Turn], Awaitable[None]]) -> AsyncGenerator[bytes, None]:
    """The client's stream: D's chunks as they come (relay), then the turn is settled,
    then the tail carrying its `kvagent` object. An upstream failure mid-stream
    propagates: the stream is cut, and nothing is settled."""
    req, m = turn.req, r.metrics
    relay = SseRelay(scrubber)
    finished = False
    try:
        async for out in relay.relay(turn.decode.response.aiter_raw()):
            if turn.first_byte_at is None:
                first = turn.mark_first_byte()
                m.ttft.observe(first - turn.started)
                req.budget.add_remainder("first_token", first)
            yield out
        final = await settle(r, turn, relay.capture)
        tail = relay.tail(final)
        if tail:
            yield tail
        finished = True
        req.budget.record(req.span)
        usage = relay.capture.usage or {}
        record_outcome(req.span, path=turn.path, reused=final.reused,
                       prompt_tokens=usage.get("prompt_tokens"),
                       completion_tokens=usage.get("completion_tokens"),
                       reason=turn.plan.reuse.label)
    except UpstreamError as exc:
        m.stream_cuts.inc()
        record_error(req.span, f"stream cut: {exc}")
        log.warning("decode stream from %s cut: %s", turn.decode.node.name, exc)
        raise
    except (asyncio.CancelledError, GeneratorExit):
        if not finished:
            m.client_disconnects.inc()
        raise
    finally:
        await cleanup(turn)
