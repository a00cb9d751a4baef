"""The router's HTTP surface: an OpenAI-compatible starlette app in front of P/D nodes.

This module only speaks HTTP: it authenticates, validates, extracts the session and the
token, enforces limits, and turns a turn into a streamed or whole response: it opens the
turn (`turns.pipeline`: gather, decide, execute), relays D's answer (`turns.relay`),
settles it (`turns.settle`) and writes the answer's tail.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from kvagent.protocol import BODY_FIELD, BODY_SESSION_ID, SESSION_HEADER
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvagent_server.router.apis import anthropic
from kvagent_server.router.auth.cache_token import TokenCodec
from kvagent_server.router.auth.tenancy import AuthError, Tenant, TenantResolver
from kvagent_server.router.common import fastjson, node_errors
from kvagent_server.router.http import conversation
from kvagent_server.router.http.fronts import (
    COUNT_TOKENS,
    MESSAGES,
    RESPONSES_PATH,
    Front,
    MessagesFront,
    ResponsesFront,
    load_response,
    messages_error,
    not_found,
)
from kvagent_server.router.http.limits import Admission, GuardedStream, HeaderLimit, Refused
from kvagent_server.router.http.request import (
    ClientGone,
    HTTPError,
    check_media,
    error_response,
    read_json,
    sanitize,
    session_and_token,
    validate,
)
from kvagent_server.router.reuse.retention_policy import retention_policy_for
from kvagent_server.router.settings import RouterSettings
from kvagent_server.router.store.base import SessionStore
from kvagent_server.router.store.factory import key_ring_for, key_sync_for, make_store
from kvagent_server.router.store.memory import MemoryStore
from kvagent_server.router.telemetry import budget as time_budget
from kvagent_server.router.telemetry.metrics import CONTENT_TYPE, RouterMetrics
from kvagent_server.router.telemetry.spans import record_error, record_outcome, start_turn
from kvagent_server.router.turns import kv_placement
from kvagent_server.router.turns.context import Router
from kvagent_server.router.turns.legs import LegError, Legs
from kvagent_server.router.turns.nodes import Node, NodeRegistry
from kvagent_server.router.turns.pipeline import open_turn, settle
from kvagent_server.router.turns.policy import policy_for
from kvagent_server.router.turns.prompt_ids import TokenizeError, tokenize
from kvagent_server.router.turns.relay import Scrubber, SseRelay, rewrite_response
from kvagent_server.router.turns.retention import NodeKV, PolicyEviction, RetentionGuard
from kvagent_server.router.turns.room import DecodeGate
from kvagent_server.router.turns.shapes import Turn, TurnRequest
from kvagent_server.router.turns.upstream import UpstreamError

#: Test-only negative-control header (settings.test_shift_blocks_header).
SHIFT_BLOCKS_HEADER = "x-kvagent-test-shift-blocks"

log = logging.getLogger("kvagent.router")
T = TypeVar("T")

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


# ------------------------------------------------------------------ the app


@dataclass
class AppParts:
    """What the app is made of, shared by its lifespan and its handlers (`app.state.parts`).

    Built once by `create_app`; `router` exists between the lifespan's start and stop.
    """

    settings: RouterSettings
    registry: NodeRegistry
    metrics: RouterMetrics
    store: SessionStore
    tenants: TenantResolver
    #: Requests in flight per tenant and per client address (their caps).
    admission: Admission
    #: The served model's name; None until a node answered `/v1/models`.
    model: str | None = None
    router: Router | None = None


def create_app(settings: RouterSettings, prefill: list[str], decode: list[str], *,
               model: str | None = None, store: SessionStore | None = None,
               metrics: RouterMetrics | None = None) -> Starlette:
    """The router app for the given node URLs (root URLs, e.g. `http://127.0.0.1:8100`).

    Every request to a node goes through its `upstream.NodeClient`; `store` defaults from
    `settings`
    (Redis when `redis_url` is set). Node health is probed at start-up and then every
    `health_interval_s`.
    """
    parts = AppParts(
        settings=settings,
        registry=NodeRegistry(prefill, decode, interval_s=settings.health_interval_s,
                              probe_timeout_s=5.0, max_in_flight=settings.node_max_in_flight),
        metrics=metrics or RouterMetrics(),
        store=store if store is not None else make_store(settings),
        tenants=TenantResolver(settings), model=model,
        admission=Admission(settings.max_streams_per_client))
    # An unknown policy name, or one the topology cannot run, fails here, not on a turn.
    policy_for(settings, parts.registry.topology)
    retention_policy_for(settings)  # and so do bad retention parameters
    routes = [
        Route(CHAT, _completions, methods=["POST"]),
        Route(COMPLETIONS, _completions, methods=["POST"]),
        Route(MESSAGES, _messages, methods=["POST"]),
        Route(COUNT_TOKENS, _count_tokens, methods=["POST"]),
        Route(RESPONSES_PATH, _responses, methods=["POST"]),
        Route(RESPONSES_PATH + "/{response_id}", _get_response, methods=["GET"]),
        Route("/v1/models", _models, methods=["GET"]),
        Route("/health", _health, methods=["GET"]),
        Route("/livez", _health, methods=["GET"]),
        Route("/ready", _ready, methods=["GET"]),
        Route("/metrics", _prometheus, methods=["GET"]),
    ]
    app = Starlette(routes=routes, lifespan=functools.partial(_lifespan, parts),
                    middleware=[Middleware(HeaderLimit,
                                           max_header_bytes=settings.max_header_bytes,
                                           max_header_count=settings.max_header_count),
                                Middleware(RequestIdHeader)],
                    exception_handlers={404: _not_found, 405: _not_allowed})
    app.state.parts = parts
    return app


REQUEST_ID_HEADER = b"x-request-id"


class RequestIdHeader:
    """Every response carries `x-request-id`, as vLLM's server's does when started with
    `--enable-request-id-headers` (its `XRequestIdMiddleware`): the request's own
    `X-Request-Id` echoed, else a fresh uuid4 hex. So `result.request_id` (SDK) and
    openai-python's `_request_id` are set through the router.

    Only the client sees it: the nodes are sent no request id and name each request
    themselves (see `request.CLIENT_DROPPED`). Inside `HeaderLimit`, so a 431 for an
    oversized head echoes nothing back.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = next((v for k, v in scope.get("headers") or () if k == REQUEST_ID_HEADER),
                   None) or uuid.uuid4().hex.encode()

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*(message.get("headers") or ()), (REQUEST_ID_HEADER, rid)]
            await send(message)

        await self.app(scope, receive, send_with_id)


