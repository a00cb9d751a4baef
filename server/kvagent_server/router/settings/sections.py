"""The router's settings by concern: each section of `router:` other than the router's own
keys and its path policy (docs/router.md, "Settings")."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from kvagent_server.router.kv.index import KVEventSource
from kvagent_server.router.kv.tiers import NodeTiers


class RetentionPolicySettings(BaseModel):
    """Which retention policy ranks a decode node's retained turns when it needs room,
    and that policy's own parameters (`router.retention.policy`)."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(default="expected_return",
        description="`expected_return`: final answers first, then sessions long past their "
        "tool's learned pause, then the furthest expected return; `oldest_first`: the "
        "longest idle first.")
    params: dict[str, Any] = Field(default_factory=dict,
        description="The policy's parameters, checked against its own model at start-up "
        "(docs/router.md, \"Retention\").")


class LimitSettings(BaseModel):
    """What one client, one request and one tenant may ask of the router
    (docs/reliability.md, "Limits"): past a limit the request is refused or the connection
    closed, with the status each field names."""

    model_config = ConfigDict(extra="forbid")

    first_byte_timeout_s: float = Field(default=600.0, gt=0,
        description="From arrival to the response's first byte (all legs and retries): 504 after "
        "it.")
    stream_write_timeout_s: float = Field(default=30.0, gt=0,
        description="A streaming client that accepts no bytes for this long is cut and its legs "
        "closed.")
    max_body_bytes: int = Field(default=8 * 1024 * 1024, ge=1024,
        description="Largest request body (413 above).")
    max_header_bytes: int = Field(default=32 * 1024, ge=1024,
        description="Largest request line plus headers (431 above), counted while they are read: "
        "the connection is answered and closed as soon as the count passes it.")
    max_header_count: int = Field(default=100, ge=8,
        description="Most header lines in one request (431 above).")
    header_timeout_s: float = Field(default=10.0, gt=0,
        description="A request line and headers must arrive within this (a slow client's "
        "connection is closed: 408), counted from the connection or the end of the previous "
        "response.")
    body_timeout_s: float = Field(default=30.0, gt=0,
        description="A request body must arrive within this from its headers (408 above).")
    max_connections: int = Field(default=2048, ge=1,
        description="Open client connections, all clients together: more are closed at once, "
        "unanswered.")
    max_connections_per_client: int = Field(default=256, ge=1,
        description="Open client connections from one client address.")
    max_streams_per_client: int = Field(default=64, ge=1,
        description="Completions in flight from one client address (429 above); tenants have "
        "their own.")
    max_messages: int = Field(default=4096, ge=1,
        description="Most `messages` in one chat request (400 above).")
    max_tools: int = Field(default=512, ge=1,
        description="Most `tools` in one chat request (400 above).")
    max_inline_media_bytes: int = Field(default=4 * 1024 * 1024, ge=1024,
        description="Largest inline media item (a `data:` URL, `input_audio` or `file` data, "
        "counted in characters as sent): 413 above. The router never fetches a URL itself.")
    max_tokens_limit: int = Field(default=1 << 20, ge=1,
        description="Largest `max_tokens` / `max_completion_tokens` accepted (400 above); vLLM "
        "further caps generation at the model's context length.")
    max_upstream_body_bytes: int = Field(default=64 * 1024 * 1024, ge=1024,
        description="Largest non-streamed answer read from a node (502 above): a node's whole "
        "body is held in memory before it is rewritten.")
    max_handles_per_tenant: int = Field(default=5_000, ge=1,
        description="Retained handles one tenant may hold in the store; its oldest are evicted "
        "(and released on the decode node) past it, so one tenant cannot push out another's.")
    max_records_per_tenant: int = Field(default=20_000, ge=1,
        description="Stored Responses plus content-index entries one tenant may hold; its "
        "oldest go first past it (in memory, all tenants' records also stay under 256 MiB).")


class NodeSettings(BaseModel):
    """How the router talks to its vLLM nodes, and the node facts it must agree with (the bundle
    fills `block_size` and `kv_recompute_threshold` from the nodes' own settings)."""

    model_config = ConfigDict(extra="forbid")

    health_interval_s: float = Field(
        default=2.0, gt=0, description="Seconds between health probes of each node.")
    request_timeout_s: float = Field(default=600.0, gt=0,
        description="One leg's HTTP timeout; also the longest a decode stream may stay silent.")
    max_retries: int = Field(
        default=2, ge=0,
        description="Other nodes a leg is retried on before its first byte (never after).")
    max_in_flight: int = Field(default=64, ge=1,
        description="A node with this many legs in flight is saturated (placement looks "
        "elsewhere).")
    block_size: int | None = Field(default=None, ge=1,
        description="The nodes' KV block size; reuse is aligned to whole blocks. None: read it "
        "from the nodes' `/metrics` (`vllm:cache_config_info`); no token is issued while "
        "unknown.")
    kv_recompute_threshold: int = Field(default=64, ge=0,
        description="The nodes' `kv_recompute_threshold`: fewer reusable tokens are recomputed.")


