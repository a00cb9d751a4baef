"""`RouterSettings`: the router's own keys and its sections by concern (the path policy's
among them), and the move of the older flat keys into their sections."""

from __future__ import annotations

import hashlib
import hmac
import logging
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, SecretStr, model_validator

from kvagent_server.router.settings.sections import (
    FLAT_KEYS,
    EngineSettings,
    IdentitySettings,
    LimitSettings,
    NodeSettings,
    PathPolicySettings,
    RetentionSettings,
)

log = logging.getLogger("kvagent.router")

_SALT_CONTEXT = b"kvagent/cache_salt/v1"

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
    policy: PathPolicySettings = Field(default_factory=PathPolicySettings,
        description="How each turn's path is chosen: the path policy's `name` and its own "
        "`params` (below, by policy; docs/router.md, \"Choosing the path\").")
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
        "header, which hands P D's reusable blocks (a `d_pull` leg the holder's) shifted by "
        "half their number (wrong KV on purpose), so "
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
            *sections, key = FLAT_KEYS[old]
            new = ".".join(FLAT_KEYS[old])
            value = data.pop(old)
            holder = data
            for section in sections:  # copies: the caller's own dicts stay as given
                holder[section] = holder = _plain(holder.get(section))
            if key in holder and holder[key] != value:
                raise ValueError(f"router.{old} ({value!r}) and router.{new} "
                                 f"({holder[key]!r}) disagree: keep router.{new}")
            holder[key] = value
            if old not in _WARNED:
                _WARNED.add(old)
                log.warning("router.%s is now router.%s: the flat key still works, but "
                            "move it into its section", old, new)
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


def _plain(given: Any) -> dict[str, Any]:
    """A section as given (a dict, a model, or absent) as a dict of the keys it sets."""
    if isinstance(given, BaseModel):
        return given.model_dump(exclude_unset=True)
    if given is not None and not isinstance(given, dict):
        raise ValueError(f"a section must be a mapping, not {given!r}")
    return dict(given or {})