@contextlib.asynccontextmanager
async def _lifespan(parts: AppParts, app: Starlette) -> AsyncIterator[None]:
    """Build the `Router`, start the background work, and stop it all in reverse order."""
    settings, registry, store = parts.settings, parts.registry, parts.store
    async with contextlib.AsyncExitStack() as stack:
        stack.push_async_callback(store.close)
        codec = TokenCodec(await key_ring_for(settings, store))
        # Every request to a node, legs and background alike, uses the node's pool.
        legs = Legs(max_retries=settings.max_retries, timeout_s=settings.request_timeout_s,
                    max_body_bytes=settings.max_upstream_body_bytes)
        stack.push_async_callback(legs.aclose)
        router = Router(settings=settings, registry=registry, legs=legs, store=store,
                        codec=codec, metrics=parts.metrics,
                        policy=policy_for(settings, registry.topology))
        log.info("topology %s, path policy %s", registry.topology, router.policy.name)
        parts.router = app.state.router = router
        # KV events feed tier-aware P placement (kv_placement; None without sources)
        router.tiers, kv_events = kv_placement.from_settings(settings, registry)
        if kv_events is not None:
            kv_events.start()
            stack.push_async_callback(kv_events.stop)
        await registry.probe_all(legs.client)
        if parts.model is None:
            parts.model = await _served_model(legs, registry)
        registry.start(legs.client)
        stack.push_async_callback(registry.stop)
        router.retention = _retention_guard(parts, legs, router)
        router.gate = _decode_gate(router)
        router.key_sync = key_sync_for(settings, store, codec)
        for background in (router.key_sync, router.retention):
            if background is not None:
                background.start()
                stack.push_async_callback(background.stop)
        yield


