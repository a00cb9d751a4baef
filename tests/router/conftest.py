"""Router test fixtures. The real `redis_server` (session scope) comes from tests/conftest.py."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from kvagent_server.router.store.redis_store import RedisStore


@pytest.fixture
async def redis_stores(redis_server: Any) -> AsyncIterator[Callable[..., RedisStore]]:
    """Makes RedisStores (each with its own connection pool, like separate replicas) that
    share one key prefix unique to the test, so tests never see each other's keys."""
    prefix = f"kvt{uuid.uuid4().hex[:8]}"
    made: list[RedisStore] = []

    def make(**kwargs: Any) -> RedisStore:
        store = RedisStore.from_url(redis_server.url, prefix=prefix, **kwargs)
        made.append(store)
        return store

    yield make
    for store in made:
        await store.close()
