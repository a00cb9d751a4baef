"""Router settings: one validated model, embedded in the bundle config under `router:`."""

from __future__ import annotations

import hashlib
import hmac
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, model_validator

from kvagent_server.router.kv.index import KVEventSource

_SALT_CONTEXT = b"kvagent/cache_salt/v1"

#: Where a turn with nothing to reuse computes its prompt (`fresh_on_decode`).
FreshPolicy = Literal["auto", "never", "always"]


def derive_cache_salt(tenant_name: str) -> str:
    """A stable per-tenant salt, identical on every replica and across restarts.

    The router always overwrites the client's `cache_salt`, so the salt need not be
    secret; it only has to differ between tenants and stay put for one tenant.
    """
    return hmac.new(_SALT_CONTEXT, tenant_name.encode(), hashlib.sha256).hexdigest()[:32]


class TenantSettings(BaseModel):
    """An API key's tenant. `cache_salt` keeps prefix caches apart between tenants."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(description="The tenant's name (in metrics, logs and its derived cache salt).")
    api_keys: list[SecretStr] = Field(
        default_factory=list, description="Bearer keys that authenticate as this tenant.")
    cache_salt: str | None = Field(default=None,
        description="Derived from the tenant name when unset.")
    max_concurrent_streams: int = Field(
        default=64, ge=1, description="Completions in flight for the whole tenant (429 above).")


class RetentionPolicySettings(BaseModel):
    """Which retention policy ranks a decode node's retained turns when it needs room,
    and that policy's own parameters (`reuse.retention_policy`)."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(default="expected_return",
        description="`expected_return`: final answers first, then sessions long past their "
        "tool's learned pause, then the furthest expected return; `oldest_first`: the "
        "longest idle first.")
    params: dict[str, Any] = Field(default_factory=dict,
        description="The policy's parameters, checked against its own model at start-up "
        "(docs/router.md, \"Retention\").")