async def _completions(request: Request) -> Response:
    return await _turn(request, None)


async def _messages(request: Request) -> Response:
    return await _turn(request, MessagesFront())


async def _responses(request: Request) -> Response:
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


async def _models(request: Request) -> Response:
    parts: AppParts = request.app.state.parts
    if parts.model is None:  # the nodes were not up when the router started
        parts.model = await _served_model(request.app.state.router.legs, parts.registry)
    name = parts.model or "unknown"
    return JSONResponse({"object": "list", "data": [
        {"id": name, "object": "model", "created": 0, "owned_by": "kvagent"}]})


async def _health(request: Request) -> Response:
    return JSONResponse({"status": "ok"})


async def _ready(request: Request) -> Response:
    parts: AppParts = request.app.state.parts
    ok = parts.registry.ready and await parts.store.ping()
    nodes = {n.name: {"role": n.role, "healthy": n.healthy}
             for n in parts.registry.nodes.values()}
    return JSONResponse({"status": "ready" if ok else "not_ready", "nodes": nodes},
                        status_code=200 if ok else 503)


async def _prometheus(request: Request) -> Response:
    parts: AppParts = request.app.state.parts
    metrics, store = parts.metrics, parts.store
    for node in parts.registry.nodes.values():
        metrics.node_healthy.labels(node=node.name, role=node.role).set(int(node.healthy))
    if isinstance(store, MemoryStore):  # a scrape also drops expired handles
        store.sweep()
        metrics.store_handles.set(len(store))
        metrics.store_tokens.set(store.retained_tokens)
    return PlainTextResponse(metrics.render(), media_type=CONTENT_TYPE)


async def _not_found(request: Request, exc: Exception) -> Response:
    return error_response(404, f"no route {request.url.path}", code="not_found")


async def _not_allowed(request: Request, exc: Exception) -> Response:
    return error_response(405, f"{request.method} not allowed on {request.url.path}",
                          code="method_not_allowed")


def _retention_guard(parts: AppParts, legs: Legs, router: Router) -> RetentionGuard | None:
    """Keeps decode nodes' retained KV under the watermark, dropping what the retention
    policy ranks first (turns/retention.py)."""
    settings, metrics, nodes = parts.settings, parts.metrics, parts.registry.nodes
    if settings.retention_high_watermark is None:
        return None
    evict = PolicyEviction(parts.store, retention_policy_for(settings), router.learned.pauses)
    return RetentionGuard(
        lambda name: legs.client(nodes[name]),
        nodes=lambda: [(n.name, n.url, n.epoch) for n in parts.registry.healthy("decode")],
        evict=evict, evict_for_turn=evict.for_turn, model=lambda: parts.model,
        high=settings.retention_high_watermark, low=settings.retention_low_watermark,
        interval_s=settings.retention_check_interval_s,
        on_evicted=metrics.retention_evictions.inc,
        on_released=lambda ok, n: metrics.retention_releases.labels(
            ok=str(ok).lower()).inc(n),
        on_kv=functools.partial(_record_kv, nodes, parts))


def _record_kv(nodes: dict[str, Node], parts: AppParts, name: str, kv: NodeKV,
               read_at: float) -> None:
    """What the guard read of a decode node's KV: its usage (`policy` weighs it) and, with
    its block count, its free blocks (`DecodeRoom`)."""
    nodes[name].kv_usage = kv.usage
    if kv.total_blocks and parts.router is not None:
        parts.router.room.observe(name, total_blocks=kv.total_blocks, usage=kv.usage,
                                  read_at=read_at, stalled=kv.stalled)


