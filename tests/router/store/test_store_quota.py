"""Per-tenant handle quotas in both stores: one tenant's churn evicts only its own
handles, and every eviction is handed back to the caller (to be released on D)."""

from __future__ import annotations

import pytest
from kvagent_server.router.store.base import SessionStore
from kvagent_server.router.store.memory import MemoryStore
from test_stores import FakeClock, handle


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture(params=["memory", pytest.param("redis", marks=pytest.mark.redis)])
def quota_store(request: pytest.FixtureRequest, clock: FakeClock) -> SessionStore:
    if request.param == "memory":
        return MemoryStore(clock=clock, max_handles_per_tenant=3)
    return request.getfixturevalue("redis_stores")(clock=clock, max_handles_per_tenant=3)


async def test_a_tenants_flood_evicts_only_its_own_oldest(quota_store: SessionStore,
                                                          clock: FakeClock) -> None:
    assert await quota_store.put(handle(clock, "quiet", tenant="quiet", session="q")) == []
    evicted = []
    for i in range(10):
        clock.advance(1)
        evicted += await quota_store.put(handle(clock, f"f{i}", tenant="flood",
                                                session=f"s{i}"))
    assert [h.handle_id for h in evicted] == [f"f{i}" for i in range(7)]
    assert all(h.tenant == "flood" for h in evicted)
    for i in range(7):  # evicted means claimed: nobody can reuse (or release) them again
        assert await quota_store.claim("flood", f"f{i}") is None
    for i in range(7, 10):
        assert await quota_store.peek_latest("flood", f"s{i}") is not None
    assert (await quota_store.claim_latest("quiet", "q")) is not None


async def test_claimed_handles_stop_counting_against_the_quota(quota_store: SessionStore,
                                                               clock: FakeClock) -> None:
    for i in range(3):
        clock.advance(1)
        await quota_store.put(handle(clock, f"h{i}", session=f"s{i}"))
    assert await quota_store.claim("acme", "h0") is not None
    assert await quota_store.claim_latest("acme", "s1") is not None
    clock.advance(1)
    assert await quota_store.put(handle(clock, "h3", session="s3")) == []
    clock.advance(1)
    assert await quota_store.put(handle(clock, "h4", session="s4")) == []
    clock.advance(1)
    evicted = await quota_store.put(handle(clock, "h5", session="s5"))
    assert [h.handle_id for h in evicted] == ["h2"]


async def test_the_global_bound_returns_what_it_evicts(clock: FakeClock) -> None:
    store = MemoryStore(max_handles=2, clock=clock)
    out = []
    for i in range(4):
        out += await store.put(handle(clock, f"h{i}", tenant=f"t{i}", session="s"))
    assert [h.handle_id for h in out] == ["h0", "h1"]


async def test_the_global_bounds_evict_the_biggest_holder_first(clock: FakeClock) -> None:
    """A tenant under its fair share keeps every handle when another floods past the
    store's bound; every handle the flood loses is handed back (to be released on D)."""
    store = MemoryStore(max_handles=10, clock=clock)
    for i in range(3):
        clock.advance(1)
        assert await store.put(handle(clock, f"a{i}", tenant="a", session=f"a{i}")) == []
    evicted = []
    for i in range(20):
        clock.advance(1)
        evicted += await store.put(handle(clock, f"b{i}", tenant="b", session=f"b{i}"))
    assert [(h.tenant, h.handle_id) for h in evicted] == [("b", f"b{i}") for i in range(13)]
    for i in range(13):  # evicted means claimed: nobody reuses them, the caller releases
        assert await store.claim("b", f"b{i}") is None
    assert len(store) == 10
    for i in range(3):
        assert await store.claim_latest("a", f"a{i}") is not None


async def test_the_token_bound_evicts_the_tenant_holding_the_most_tokens(
        clock: FakeClock) -> None:
    store = MemoryStore(max_tokens=1000, clock=clock)
    clock.advance(1)
    await store.put(handle(clock, "a0", tenant="a", session="a0", tokens=list(range(300))))
    evicted = []
    for i in range(8):  # b's handles are smaller, but b holds more tokens in all
        clock.advance(1)
        evicted += await store.put(handle(clock, f"b{i}", tenant="b", session=f"b{i}",
                                          tokens=list(range(150))))
    assert [h.handle_id for h in evicted] == ["b0", "b1", "b2", "b3"]
    assert store.retained_tokens <= 1000
    assert await store.claim("a", "a0") is not None
