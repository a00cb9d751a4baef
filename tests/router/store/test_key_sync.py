"""Replicas without configured keys keep trusting each other's tokens across an emptied Redis.

A Redis restarted without persistence loses the shared key; a replica that starts then
makes its own. Without re-publishing, the old and the new replica reject each other's
tokens (every turn recomputes). Real redis-server.
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from kvagent_server.router.auth.cache_token import TokenCodec, TokenError
from kvagent_server.router.settings import RouterSettings
from kvagent_server.router.store.factory import KeySync, key_ring_for, key_sync_for
from kvagent_server.router.store.memory import MemoryStore
from kvagent_server.router.store.redis_store import RedisStore

pytestmark = pytest.mark.redis
NOW = 1_000_000


def _token(codec: TokenCodec) -> str:
    return codec.encode(tenant="t", session="s", handle="h", iat=NOW, exp=NOW + 60)


async def test_replicas_learn_each_others_keys_after_redis_was_emptied(
        redis_server: Any) -> None:
    prefix = f"ks{uuid.uuid4().hex[:8]}"
    a_store = RedisStore.from_url(redis_server.url, prefix=prefix)
    b_store = RedisStore.from_url(redis_server.url, prefix=prefix)
    settings = RouterSettings(redis_url=redis_server.url)
    try:
        a = TokenCodec(await key_ring_for(settings, a_store))
        # Redis restarts empty; then replica B starts and makes a key of its own.
        await a_store._r.delete(a_store._keys_key(), a_store._active_key())
        b = TokenCodec(await key_ring_for(settings, b_store))
        assert a.keys.active_kid != b.keys.active_kid
        with pytest.raises(TokenError) as info:
            a.decode(_token(b), now=NOW)
        assert info.value.reason == "unknown_key"

        a_sync = KeySync(a_store, a, min_refresh_s=0)
        b_sync = KeySync(b_store, b, min_refresh_s=0)
        assert await a_sync.refresh_for_unknown_key()  # A re-publishes, learns B's key
        assert a.decode(_token(b), now=NOW).kid == b.keys.active_kid
        await b_sync.refresh()  # B's periodic round learns A's re-published key
        assert b.decode(_token(a), now=NOW).kid == a.keys.active_kid
        # Each still signs with its own key: earlier tokens stay valid on both.
        assert a.keys.active_kid != b.keys.active_kid
    finally:
        await a_store.close()
        await b_store.close()


async def test_unknown_key_refresh_is_rate_limited(redis_server: Any) -> None:
    store = RedisStore.from_url(redis_server.url, prefix=f"ks{uuid.uuid4().hex[:8]}")
    try:
        codec = TokenCodec(await key_ring_for(RouterSettings(), store))
        sync = KeySync(store, codec, min_refresh_s=3600)
        await sync.refresh()
        assert not await sync.refresh_for_unknown_key()  # junk tokens cannot hammer Redis
    finally:
        await store.close()


def test_no_key_sync_with_configured_keys_or_a_memory_store() -> None:
    codec = TokenCodec(__import__("kvagent_server.router.auth.keys",
                                  fromlist=["KeyRing"]).KeyRing.generate())
    keyed = RouterSettings(signing_keys={"k1": "x" * 32}, redis_url="redis://127.0.0.1:1/0")
    assert key_sync_for(keyed, RedisStore.from_url("redis://127.0.0.1:1/0"), codec) is None
    assert key_sync_for(RouterSettings(), MemoryStore(), codec) is None