def _decode_gate(router: Router) -> DecodeGate | None:
    """Admits legs to decode nodes by their KV room (turns/room.py); needs the guard's reads."""
    guard = router.retention
    if guard is None:
        return None

    def busy(node: Node) -> bool:
        return router.work.work(node.name, now=time.monotonic(), per_token_s=0.0).streams > 0

    return DecodeGate(router.room, make_room=guard.make_room, refresh=guard.refresh,
                      release=guard.release, busy=busy,
                      max_wait_s=router.settings.decode_room_wait_s,
                      on_wait=router.metrics.room_waits.inc,
                      on_revoke=router.metrics.room_revocations.inc)


async def _served_model(legs: Legs, registry: NodeRegistry) -> str | None:
    for node in registry.healthy("decode") + registry.healthy("prefill"):
        try:
            resp = await legs.client(node).get(f"{node.url}/v1/models", timeout_s=5.0)
            return str(resp.json()["data"][0]["id"])
        except (UpstreamError, ValueError, KeyError, IndexError, TypeError):
            continue
    return None


def _tenant(request: Request, tenants: TenantResolver) -> Tenant:
    """The caller's tenant, from `Authorization: Bearer` or, as Anthropic's clients send
    their key, `x-api-key`."""
    auth = request.headers.get("authorization")
    api_key = request.headers.get("x-api-key")
    if not auth and api_key:
        auth = f"Bearer {api_key}"
    try:
        return tenants.resolve(auth)
    except AuthError as exc:
        raise HTTPError(401, str(exc), type_="authentication_error", code=exc.reason) from None


async def _count_tokens(request: Request) -> Response:
    """`POST /v1/messages/count_tokens`: the prompt's length as the nodes render it."""
    parts: AppParts = request.app.state.parts
    r: Router = request.app.state.router
    try:
        _tenant(request, parts.tenants)
        try:
            raw = await read_json(request, r.settings.max_body_bytes, r.settings.body_timeout_s)
        except ClientDisconnect:
            return Response(status_code=499)
        try:
            chat = anthropic.count_tokens_chat(raw)
        except anthropic.ApiError as exc:
            raise HTTPError(exc.status, exc.message, type_=exc.type) from None
        nodes = parts.registry.healthy("prefill") + parts.registry.healthy("decode")
        if not nodes:
            raise HTTPError(503, "no node can count tokens now", type_="server_error",
                            code="upstream_unavailable")
        try:
            ids = await tokenize(r.legs.client(nodes[0]), nodes[0].url, chat, chat=True)
        except TokenizeError as exc:
            raise HTTPError(502, f"could not count the prompt's tokens: {exc}",
                            type_="server_error", code="upstream_error") from None
    except HTTPError as exc:
        return messages_error(exc)
    return JSONResponse({"input_tokens": len(ids)})


async def _get_response(request: Request) -> Response:
    """`GET /v1/responses/{id}`: a Response stored by `/v1/responses`, its caller's only."""
    parts: AppParts = request.app.state.parts
    response_id = request.path_params["response_id"]
    try:
        tenant = _tenant(request, parts.tenants)
        record = await load_response(parts.store, tenant, response_id)
        if record is None or not isinstance(record.get("response"), dict):
            raise not_found(response_id)
    except HTTPError as exc:
        return exc.response()
    return JSONResponse(record["response"])


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
    tenant = _tenant(request, tenants)
    try:
        raw = await read_json(request, r.settings.max_body_bytes, r.settings.body_timeout_s)
    except ClientDisconnect:
        raise ClientGone from None
    api_session = None
    if front is None:
        body = raw
    else:  # another API's request becomes the chat request every turn runs as
        prepared = await front.prepare(raw, tenant)
        body, api_session, endpoint = prepared.chat, prepared.session, CHAT
    chat = endpoint == CHAT
    validate(body, chat=chat, max_tokens_limit=r.settings.max_tokens_limit,
             max_messages=r.settings.max_messages, max_tools=r.settings.max_tools)
    if chat:
        check_media(body, r.settings.max_inline_media_bytes)
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
                                       r.settings.first_byte_timeout_s)
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
                write_timeout_s=r.settings.stream_write_timeout_s,
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
