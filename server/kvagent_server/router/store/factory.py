"""Building a store, and finding the signing keys, from the router's settings."""

from __future__ import annotations

import logging

from kvagent_server.router.auth.keys import KeyRing
from kvagent_server.router.settings import RouterSettings
from kvagent_server.router.store.base import SessionStore, SharesKeys, StoreUnavailable
from kvagent_server.router.store.memory import MemoryStore

log = logging.getLogger("kvagent.router.state")


def make_store(settings: RouterSettings) -> SessionStore:
    """Redis when `redis_url` is set (several replicas), else an in-process store."""
    if settings.redis_url:
        from kvagent_server.router.store.redis_store import RedisStore

        return RedisStore.from_url(settings.redis_url,
                                   max_handles_per_tenant=settings.max_handles_per_tenant)
    return MemoryStore(max_handles_per_tenant=settings.max_handles_per_tenant)


async def key_ring_for(settings: RouterSettings, store: SessionStore) -> KeyRing:
    """The signing keys: configured ones, else one shared through Redis, else a random one.

    Replicas behind one Redis must verify each other's tokens, so without configured keys
    they agree on a key stored in Redis (whoever can write Redis can forge handles anyway).
    """
    if settings.signing_keys:
        return KeyRing.from_settings(settings)
    if isinstance(store, SharesKeys):
        try:
            return await store.shared_key_ring()
        except StoreUnavailable as exc:
            # Redis down at start-up must not keep the router down: routing works without
            # it. Until a restart with Redis up, this replica's tokens are its own (another
            # replica's token fails verification and that turn recomputes).
            log.warning("no shared signing key (%s: %s): using a key of this process only; "
                        "configure router.signing_keys to share keys without Redis",
                        type(exc).__name__, exc)
    return KeyRing.generate()
