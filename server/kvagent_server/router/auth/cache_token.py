"""The cache-location token codec: `kva1.<payload>.<mac>` (see docs/protocol.md).

The token is opaque to clients and says only which router-side handle a session may claim
next. `decode` proves integrity and freshness; it does NOT prove that the token belongs to
the request presenting it: the caller must check `verify_binding(claims, tenant, session)`
before it claims the handle, or one tenant could spend another's token.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import re
from typing import Literal

from kvagent.protocol import MAX_TOKEN_BYTES
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kvagent_server.router.auth.keys import KeyRing

TOKEN_PREFIX = "kva1"
TokenErrorReason = Literal["malformed", "bad_signature", "unknown_key", "expired", "too_long"]

_B64_RE = re.compile(r"^[A-Za-z0-9_-]*\Z")
_MAC_BYTES = hashlib.sha256().digest_size
#: Compact payload field names -> claim names (keeps tokens short).
_WIRE = {"k": "kid", "t": "tenant", "s": "session", "h": "handle", "i": "iat", "e": "exp"}


class TokenClaims(BaseModel):
    """What a token asserts: this tenant's session may claim this handle until `exp`."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    kid: str = Field(min_length=1)
    tenant: str = Field(min_length=1)
    session: str = Field(min_length=1)
    handle: str = Field(min_length=1)
    iat: int = Field(ge=0)  # unix seconds, router clock
    exp: int = Field(ge=0)  # unix seconds; the token is invalid from this second on


class TokenError(Exception):
    """A token that must not be honoured; `reason` is safe to log and to count in metrics."""

    def __init__(self, reason: TokenErrorReason, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason: TokenErrorReason = reason


def _b64encode(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _b64decode(text: str) -> bytes:
    """Strict, canonical URL-safe base64 without padding (one string per byte string)."""
    if not _B64_RE.match(text) or len(text) % 4 == 1:
        raise ValueError("not unpadded url-safe base64")
    try:
        data = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    except (binascii.Error, ValueError) as exc:
        raise ValueError("bad base64") from exc
    if _b64encode(data) != text:  # non-zero trailing bits: another spelling of the same bytes
        raise ValueError("non-canonical base64")
    return data


class TokenCodec:
    """Signs and verifies tokens with a `KeyRing` (HMAC-SHA256, constant-time compare)."""

    def __init__(self, keys: KeyRing) -> None:
        self._keys = keys

    @property
    def keys(self) -> KeyRing:
        return self._keys

    def use_keys(self, keys: KeyRing) -> None:
        """Verify (and sign) with `keys` from now on, e.g. after learning a replica's key."""
        self._keys = keys

    def encode(self, *, tenant: str, session: str, handle: str, iat: int, exp: int) -> str:
        """A token for these claims, signed with the active key; ValueError when too long."""
        claims = TokenClaims(kid=self._keys.active_kid, tenant=tenant, session=session,
                             handle=handle, iat=iat, exp=exp)
        if claims.exp < claims.iat:
            raise ValueError("token expiry precedes its issue time")
        wire = {short: getattr(claims, name) for short, name in _WIRE.items()}
        payload = _b64encode(json.dumps(wire, separators=(",", ":"), ensure_ascii=True).encode())
        signed = f"{TOKEN_PREFIX}.{payload}"
        key = self._keys.key(claims.kid)
        assert key is not None  # the active kid is always in the ring
        token = f"{signed}.{_b64encode(hmac.new(key, signed.encode(), hashlib.sha256).digest())}"
        if len(token) > MAX_TOKEN_BYTES:
            raise ValueError(f"token would be {len(token)} bytes (limit {MAX_TOKEN_BYTES}); "
                             "tenant or session name too long")
        return token

    def decode(self, token: str, *, now: float) -> TokenClaims:
        """The claims of an intact, unexpired token; TokenError otherwise.

        Binding to tenant and session is the caller's job (`verify_binding`).
        """
        if not isinstance(token, str):
            raise TokenError("malformed", "not a string")
        try:
            raw = token.encode("ascii")
        except UnicodeEncodeError:
            raise TokenError("malformed", "non-ASCII characters") from None
        if len(raw) > MAX_TOKEN_BYTES:
            raise TokenError("too_long", f"{len(raw)} bytes")
        parts = token.split(".")
        if len(parts) != 3 or parts[0] != TOKEN_PREFIX:
            raise TokenError("malformed", "not kva1.<payload>.<mac>")
        _, payload_b64, mac_b64 = parts
        try:
            payload = _b64decode(payload_b64)
            mac = _b64decode(mac_b64)
        except ValueError as exc:
            raise TokenError("malformed", str(exc)) from None
        if len(mac) != _MAC_BYTES:
            raise TokenError("malformed", "mac has the wrong length")
        try:
            wire = json.loads(payload)
        except (ValueError, UnicodeDecodeError):
            raise TokenError("malformed", "payload is not JSON") from None
        if not isinstance(wire, dict) or not isinstance(wire.get("k"), str):
            raise TokenError("malformed", "payload lacks a key id")
        key = self._keys.key(wire["k"])
        if key is None:
            raise TokenError("unknown_key")
        expected = hmac.new(key, f"{TOKEN_PREFIX}.{payload_b64}".encode(), hashlib.sha256).digest()
        if not hmac.compare_digest(expected, mac):
            raise TokenError("bad_signature")
        if set(wire) != set(_WIRE):
            raise TokenError("malformed", "unexpected payload fields")
        try:
            claims = TokenClaims.model_validate({name: wire[s] for s, name in _WIRE.items()})
        except ValidationError:
            raise TokenError("malformed", "invalid claims") from None
        if claims.exp < claims.iat:
            raise TokenError("malformed", "expiry precedes issue time")
        if now >= claims.exp:
            raise TokenError("expired")
        return claims


def verify_binding(claims: TokenClaims, tenant: str, session: str) -> str | None:
    """None when the token was issued to this tenant's session, else why not.

    Returns "other_tenant" or "other_session" (the planner's reasons). Comparisons are
    constant-time so a probe cannot learn another session's id byte by byte.
    """
    if not hmac.compare_digest(claims.tenant.encode(), tenant.encode()):
        return "other_tenant"
    if not hmac.compare_digest(claims.session.encode(), session.encode()):
        return "other_session"
    return None
