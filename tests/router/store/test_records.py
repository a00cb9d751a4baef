"""The records beside the handles (`store.records`): stored Responses, the content index.

The same contract on the in-process store and on real Redis: per tenant, first hit in the
order asked, replaced on put, expired after the TTL, bounded per tenant (oldest first).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest
from kvagent_server.router.store.memory import MemoryStore
from kvagent_server.router.store.records import CONTENT, RESPONSES, MemoryRecords
from kvagent_server.router.store.redis_store import RedisStore


@pytest.fixture(params=["memory", pytest.param("redis", marks=pytest.mark.redis)])
def make(request: pytest.FixtureRequest) -> Callable[..., Any]:
    if request.param == "memory":
        return lambda **kw: MemoryStore(max_records_per_tenant=kw.get("cap", 20_000))
    stores: Callable[..., RedisStore] = request.getfixturevalue("redis_stores")
    return lambda **kw: stores(max_records_per_tenant=kw.get("cap", 20_000))


async def test_put_get_find_per_tenant_and_kind(make: Callable[..., Any]) -> None:
    store = make()
    await store.put_records("t1", RESPONSES, [("r1", b"one"), ("r2", b"two")], 60)
    await store.put_records("t1", CONTENT, [("k1", b"s1")], 60)
    assert await store.get_record("t1", RESPONSES, "r1") == b"one"
    assert await store.get_record("t2", RESPONSES, "r1") is None  # another tenant's
    assert await store.get_record("t1", CONTENT, "r1") is None  # another kind's
    assert await store.find_record("t1", RESPONSES, ["nope", "r2", "r1"]) == ("r2", b"two")
    assert await store.find_record("t1", RESPONSES, ["nope"]) is None
    assert await store.find_record("t1", RESPONSES, []) is None
    await store.put_records("t1", RESPONSES, [("r1", b"new")], 60)
    assert await store.get_record("t1", RESPONSES, "r1") == b"new"
    await store.put_records("t1", RESPONSES, [("r3", b"x")], 0)  # no TTL: not stored
    assert await store.get_record("t1", RESPONSES, "r3") is None


async def test_bounded_per_tenant_oldest_first(make: Callable[..., Any]) -> None:
    store = make(cap=3)
    for i in range(5):
        await store.put_records("t", CONTENT, [(f"k{i}", b"v")], 60 + i)
    await store.put_records("u", CONTENT, [("k0", b"v")], 60)
    assert [await store.get_record("t", CONTENT, f"k{i}") for i in range(5)] == [
        None, None, b"v", b"v", b"v"]
    assert await store.get_record("u", CONTENT, "k0") == b"v"  # other tenants keep theirs


async def test_redis_records_expire(redis_stores: Callable[..., RedisStore]) -> None:
    store = redis_stores()
    await store.put_records("t", RESPONSES, [("r", b"v")], 0.2)
    assert await store.get_record("t", RESPONSES, "r") == b"v"
    await asyncio.sleep(0.4)
    assert await store.find_record("t", RESPONSES, ["r"]) is None


async def test_memory_records_expire_and_stay_under_their_bytes() -> None:
    now = [1000.0]
    records = MemoryRecords(max_per_tenant=100, max_bytes=1000, clock=lambda: now[0])
    await records.put_records("t", RESPONSES, [("a", b"x" * 300)], 10)
    now[0] += 11
    assert await records.get_record("t", RESPONSES, "a") is None
    for i in range(5):
        await records.put_records("t", RESPONSES, [(f"b{i}", b"x" * 300)], 10)
    assert records.stored_bytes <= 1000 and len(records) == 3
    assert await records.get_record("t", RESPONSES, "b4") is not None
    assert await records.get_record("t", RESPONSES, "b0") is None


async def test_one_tenant_s_large_records_evict_its_own_not_another_s() -> None:
    """Over the byte bound the biggest holder's oldest record goes first: a flood of large
    Responses (a long history each) does not push out a quiet tenant's chain."""
    records = MemoryRecords(max_per_tenant=100, max_bytes=1000)
    await records.put_records("quiet", RESPONSES, [("q", b"x" * 100)], 60)
    for i in range(10):
        await records.put_records("flood", RESPONSES, [(f"f{i}", b"x" * 300)], 60)
    assert records.stored_bytes <= 1000
    assert await records.get_record("quiet", RESPONSES, "q") == b"x" * 100
    assert await records.get_record("flood", RESPONSES, "f9") is not None
    assert await records.get_record("flood", RESPONSES, "f0") is None


async def test_a_spill_is_a_record_both_stores_keep(make: Callable[..., Any]) -> None:
    """Spilled conversations (nodes.spills) live in the records, so Redis replicas share
    them as they share handles."""
    import time

    from kvagent_server.router.kv.tiers import NodeTiers
    from kvagent_server.router.nodes.spills import Spills
    from kvagent_server.router.store.handle import Handle

    now = time.time()
    handle = Handle(handle_id="h", tenant="t", session="caller/s 1", decode_node="d0",
                    decode_epoch="e", kv_transfer_params={}, token_ids=list(range(300)),
                    block_size=16, created_at=now, expires_at=now + 60, prompt_tokens=290)
    spills = Spills(make(), {"d0": NodeTiers(host=True, chunk_tokens=32)}, ttl_s=60)
    assert await spills.record([handle]) == 1
    found = await spills.find("t", "caller/s 1")
    assert found is not None and found[0].stored_tokens == 288 and found[1] == handle
    assert await spills.find("t", "caller/s 2") is None
