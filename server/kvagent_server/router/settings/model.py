"""`RouterSettings`: the router's own keys, its path policy and its sections by concern."""

from __future__ import annotations

import hashlib
import hmac
import logging
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, model_validator

from kvagent_server.router.settings.sections import (
    FLAT_KEYS,
    EngineSettings,
    IdentitySettings,
    LimitSettings,
    NodeSettings,
    RetentionSettings,
)

log = logging.getLogger("kvagent.router")

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


_WARNED: set[str] = set()  # flat keys already warned about, once per process


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
    limits: LimitSettings = Field(default_factory=LimitSettings,
        description="What one client, one request and one tenant may ask (below).")
    nodes: NodeSettings = Field(default_factory=NodeSettings,
        description="How the router talks to its nodes (below).")
    retention: RetentionSettings = Field(default_factory=RetentionSettings,
        description="How long KV stays on the nodes, and what goes first (below).")
    identity: IdentitySettings = Field(default_factory=IdentitySettings,
        description="What makes held KV the same as a new prompt's (below).")
    engine: EngineSettings = Field(default_factory=EngineSettings,
        description="What the router tells its nodes beyond the OpenAI API (below).")
    test_shift_blocks_header: bool = Field(default=False,
        description="Test-only negative control: honour the `X-Kvagent-Test-Shift-Blocks` "
        "header, which hands P D's reusable blocks shifted by half their number (wrong KV on purpose), so "
        "the suite can prove that its greedy-equality check catches wrong blocks. Never on in "
        "service.")

    @model_validator(mode="before")
    @classmethod
    def _move_flat_keys(cls, data: Any) -> Any:
        """An older settings file's flat key keeps working, moved into its section with a
        warning that names its new place; given in both places with different values, it
        is an error naming both."""
        if not isinstance(data, dict) or not FLAT_KEYS.keys() & data.keys():
            return data
        data = dict(data)
        for old in [k for k in data if k in FLAT_KEYS]:
            section, new = FLAT_KEYS[old]
            value = data.pop(old)
            given = data.get(section) or {}
            nested = (given.model_dump(exclude_unset=True) if isinstance(given, BaseModel)
                      else dict(given))
            if new in nested and nested[new] != value:
                raise ValueError(f"router.{old} ({value!r}) and router.{section}.{new} "
                                 f"({nested[new]!r}) disagree: keep router.{section}.{new}")
            nested[new] = value
            data[section] = nested
            if old not in _WARNED:
                _WARNED.add(old)
                log.warning("router.%s is now router.%s.%s: the flat key still works, but "
                            "move it into its section", old, section, new)
        return data

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
