"""Building a store, and finding the signing keys, from the router's settings."""

from __future__ import annotations

import logging
import time

from kvagent_server.router.auth.cache_token import TokenCodec
from kvagent_server.router.auth.keys import KeyRing
from kvagent_server.router.common.periodic import Periodic
from kvagent_server.router.settings import RouterSettings
from kvagent_server.router.store.base import SessionStore, SharesKeys, StoreUnavailable
from kvagent_server.router.store.memory import MemoryStore

log = logging.getLogger("kvagent.router.state")


def make_store(settings: RouterSettings) -> SessionStore:
    """Redis when `redis_url` is set (several replicas), else an in-process store."""
    if settings.redis_url:
        from kvagent_server.router.store.redis_store import RedisStore

        return RedisStore.from_url(settings.redis_url,
                                   max_handles_per_tenant=settings.limits.max_handles_per_tenant,
                                   max_records_per_tenant=settings.limits.max_records_per_tenant)
    return MemoryStore(max_handles_per_tenant=settings.limits.max_handles_per_tenant,
                       max_records_per_tenant=settings.limits.max_records_per_tenant)


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


# How often a replica without configured keys re-publishes them and learns the others'.
KEY_SYNC_INTERVAL_S = 10.0


class KeySync:
    """Keeps replicas without configured keys verifying each other's tokens through Redis.

    Every `interval_s` (and on a token signed by an unknown key, at most every
    `min_refresh_s`) the codec's keys are re-published to the store and the other
    replicas' keys learned. So a Redis restarted empty gets the keys back, and a replica
    that made its own key meanwhile is trusted by the others, and they by it.
    """

    def __init__(self, store: SharesKeys, codec: TokenCodec, *,
                 interval_s: float = KEY_SYNC_INTERVAL_S, min_refresh_s: float = 1.0) -> None:
        self._store, self._codec = store, codec
        self._min_refresh_s = min_refresh_s
        self._last = 0.0
        self._periodic = Periodic(self.refresh, interval_s=interval_s, name="kvagent-keys",
                                  log=log, what="signing key sync")

    async def refresh(self) -> bool:
        """Publish ours, learn theirs; True when the ring changed."""
        self._last = time.monotonic()
        try:
            ring = await self._store.publish_key_ring(self._codec.keys)
        except StoreUnavailable:
            return False
        changed = ring.kids != self._codec.keys.kids
        self._codec.use_keys(ring)
        return changed

    async def refresh_for_unknown_key(self) -> bool:
        """A token named a key this replica does not know: maybe another replica's."""
        if time.monotonic() - self._last < self._min_refresh_s:
            return False  # bounded: junk tokens cannot make every request hit Redis
        return await self.refresh()

    def start(self) -> None:
        self._periodic.start()

    async def stop(self) -> None:
        await self._periodic.stop()


def key_sync_for(settings: RouterSettings, store: SessionStore, codec: TokenCodec
                 ) -> KeySync | None:
    """A `KeySync` when replicas share keys through the store (no configured keys)."""
    if settings.signing_keys or not isinstance(store, SharesKeys):
        return None
    return KeySync(store, codec)