class PathPolicySettings(BaseModel):
    """Which path policy decides each turn, and that policy's own parameters
    (`turns.policy`)."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(default="cost_model",
        description="`cost_model` (the learned per-path costs and each node's queue), "
        "`pd_reuse` (P computes every prompt and pulls a verified prefix from D), "
        "`d_direct` (the decode node holding a conversation extends its later turns "
        "itself), `single` (never P: what a router with no prefill node runs in place "
        "of `cost_model`), or one registered by a plugin. Every policy reuses only "
        "verified prefixes.")
    params: dict[str, Any] = Field(default_factory=dict,
        description="The policy's parameters, checked against its own model at start-up "
        "(docs/router.md, \"Choosing the path\"). A parameter left out takes the value "
        "of the flat `router.*` setting of the same name, where there is one.")


#: The flat `router.*` settings that are also a path policy's parameters: set in
#: `router.policy.params` instead, they must not be set flat too.
POLICY_PARAM_SETTINGS = ("skip_prefill_max_tokens", "d_direct_stall_max_ms",
                         "fresh_on_decode", "decode_prompt_step_tokens")


class RouterSettings(BaseModel):
    """Everything the router needs besides the node addresses."""

    model_config = ConfigDict(extra="forbid")

    host: str = Field(default="127.0.0.1", description="Address the router listens on.")
    port: int = Field(default=8000, ge=1, le=65535, description="Port the router listens on.")
    redis_url: str | None = Field(default=None,
        description="Shared session state for several router replicas; None keeps state in "
        "memory.")
    signing_keys: dict[str, SecretStr] = Field(default_factory=dict,
        description="HMAC keys by key id; the first is used to sign. Empty: a random key per "
        "process (tokens then do not survive a restart unless Redis holds the key).")
    token_safety_margin_s: int = Field(default=60, ge=0,
        description="Tokens expire this many seconds before the decode node drops the blocks.")
    tenants: list[TenantSettings] = Field(default_factory=list,
        description="Tenants; empty means a single anonymous tenant and no API key check.")
    policy: PathPolicySettings | None = Field(default=None,
        description="How each turn's path is chosen (`name`, and its `params`): "
        "`cost_model` by default. Unset: `path_policy` names it and the flat settings "
        "below are its parameters.")
    path_policy: str = Field(default="cost_model",
        description="The path policy's name where `policy` is unset (the older flat "
        "form of `policy.name`; setting both is an error): `cost_model` (the learned "
        "per-path costs and each node's queue; the settings below up to "
        "`decode_prompt_step_tokens` are its parameters), `pd_reuse`, `d_direct` or "
        "`single` (see `policy.name`).")
    skip_prefill_max_tokens: int | None = Field(default=None,
        description="Skip the P leg when the uncached delta is at most this many tokens (0: "
        "never skip, None: decide from measured costs).")
    queue_aware_paths: bool = Field(default=True,
        description="With `skip_prefill_max_tokens` None: price each path with the work in "
        "flight on its node (prompt tokens queued on P, D's queued deltas and decode streams) "
        "and the stall a `d_direct` delta puts on D's streams. False: each path's learned "
        "TTFT line alone, blind to the queues (docs/benchmarks.md runs 5 and 9-11).")
    d_direct_stall_max_ms: float | None = Field(default=55.0, gt=0,
        description="With `queue_aware_paths`: while streams decode on the D node, a turn "
        "whose prompt work D would compute for longer than this (its learned `d_direct` "
        "cost: a reused turn's delta, or a `d_fresh` prompt) goes to P instead, so no other "
        "turn's prefill stalls D's streams past this gap; the summed costs alone would "
        "trade one stream's long gap for seconds saved elsewhere. None: the sums alone "
        "decide (docs/benchmarks.md runs 15, 17 and 18). The default is one step of D "
        "computing a prompt at its CPU cap of 128 tokens per step at the built-in models' "
        "longest context (16,384 tokens): a 7.8 ms decode step plus 128 x (20.2 us + 21.1 ns "
        "per token of context), the lone-engine fit of docs/benchmarks.md's floor benchmark, "
        "~55 ms; a turn within it stalls D's streams no longer than a step of any prompt D "
        "computes. It is not a benchmark's inter-token bound, which is an SLO of its own.")
    fresh_on_decode: FreshPolicy = Field(default="auto",
        description="Where a turn with nothing to reuse (a first turn) computes its prompt. "
        "`auto`, with `queue_aware_paths`: on the decode node itself (`d_fresh`, which keeps "
        "its KV for the next turn like any other) while work is queued on P and the costs "
        "say D, the stall on its streams included, answers sooner, or, with "
        "`decode_prompt_step_tokens`, while P computes other legs and D no prompt: "
        "conditional disaggregation. `never`: P computes every such prompt (`pd_fresh`). "
        "`always`: D does (an aggregated node's first turns, P kept for reused turns). Not "
        "with `reuse` off, whose turns all stay P/D.")
    decode_prompt_step_tokens: int | None = Field(default=None, ge=1,
        description="The most tokens of a prompt a decode node computes per step while "
        "other requests share it (vLLM's --long-prefill-token-threshold on D; the bundle "
        "fills it in). Known, `fresh_on_decode: auto` also sends a first turn to D whenever "
        "P is computing other legs and D no prompt of its own: D's streams then wait one "
        "short step per chunk, not the whole prompt (docs/benchmarks.md run 22). None: "
        "D's steps are not known to be short; the costs and the stall cap decide.")
    skip_tokenize_extensions: bool = Field(default=True,
        description="A chat turn whose messages repeat the held turn's exactly (same "
        "rendering inputs) and add new ones goes `d_direct` without the router's `/tokenize` "
        "when the path would be `d_direct` for any delta near the one its new messages' size "
        "suggests: D's prefix cache matches the tokens itself. False: tokenize every "
        "reused turn.")
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
    reuse: bool = Field(default=True,
        description="Reuse is disabled entirely (for A/B comparisons and benchmarks).")
    content_reuse: bool = Field(default=True,
        description="A caller that names no conversation (no session id of kvagent's or of "
        "an agent's, no `previous_response_id`) still reuses: the router tokenizes its prompt "
        "and looks the prompt's block hashes up among the caller's held turns. Costs one "
        "`/tokenize` round trip and a hash of the prompt per such turn.")
    responses_ttl_s: int = Field(default=3600, ge=0,
        description="How long a Response stored by `/v1/responses` (`store` true, the default) "
        "can be read back and named in `previous_response_id`; 0 stores none.")
    server_timing: bool = Field(default=False,
        description="Send a `Server-Timing` response header with the turn's stages before the "
        "headers (receive, tokenize, plan, prefill, decode; ms). Off: the headers stay vLLM's "
        "own.")
    health_interval_s: float = Field(
        default=2.0, gt=0, description="Seconds between health probes of each node.")
    # ---- limits (docs/reliability.md "Limits")
    request_timeout_s: float = Field(default=600.0, gt=0,
        description="One leg's HTTP timeout; also the longest a decode stream may stay silent.")
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
    max_upstream_body_bytes: int = Field(default=64 * 1024 * 1024, ge=1024,
        description="Largest non-streamed answer read from a node (502 above): a node's whole "
        "body is held in memory before it is rewritten.")
    max_handles_per_tenant: int = Field(default=5_000, ge=1,
        description="Retained handles one tenant may hold in the store; its oldest are evicted "
        "(and released on the decode node) past it, so one tenant cannot push out another's.")
    max_records_per_tenant: int = Field(default=20_000, ge=1,
        description="Stored Responses plus content-index entries one tenant may hold; its "
        "oldest go first past it (in memory, all tenants' records also stay under 256 MiB).")
    max_tokens_limit: int = Field(default=1 << 20, ge=1,
        description="Largest `max_tokens` / `max_completion_tokens` accepted (400 above); vLLM "
        "further caps generation at the model's context length.")
    max_retries: int = Field(
        default=2, ge=0,
        description="Other nodes a leg is retried on before its first byte (never after).")
    block_size: int | None = Field(default=None, ge=1,
        description="The nodes' KV block size; reuse is aligned to whole blocks. None: read it "
        "from the nodes' `/metrics` (`vllm:cache_config_info`); no token is issued while "
        "unknown.")
    kv_recompute_threshold: int = Field(default=64, ge=0,
        description="The nodes' `kv_recompute_threshold`: fewer reusable tokens are recomputed.")
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
    retention_high_watermark: float | None = Field(default=0.8, gt=0, le=1,
        description="Decode KV usage (0..1, `vllm:kv_cache_usage_perc`) at which retained "
        "handles on that node, in `retention_policy`'s order, are evicted and released, "
        "down to the low watermark; None: retention is bounded by the TTL only (nodes/retention.py). At this usage the "
        "`cost_model` path policy also stops sending D prompts to compute (docs/router.md).")
    retention_policy: RetentionPolicySettings = Field(
        default_factory=RetentionPolicySettings,
        description="Which retained turns go first when a decode node needs room, the "
        "watermark's or a waiting turn's (`name`, and its `params`): by when each session "
        "is expected back, from how its last turn ended and its tools' learned pauses "
        "(`expected_return`), or by age (`oldest_first`). docs/router.md, \"Retention\".")
    retention_low_watermark: float = Field(
        default=0.6, gt=0, lt=1,
        description="Decode KV usage the watermark evicts down to (below the high watermark).")
    retention_check_interval_s: float = Field(default=2.0, gt=0,
        description="How often each decode node's KV usage is read for the watermark.")
    decode_room_wait_s: float = Field(default=300.0, gt=0,
        description="How long a turn waits for KV room on its decode node (every leg "
        "there is admitted only when the node can allocate it: docs/router.md, \"KV room "
        "on decode nodes\") before it is refused with 503. Needs the retention guard.")
    node_max_in_flight: int = Field(default=64, ge=1,
        description="A node with this many legs in flight is saturated (placement looks "
        "elsewhere).")
    # ---- KV identity (docs/router.md "KV identity")
    max_inline_media_bytes: int = Field(default=4 * 1024 * 1024, ge=1024,
        description="Largest inline media item (a `data:` URL, `input_audio` or `file` data, "
        "counted in characters as sent): 413 above. The router never fetches a URL itself.")
    mm_placeholder_token_ids: list[int] = Field(default_factory=list,
        description="The served model's multimodal placeholder token ids (e.g. its image token): "
        "with them, reuse stops at the first changed image instead of recomputing the turn. The "
        "bundle fills it from a local model's config.json unless set.")
    trust_media_urls: bool = Field(default=False,
        description="Treat media behind equal URL strings as equal content. Off: the router "
        "cannot read the bytes (it never fetches), so reuse stops at the first URL item.")
    identity_unverifiable_fields: list[str] = Field(default_factory=list,
        description="Request fields to treat as unverifiable although kvagent's allow-list "
        "ignores them (a renderer that reads, say, `response_format` into the prompt).")
    kv_events: dict[str, KVEventSource] = Field(default_factory=dict,
        description="KV event sources by node URL (the bundle fills this from `kv_events`): "
        "prefill placement then weighs the prompt's cached prefix per node and tier against "
        "load.")

    test_shift_blocks_header: bool = Field(default=False,
        description="Test-only negative control: honour the `X-Kvagent-Test-Shift-Blocks` "
        "header, which hands P D's reusable blocks shifted by half their number (wrong KV on purpose), so "
        "the suite can prove that its greedy-equality check catches wrong blocks. Never on in "
        "service.")

    @model_validator(mode="after")
    def _distinct_salts(self) -> RouterSettings:
        """Tenants sharing a cache salt would share vLLM's prefix cache (and its timing)."""
        seen: dict[str, str] = {}
        for tenant in self.tenants:
            salt = tenant.cache_salt or derive_cache_salt(tenant.name)
            if salt in seen and seen[salt] != tenant.name:  # a repeated name is told apart
                raise ValueError(f"tenants {seen[salt]!r} and {tenant.name!r} have the same "
                                 "cache_salt: their prefix caches would be shared")
            seen[salt] = tenant.name
        return self

    @model_validator(mode="after")
    def _one_place_per_policy_setting(self) -> RouterSettings:
        """The nested `policy` section and the older flat keys may not say two things (a
        bundle writes every key out, so a flat key at its default says nothing)."""
        if self.policy is None:
            return self
        fields = type(self).model_fields
        if self.path_policy not in (fields["path_policy"].default, self.policy.name):
            raise ValueError(f"router.path_policy ({self.path_policy!r}) and "
                             f"router.policy.name ({self.policy.name!r}) disagree: the path "
                             "policy is named by router.policy.name now; remove "
                             "router.path_policy")
        for key in POLICY_PARAM_SETTINGS:
            flat = getattr(self, key)
            if (key in self.policy.params and flat != fields[key].default
                    and self.policy.params[key] != flat):
                raise ValueError(f"router.{key} ({flat!r}) and router.policy.params.{key} "
                                 f"({self.policy.params[key]!r}) disagree: keep "
                                 f"router.policy.params.{key}")
        return self

    def policy_choice(self) -> tuple[str, dict[str, Any], str]:
        """The path policy's name, its parameters as configured, and where its name was
        set (for messages)."""
        if self.policy is not None:
            return self.policy.name, dict(self.policy.params), "router.policy.name"
        return self.path_policy, {}, "router.path_policy"

    @model_validator(mode="after")
    def _watermarks(self) -> RouterSettings:
        high = self.retention_high_watermark
        if high is not None and self.retention_low_watermark >= high:
            raise ValueError(f"retention_low_watermark ({self.retention_low_watermark}) "
                             f"must be below retention_high_watermark ({high})")
        return self
