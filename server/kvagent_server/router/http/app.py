"""The router's HTTP surface: an OpenAI-compatible starlette app in front of P/D nodes.

This module assembles it: the routes (the turn's HTTP shell, `http.turn`; the small
endpoints, `http.endpoints`), the middleware (`http.limits.HeaderLimit`,
`http.request_id`), and the lifespan that builds the `Router` and starts and stops its
background work.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import AsyncIterator

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.routing import Route

from kvagent_server.router.auth.cache_token import TokenCodec
from kvagent_server.router.auth.tenancy import TenantResolver
from kvagent_server.router.http.endpoints import (
    count_tokens,
    get_response,
    health,
    method_not_allowed,
    models,
    prometheus,
    ready,
    route_not_found,
    served_model,
)
from kvagent_server.router.http.fronts import COUNT_TOKENS, MESSAGES, RESPONSES_PATH
from kvagent_server.router.http.limits import Admission, HeaderLimit
from kvagent_server.router.http.parts import AppParts
from kvagent_server.router.http.request_id import RequestIdHeader
from kvagent_server.router.http.turn import (
    CHAT,
    COMPLETIONS,
    completions_turn,
    messages_turn,
    responses_turn,
)
from kvagent_server.router.kv.tiers import TierCostLearner
from kvagent_server.router.nodes import tier_placement
from kvagent_server.router.nodes.admission import DecodeGate
from kvagent_server.router.nodes.legs import Legs
from kvagent_server.router.nodes.registry import Node, NodeRegistry
from kvagent_server.router.nodes.retention import NodeKV, PolicyEviction, RetentionGuard
from kvagent_server.router.nodes.spills import Spills
from kvagent_server.router.reuse.retention_policy import retention_policy_for
from kvagent_server.router.reuse.spill import tiers_by_name
from kvagent_server.router.settings import RouterSettings
from kvagent_server.router.store.base import SessionStore
from kvagent_server.router.store.factory import key_ring_for, key_sync_for, make_store
from kvagent_server.router.telemetry.metrics import RouterMetrics
from kvagent_server.router.turns.context import Router
from kvagent_server.router.turns.policy import policy_for

log = logging.getLogger("kvagent.router")


def create_app(settings: RouterSettings, prefill: list[str], decode: list[str], *,
               model: str | None = None, store: SessionStore | None = None,
               metrics: RouterMetrics | None = None) -> Starlette:
    """The router app for the given node URLs (root URLs, e.g. `http://127.0.0.1:8100`).

    Every request to a node goes through its `nodes.client.NodeClient`; `store` defaults
    from `settings` (Redis when `redis_url` is set). Node health is probed at start-up and
    then every `health_interval_s`.
    """
    parts = AppParts(
        settings=settings,
        registry=NodeRegistry(prefill, decode, interval_s=settings.nodes.health_interval_s,
                              probe_timeout_s=5.0, max_in_flight=settings.nodes.max_in_flight),
        metrics=metrics or RouterMetrics(),
        store=store if store is not None else make_store(settings),
        tenants=TenantResolver(settings), model=model,
        admission=Admission(settings.limits.max_streams_per_client))
    # An unknown policy name, or one the topology cannot run, fails here, not on a turn.
    policy_for(settings, parts.registry.topology)
    retention_policy_for(settings)  # and so do bad retention parameters
    routes = [
        Route(CHAT, completions_turn, methods=["POST"]),
        Route(COMPLETIONS, completions_turn, methods=["POST"]),
        Route(MESSAGES, messages_turn, methods=["POST"]),
        Route(COUNT_TOKENS, count_tokens, methods=["POST"]),
        Route(RESPONSES_PATH, responses_turn, methods=["POST"]),
        Route(RESPONSES_PATH + "/{response_id}", get_response, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/livez", health, methods=["GET"]),
        Route("/ready", ready, methods=["GET"]),
        Route("/metrics", prometheus, methods=["GET"]),
    ]
    app = Starlette(routes=routes, lifespan=functools.partial(_lifespan, parts),
                    middleware=[Middleware(HeaderLimit,
                                           max_header_bytes=settings.limits.max_header_bytes,
                                           max_header_count=settings.limits.max_header_count),
                                Middleware(RequestIdHeader)],
                    exception_handlers={404: route_not_found, 405: method_not_allowed})
    app.state.parts = parts
    return app


@contextlib.asynccontextmanager
async def _lifespan(parts: AppParts, app: Starlette) -> AsyncIterator[None]:
    """Build the `Router`, start the background work, and stop it all in reverse order."""
    settings, registry, store = parts.settings, parts.registry, parts.store
    async with contextlib.AsyncExitStack() as stack:
        stack.push_async_callback(store.close)
        codec = TokenCodec(await key_ring_for(settings, store))
        # Every request to a node, legs and background alike, uses the node's pool.
        legs = Legs(max_retries=settings.nodes.max_retries,
                    timeout_s=settings.nodes.request_timeout_s,
                    max_body_bytes=settings.limits.max_upstream_body_bytes,
                    ledger=registry.ledger)
        stack.push_async_callback(legs.aclose)
        router = Router(settings=settings, registry=registry, legs=legs, store=store,
                        codec=codec, metrics=parts.metrics,
                        policy=policy_for(settings, registry.topology))
        log.info("topology %s, path policy %s", registry.topology, router.policy.name)
        parts.router = app.state.router = router
        # KV events feed tier-aware P placement (tier_placement; None without sources)
        router.tiers, kv_events = tier_placement.from_settings(settings, registry)
        router.spills = _spills(parts)
        router.tier_costs = TierCostLearner(router.tiers.costs if router.tiers else None)
        if kv_events is not None:
            kv_events.start()
            stack.push_async_callback(kv_events.stop)
        await registry.probe_all(legs.client)
        if parts.model is None:
            parts.model = await served_model(legs, registry)
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


def _spills(parts: AppParts) -> Spills | None:
    """Records conversations given up on tiered decode nodes as spilled (nodes/spills.py)."""
    settings, registry = parts.settings, parts.registry
    tiers = tiers_by_name(settings.engine.kv_tiers,
                          {n.name: n.url for n in registry.nodes.values()})
    if not tiers or settings.retention.spill_ttl_s <= 0:
        return None
    return Spills(parts.store, tiers, ttl_s=settings.retention.spill_ttl_s,
                  on_spilled=parts.metrics.spills.inc)


def _retention_guard(parts: AppParts, legs: Legs, router: Router) -> RetentionGuard | None:
    """Keeps decode nodes' retained KV under the watermark, dropping what the retention
    policy ranks first (nodes/retention.py)."""
    settings, metrics, nodes = parts.settings, parts.metrics, parts.registry.nodes
    if settings.retention.high_watermark is None:
        return None
    evict = PolicyEviction(parts.store, retention_policy_for(settings), router.learned.pauses)
    return RetentionGuard(
        lambda name: legs.client(nodes[name]),
        nodes=lambda: [(n.name, n.url, n.epoch) for n in parts.registry.healthy("decode")],
        evict=evict, evict_for_turn=evict.for_turn, model=lambda: parts.model,
        high=settings.retention.high_watermark, low=settings.retention.low_watermark,
        interval_s=settings.retention.check_interval_s,
        on_evicted=metrics.retention_evictions.inc,
        on_released=lambda ok, n: metrics.retention_releases.labels(
            ok=str(ok).lower()).inc(n),
        on_kv=functools.partial(_record_kv, nodes, parts),
        on_given_up=router.spills.record if router.spills is not None else None)


def _record_kv(nodes: dict[str, Node], parts: AppParts, name: str, kv: NodeKV,
               read_at: float) -> None:
    """What the guard read of a decode node's KV: its usage (`policy` weighs it), its
    tier loads (the learned tier prices) and, with its block count, its free blocks (the
    ledger's `free`)."""
    nodes[name].kv_usage = kv.usage
    if kv.loads is not None and parts.router is not None:  # what its tier loads cost
        learner = parts.router.tier_costs
        learner.observe(name, kv.loads)
        costs = learner.costs()
        parts.metrics.tier_load_cost.labels(tier="host").set(costs.cpu_s_per_token)
        parts.metrics.tier_load_cost.labels(tier="disk").set(costs.disk_s_per_token)
    if kv.total_blocks and parts.router is not None:
        parts.router.ledger.observe(name, total_blocks=kv.total_blocks, usage=kv.usage,
                                  read_at=read_at, stalled=kv.stalled)


def _decode_gate(router: Router) -> DecodeGate | None:
    """Admits legs to decode nodes by their KV room (nodes/admission.py); needs the guard's reads."""
    guard = router.retention
    if guard is None:
        return None
    return DecodeGate(router.ledger, make_room=guard.make_room, refresh=guard.refresh,
                      release=guard.release, room_on_its_way=guard.room_on_its_way,
                      max_wait_s=router.settings.retention.decode_room_wait_s,
                      on_wait=router.metrics.room_waits.inc,
                      on_revoke=router.metrics.room_revocations.inc)