class RetentionSettings(BaseModel):
    """How long KV stays on the nodes for the turns to come, and what goes first when a
    decode node needs room (docs/router.md, "Retention")."""

    model_config = ConfigDict(extra="forbid")

    decode_blocks_ttl_s: float = Field(default=480.0, gt=0,
        description="The decode nodes' `decoder_kv_blocks_ttl`: how long D keeps a turn's "
        "blocks.")
    prefill_lease_s: float = Field(default=30.0, gt=0,
        description="The prefill nodes' `kv_lease_duration`: how long P keeps a finished "
        "prefill's blocks for a D that has not started reading them.")
    prefill_lease_margin_s: float = Field(default=5.0, ge=0,
        description="A D leg must start reading P's blocks this long before P's lease ends; a "
        "decode node that sees the request later (stalled) computes the prompt itself.")
    release_unused_handles: bool = Field(default=True,
        description="When a claimed handle is not reused (recompute), let P tell D to free its "
        "blocks now (`remote_num_tokens=0` params) instead of holding them until the TTL.")
    high_watermark: float | None = Field(default=0.8, gt=0, le=1,
        description="Decode KV usage (0..1, `vllm:kv_cache_usage_perc`) at which retained "
        "handles on that node, in `policy`'s order, are evicted and released, "
        "down to the low watermark; None: retention is bounded by the TTL only "
        "(nodes/retention.py). At this usage the "
        "`cost_model` path policy also stops sending D prompts to compute (docs/router.md).")
    low_watermark: float = Field(
        default=0.6, gt=0, lt=1,
        description="Decode KV usage the watermark evicts down to (below the high watermark).")
    policy: RetentionPolicySettings = Field(
        default_factory=RetentionPolicySettings,
        description="Which retained turns go first when a decode node needs room, the "
        "watermark's or a waiting turn's (`name`, and its `params`): by when each session "
        "is expected back, from how its last turn ended and its tools' learned pauses "
        "(`expected_return`), or by age (`oldest_first`). docs/router.md, \"Retention\".")
    check_interval_s: float = Field(default=2.0, gt=0,
        description="How often each decode node's KV usage is read for the watermark.")
    decode_room_wait_s: float = Field(default=300.0, gt=0,
        description="How long a turn waits for KV room on its decode node (every leg "
        "there is admitted only when the node can allocate it: docs/router.md, \"KV room "
        "on decode nodes\") before it is refused with 503. Needs the retention guard.")
    spill_ttl_s: float = Field(default=900.0, ge=0,
        description="How long a conversation whose retained copy on a tiered decode node was "
        "given up (the watermark, a waiting turn's room, the store's bounds) is remembered as "
        "spilled to that node's tiers (`engine.kv_tiers`), so its next turn is priced as a "
        "load from there; 0: forgotten at once, as without tiers. Where the node publishes KV "
        "events, the tiers' own events say what is still there (docs/tiers.md).")

    @model_validator(mode="after")
    def _watermarks(self) -> RetentionSettings:
        high = self.high_watermark
        if high is not None and self.low_watermark >= high:
            raise ValueError(f"low_watermark ({self.low_watermark}) must be below "
                             f"high_watermark ({high})")
        return self


class IdentitySettings(BaseModel):
    """What makes a turn's held KV the same as its new prompt's (docs/router.md, "KV identity")."""

    model_config = ConfigDict(extra="forbid")

    mm_placeholder_token_ids: list[int] = Field(default_factory=list,
        description="The served model's multimodal placeholder token ids (e.g. its image token): "
        "with them, reuse stops at the first changed image instead of recomputing the turn. The "
        "bundle fills it from a local model's config.json unless set.")
    trust_media_urls: bool = Field(default=False,
        description="Treat media behind equal URL strings as equal content. Off: the router "
        "cannot read the bytes (it never fetches), so reuse stops at the first URL item.")
    unverifiable_fields: list[str] = Field(default_factory=list,
        description="Request fields to treat as unverifiable although kvagent's allow-list "
        "ignores them (a renderer that reads, say, `response_format` into the prompt).")


