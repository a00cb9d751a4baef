"""The router's small endpoints: models, health, readiness, metrics, token counting, stored
Responses, and the answers for unknown routes and methods. Each is one read, no turn."""

from __future__ import annotations

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response

from kvagent_server.router.apis import anthropic
from kvagent_server.router.http.fronts import load_response, messages_error, not_found
from kvagent_server.router.http.parts import AppParts
from kvagent_server.router.http.request import HTTPError, error_response, read_json, tenant_of
from kvagent_server.router.nodes.client import UpstreamError
from kvagent_server.router.nodes.legs import Legs
from kvagent_server.router.nodes.prompt_ids import TokenizeError, tokenize
from kvagent_server.router.nodes.registry import NodeRegistry
from kvagent_server.router.store.memory import MemoryStore
from kvagent_server.router.telemetry.metrics import CONTENT_TYPE
from kvagent_server.router.turns.context import Router


async def models(request: Request) -> Response:
    parts: AppParts = request.app.state.parts
    if parts.model is None:  # the nodes were not up when the router started
        parts.model = await served_model(request.app.state.router.legs, parts.registry)
    name = parts.model or "unknown"
    return JSONResponse({"object": "list", "data": [
        {"id": name, "object": "model", "created": 0, "owned_by": "kvagent"}]})


async def health(request: Request) -> Response:
    return JSONResponse({"status": "ok"})


async def ready(request: Request) -> Response:
    parts: AppParts = request.app.state.parts
    ok = parts.registry.ready and await parts.store.ping()
    nodes = {n.name: {"role": n.role, "healthy": n.healthy}
             for n in parts.registry.nodes.values()}
    return JSONResponse({"status": "ready" if ok else "not_ready", "nodes": nodes},
                        status_code=200 if ok else 503)


async def prometheus(request: Request) -> Response:
    parts: AppParts = request.app.state.parts
    metrics, store = parts.metrics, parts.store
    for node in parts.registry.nodes.values():
        metrics.node_healthy.labels(node=node.name, role=node.role).set(int(node.healthy))
    if isinstance(store, MemoryStore):  # a scrape also drops expired handles
        store.sweep()
        metrics.store_handles.set(len(store))
        metrics.store_tokens.set(store.retained_tokens)
    return PlainTextResponse(metrics.render(), media_type=CONTENT_TYPE)


async def route_not_found(request: Request, exc: Exception) -> Response:
    return error_response(404, f"no route {request.url.path}", code="not_found")


async def method_not_allowed(request: Request, exc: Exception) -> Response:
    return error_response(405, f"{request.method} not allowed on {request.url.path}",
                          code="method_not_allowed")


async def served_model(legs: Legs, registry: NodeRegistry) -> str | None:
    for node in registry.healthy("decode") + registry.healthy("prefill"):
        try:
            resp = await legs.client(node).get(f"{node.url}/v1/models", timeout_s=5.0)
            return str(resp.json()["data"][0]["id"])
        except (UpstreamError, ValueError, KeyError, IndexError, TypeError):
            continue
    return None


async def count_tokens(request: Request) -> Response:
    """`POST /v1/messages/count_tokens`: the prompt's length as the nodes render it."""
    parts: AppParts = request.app.state.parts
    r: Router = request.app.state.router
    try:
        tenant_of(request, parts.tenants)
        try:
            limits = r.settings.limits
            raw = await read_json(request, limits.max_body_bytes, limits.body_timeout_s)
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


async def get_response(request: Request) -> Response:
    """`GET /v1/responses/{id}`: a Response stored by `/v1/responses`, its caller's only."""
    parts: AppParts = request.app.state.parts
    response_id = request.path_params["response_id"]
    try:
        tenant = tenant_of(request, parts.tenants)
        record = await load_response(parts.store, tenant, response_id)
        if record is None or not isinstance(record.get("response"), dict):
            raise not_found(response_id)
    except HTTPError as exc:
        return exc.response()
    return JSONResponse(record["response"])
