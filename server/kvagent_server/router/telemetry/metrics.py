"""The router's Prometheus metrics, on a registry of its own (one per app instance).

What an operator needs to see whether reuse pays: hits and misses by reason, tokens
reused vs recomputed, which path turns took, and the latency of each leg and of TTFT.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                    10.0, 30.0, 60.0)

CONTENT_TYPE = CONTENT_TYPE_LATEST


class RouterMetrics:
    """Every metric the router exports; prefixed `kvagent_router_`."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.requests = Counter("kvagent_router_requests", "Requests by endpoint and status.",
                                ["endpoint", "status"], registry=r)
        self.reuse_hits = Counter("kvagent_router_reuse_hits", "Turns that reused cached KV.",
                                  registry=r)
        self.reuse_misses = Counter("kvagent_router_reuse_misses",
                                    "Turns that could not reuse, by reason.", ["reason"],
                                    registry=r)
        self.reused_tokens = Counter("kvagent_router_reused_tokens",
                                     "Prompt tokens served from retained KV.", registry=r)
        self.recomputed_tokens = Counter("kvagent_router_recomputed_tokens",
                                         "Prompt tokens computed by a node.", registry=r)
        self.paths = Counter("kvagent_router_turns", "Turns by path taken.", ["path"],
                             registry=r)
        self.tokenize_skipped = Counter(
            "kvagent_router_tokenize_skipped",
            "Reused turns sent d_direct, or pd_reuse to a P node that checks its pulls, "
            "without the router's /tokenize (their messages extend the held turn's).",
            registry=r)
        self.prompt_ids_forwarded = Counter(
            "kvagent_router_prompt_ids_forwarded",
            "D legs that took the prompt token ids P computed instead of rendering the chat "
            "again (router.forward_prompt_ids).", registry=r)
        self.first_tokens_forwarded = Counter(
            "kvagent_router_first_tokens_forwarded",
            "D legs given the token P sampled, to emit and compute from "
            "(router.forward_first_token).", registry=r)
        self.leg_latency = Histogram("kvagent_router_leg_seconds",
                                     "Leg latency (P: whole leg; D: to response headers).",
                                     ["leg"], buckets=_LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("kvagent_router_ttft_seconds",
                              "Router arrival to first content byte sent.",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.in_flight = Gauge("kvagent_router_in_flight", "Requests being served.",
                               registry=r)
        self.retries = Counter("kvagent_router_leg_retries",
                               "Legs retried on another node before their first byte.",
                               ["leg"], registry=r)
        self.stream_cuts = Counter("kvagent_router_stream_cuts",
                                   "Streams cut after their first byte (upstream failure).",
                                   registry=r)
        self.client_disconnects = Counter("kvagent_router_client_disconnects",
                                          "Requests whose client went away mid-turn.",
                                          registry=r)
        self.slow_clients = Counter("kvagent_router_slow_clients",
                                    "Streams cut because the client stopped reading.",
                                    registry=r)
        self.prefill_releases = Counter("kvagent_router_prefill_releases",
                                        "Orphaned P legs finished explicitly.", ["ok"],
                                        registry=r)
        self.retention_evictions = Counter(
            "kvagent_router_retention_evictions",
            "Retained handles evicted because their decode node's KV passed the high "
            "watermark.", registry=r)
        self.retention_releases = Counter(
            "kvagent_router_retention_releases",
            "Retained decode requests released early (evicted), by delivery.", ["ok"],
            registry=r)
        self.room_waits = Counter(
            "kvagent_router_decode_room_waits",
            "Turns that waited for KV room on their decode node.", registry=r)
        self.room_revocations = Counter(
            "kvagent_router_decode_room_revocations",
            "Handles of waiting turns released to make KV room (those turns recompute).",
            registry=r)
        self.store_handles = Gauge("kvagent_router_store_handles",
                                   "Live session handles in this router's store.", registry=r)
        self.store_tokens = Gauge("kvagent_router_store_tokens",
                                  "Token ids held by those handles.", registry=r)
        self.placements = Counter("kvagent_router_prefill_placements",
                                  "P-node choices by reason (tier_hit: a cached prefix "
                                  "won; tier_miss: matched, no hit; least_loaded).",
                                  ["reason"], registry=r)
        self.decode_placements = Counter(
            "kvagent_router_decode_placements",
            "D-node choices by reason (affinity, least_loaded, affinity_unknown, "
            "affinity_unhealthy, affinity_overloaded, affinity_busy, no_healthy_node).",
            ["reason"], registry=r)
        self.spills = Counter(
            "kvagent_router_spills",
            "Given-up handles recorded as spilled to their decode node's KV tiers "
            "(reuse/spill.py).", registry=r)
        self.tier_reuse = Counter(
            "kvagent_router_tier_reuse",
            "Turns of a spilled conversation planned to load its prefix from a tier, by "
            "source (tier_host: the holding node's host tier, d_direct; tier_disk: the "
            "shared disk, through P).", ["source"], registry=r)
        self.tier_load_cost = Gauge(
            "kvagent_router_tier_load_seconds_per_token",
            "Seconds per prompt token loaded from a KV tier, learned from the decode nodes' "
            "vllm:kv_offload_load_time and vllm:prompt_tokens_cached_by_source (the prior "
            "until measured).", ["tier"], registry=r)
        self.node_healthy = Gauge("kvagent_router_node_healthy", "1 when a node is healthy.",
                                  ["node", "role"], registry=r)

    def miss(self, reason: str) -> None:
        self.reuse_misses.labels(reason=reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
