"""The signing key ring for cache tokens.

Keys are named by a key id (`kid`) that every token carries, so keys can rotate: the
active key signs new tokens while older keys keep verifying tokens already handed out.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvagent_server.router.settings import RouterSettings

#: Key ids travel inside every token: short, and from the URL-safe alphabet.
KID_RE = re.compile(r"^[A-Za-z0-9_-]{1,32}\Z")
#: HMAC-SHA256 keys shorter than this are guessable; refuse them at start-up.
MIN_KEY_BYTES = 16


class KeyRing:
    """Signing keys by key id; `active_kid` names the one that signs new tokens."""

    __slots__ = ("_active_kid", "_keys")

    def __init__(self, keys: Mapping[str, bytes], active_kid: str) -> None:
        if not keys:
            raise ValueError("a key ring needs at least one key")
        for kid, key in keys.items():
            if not KID_RE.match(kid):
                raise ValueError(f"invalid key id {kid!r}: use 1-32 characters of [A-Za-z0-9_-]")
            if len(key) < MIN_KEY_BYTES:
                raise ValueError(
                    f"signing key {kid!r} is {len(key)} bytes; at least {MIN_KEY_BYTES} needed"
                )
        if active_kid not in keys:
            raise ValueError(f"active key id {active_kid!r} is not in the key ring")
        self._keys: dict[str, bytes] = {kid: bytes(key) for kid, key in keys.items()}
        self._active_kid = active_kid

    @classmethod
    def from_settings(cls, settings: RouterSettings) -> KeyRing:
        """The configured keys (the first one signs), or a fresh random key when none are."""
        if not settings.signing_keys:
            return cls.generate()
        keys = {kid: secret.get_secret_value().encode() for kid, secret in
                settings.signing_keys.items()}
        return cls(keys, next(iter(settings.signing_keys)))

    @classmethod
    def generate(cls) -> KeyRing:
        """A ring with one random 256-bit key (tokens then die with the process)."""
        kid = "r" + secrets.token_hex(4)
        return cls({kid: secrets.token_bytes(32)}, kid)

    @property
    def active_kid(self) -> str:
        return self._active_kid

    @property
    def kids(self) -> tuple[str, ...]:
        return tuple(self._keys)

    def key(self, kid: str) -> bytes | None:
        """The key named `kid`, or None when this ring does not know it."""
        return self._keys.get(kid)

    def rotated(self, kid: str, key: bytes) -> KeyRing:
        """A new ring in which `key` signs and every existing key still verifies."""
        if kid in self._keys and self._keys[kid] != key:
            raise ValueError(f"key id {kid!r} already names a different key")
        return KeyRing({**self._keys, kid: key}, kid)

    def merged(self, keys: Mapping[str, bytes]) -> KeyRing:
        """A new ring that also verifies `keys` (same active key). A kid that names a
        different key here keeps this ring's key: a kid is never silently re-bound."""
        extra = {kid: key for kid, key in keys.items() if kid not in self._keys}
        return KeyRing({**self._keys, **extra}, self._active_kid) if extra else self

    def without(self, kid: str) -> KeyRing:
        """A new ring that no longer verifies `kid` (retire a key once its tokens expired)."""
        if kid == self._active_kid:
            raise ValueError("cannot retire the active key; rotate first")
        return KeyRing({k: v for k, v in self._keys.items() if k != kid}, self._active_kid)

    def __repr__(self) -> str:  # never print key material
        return f"KeyRing(kids={list(self._keys)}, active={self._active_kid!r})"
