"""API keys to tenants.

A tenant is the unit of isolation: tokens, session handles and (through `cache_salt`)
vLLM's prefix caches are kept apart per tenant. With no tenants configured the router
serves one anonymous tenant and checks no key (plain vLLM clients send `Bearer EMPTY`).
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from kvagent_server.router.settings import (
    RouterSettings,
    TenantSettings,
    derive_cache_salt,
)

DEFAULT_TENANT = "default"


class Tenant(BaseModel):
    """A resolved tenant (no key material: safe to log and to pass around)."""

    model_config = ConfigDict(frozen=True)

    name: str
    cache_salt: str
    max_concurrent_streams: int = Field(ge=1)
    #: Who within the tenant is calling: a digest of the API key ("" with no keys).
    caller: str = ""

    def session_key(self, session: str | None) -> str | None:
        """The router's name for a client's session: scoped to the caller's API key, so
        a session id alone never names another key's session (its handles, its KV)."""
        if session is None or not self.caller:
            return session
        return f"{self.caller}/{session}"


class AuthError(Exception):
    """The request's API key is missing or unknown. The message never contains the key."""

    def __init__(self, reason: Literal["missing_api_key", "invalid_api_key"]) -> None:
        message = ("missing API key: send 'Authorization: Bearer <key>'"
                   if reason == "missing_api_key" else "invalid API key")
        super().__init__(message)
        self.reason = reason
        self.status_code = 401


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


_CALLER_CONTEXT = b"kvagent/caller/v1"


def caller_id(key_digest: bytes) -> str:
    """A stable, short name for an API key (the same on every replica): 64 bits of an HMAC
    of its digest, never the key itself."""
    return hmac.new(_CALLER_CONTEXT, key_digest, hashlib.sha256).hexdigest()[:16]


def _tenant(settings: TenantSettings) -> Tenant:
    return Tenant(name=settings.name,
                  cache_salt=settings.cache_salt or derive_cache_salt(settings.name),
                  max_concurrent_streams=settings.max_concurrent_streams)


def bearer_key(authorization_header: str | None) -> str | None:
    """The key of an `Authorization: Bearer <key>` header (scheme case-insensitive)."""
    if not authorization_header:
        return None
    scheme, _, key = authorization_header.strip().partition(" ")
    key = key.strip()
    if scheme.lower() != "bearer" or not key:
        return None
    return key


class TenantResolver:
    """Maps an Authorization header to its tenant; keys are compared in constant time."""

    def __init__(self, settings: RouterSettings) -> None:
        self._default: Tenant | None = None
        #: (sha256 of key, tenant) for every configured key; only digests are kept.
        self._keys: list[tuple[bytes, Tenant]] = []
        self._tenants: dict[str, Tenant] = {}
        if not settings.tenants:
            self._default = Tenant(name=DEFAULT_TENANT,
                                   cache_salt=derive_cache_salt(DEFAULT_TENANT),
                                   max_concurrent_streams=TenantSettings.model_fields[
                                       "max_concurrent_streams"].default)
            self._tenants[DEFAULT_TENANT] = self._default
            return
        seen: set[bytes] = set()
        for tenant_settings in settings.tenants:
            if tenant_settings.name in self._tenants:
                raise ValueError(f"tenant {tenant_settings.name!r} is configured twice")
            if not tenant_settings.api_keys:
                raise ValueError(f"tenant {tenant_settings.name!r} has no API key")
            tenant = _tenant(tenant_settings)
            self._tenants[tenant.name] = tenant
            for secret in tenant_settings.api_keys:
                key = secret.get_secret_value()
                if not key:
                    raise ValueError(f"tenant {tenant.name!r} has an empty API key")
                digest = _digest(key)
                if digest in seen:
                    # Do not say which tenant holds it: the message may end up in a log.
                    raise ValueError("the same API key is configured twice")
                seen.add(digest)
                self._keys.append((digest, tenant.model_copy(
                    update={"caller": caller_id(digest)})))

    @property
    def tenants(self) -> dict[str, Tenant]:
        """Every tenant by name (the anonymous one when none are configured)."""
        return dict(self._tenants)

    @property
    def anonymous(self) -> bool:
        """True when no tenants are configured and no key is checked."""
        return self._default is not None

    def resolve(self, authorization_header: str | None) -> Tenant:
        """The tenant owning the request's key; AuthError when it is missing or unknown."""
        if self._default is not None:
            return self._default
        key = bearer_key(authorization_header)
        if key is None:
            raise AuthError("missing_api_key")
        digest = _digest(key)
        found: Tenant | None = None
        for candidate, tenant in self._keys:  # no early exit: time does not depend on the match
            if hmac.compare_digest(candidate, digest):
                found = tenant
        if found is None:
            raise AuthError("invalid_api_key")
        return found