class EngineSettings(BaseModel):
    """What the router tells its nodes and hears from them beyond the OpenAI API (kvagent's vLLM
    plugin, KV events)."""

    model_config = ConfigDict(extra="forbid")

    kv_events: dict[str, KVEventSource] = Field(default_factory=dict,
        description="KV event sources by node URL (the bundle fills this from `kv_events`): "
        "prefill placement then weighs the prompt's cached prefix per node and tier against "
        "load.")
    kv_tiers: dict[str, NodeTiers] = Field(default_factory=dict,
        description="KV tiers by node URL (the bundle fills this from `kv_tiers`): a "
        "conversation whose retained copy on a tiered decode node is given up is recorded as "
        "spilled to that node's host tier or the shared disk, and its next turn is priced as "
        "a load from there (docs/tiers.md).")

    forward_prompt_ids: bool = Field(default=True,
        description="A chat turn's D leg after a P leg takes the prompt token ids P computed "
        "(vLLM's `kv_transfer_params.prompt_token_ids`) instead of rendering and tokenizing "
        "the messages again: D computes from exactly the tokens whose KV it reads, a few ms "
        "sooner. Not for messages with media or `echo` (vLLM renders those). False: D "
        "renders the messages itself.")
    forward_first_token: bool = Field(default=True,
        description="Where the prompt ids are forwarded, D's leg also takes the token P "
        "sampled (`kv_transfer_params.kvagent_first_token`, kvagent's vLLM plugin): D emits "
        "it as soon as P's KV has arrived and computes from it, instead of recomputing the "
        "prompt's last token to sample its own, one model step less per answer. D ignores "
        "it where its request could not have sampled that token the same way (logprobs, "
        "seeds, grammars, `min_tokens`); not sent for `n` > 1. False: D samples its own "
        "first token.")


class PathPolicySettings(BaseModel):
    """Which path policy decides each turn, and that policy's own parameters
    (`turns.policy`): every path policy's parameters live here, and only here."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(default="cost_model",
        description="`cost_model` (the learned per-path costs and each node's queue), "
        "`pd_reuse` (P computes every prompt and pulls a verified prefix from D), "
        "`d_direct` (the decode node holding a conversation extends its later turns "
        "itself), `single` (never P: what a router with one decode node and no prefill "
        "node runs in place of `cost_model`), `replicas` (`single` on several decode "
        "nodes, a busy node's sessions moving with their KV: what a router with several "
        "and no prefill node runs in its place), or one registered by a plugin. Every "
        "policy reuses only verified prefixes.")
    params: dict[str, Any] = Field(default_factory=dict,
        description="The policy's parameters, checked against its own model at start-up "
        "(below, by policy; docs/router.md, \"Choosing the path\"). A parameter left out "
        "takes its default.")


#: The sections by concern, by their key under `router:` (the path policy's, `policy`,
#: is a section of its own: `PathPolicySettings`).
SECTIONS: dict[str, type[BaseModel]] = {
    "limits": LimitSettings, "nodes": NodeSettings, "retention": RetentionSettings,
    "identity": IdentitySettings, "engine": EngineSettings}

#: Every key of a section above was once a flat `router.*` key of the same name, except
#: these, whose flat name said their section: (section, key) -> the older flat key.
_RENAMED: dict[tuple[str, str], str] = {
    ("nodes", "max_in_flight"): "node_max_in_flight",
    ("retention", "high_watermark"): "retention_high_watermark",
    ("retention", "low_watermark"): "retention_low_watermark",
    ("retention", "policy"): "retention_policy",
    ("retention", "check_interval_s"): "retention_check_interval_s",
    ("identity", "unverifiable_fields"): "identity_unverifiable_fields",
}

#: The path policy's parameters that were flat `router.*` keys: `cost_model`'s, and
#: `skip_tokenize_extensions`, every built-in policy's (`turns.policy_params`).
POLICY_FLAT_PARAMS = ("skip_prefill_max_tokens", "queue_aware_paths",
                      "d_direct_stall_max_ms", "fresh_on_decode",
                      "decode_prompt_step_tokens", "skip_tokenize_extensions")

#: Keys added after the sections were: no older file has them flat.
_SECTION_ONLY: frozenset[tuple[str, str]] = frozenset({("engine", "kv_tiers"),
                                                       ("retention", "spill_ttl_s")})

#: Where each older flat `router.*` key lives now: its path under `router:`.
FLAT_KEYS: dict[str, tuple[str, ...]] = {
    **{_RENAMED.get((section, key), key): (section, key)
       for section, model in SECTIONS.items() for key in model.model_fields
       if (section, key) not in _SECTION_ONLY},
    "path_policy": ("policy", "name"),
    **{key: ("policy", "params", key) for key in POLICY_FLAT_PARAMS},
}
