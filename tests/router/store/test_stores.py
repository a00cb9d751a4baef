"""Session stores: single-use claims, latest pointers, expiry, bounds, and the race.

Redis tests run against a real redis-server (tests/conftest.py starts one) and are
skipped only when the binary is missing.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, rule, run_state_machine_as_test
from kvagent_server.router.auth.keys import KeyRing
from kvagent_server.router.settings import RouterSettings
from kvagent_server.router.store.base import SessionStore
from kvagent_server.router.store.factory import key_ring_for, make_store
from kvagent_server.router.store.handle import (
    Handle,
    TurnEnd,
    handle_meta,
    new_handle_id,
    pack_handle,
    unpack_handle,
)
from kvagent_server.router.store.memory import MemoryStore
from kvagent_server.router.store.redis_store import RedisStore


class FakeClock:
    """A wall clock the test moves by hand."""

    def __init__(self, now: float = 1_800_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()



def handle(clock: FakeClock, handle_id: str | None = None, *, tenant: str = "acme",
           session: str = "s1", node: str = "d0", epoch: str = "e1", ttl: float = 400,
           tokens: list[int] | None = None) -> Handle:
    token_ids = list(range(100)) if tokens is None else tokens
    return Handle(
        handle_id=handle_id or new_handle_id(), tenant=tenant, session=session,
        decode_node=node, decode_epoch=epoch,
        kv_transfer_params={"remote_block_ids": [[1, 2, 3]], "remote_num_tokens": 99,
                            "remote_engine_id": "d-eng", "remote_host": "127.0.0.1",
                            "remote_port": 5601, "remote_blocks_expiry_time": 12.5},
        token_ids=token_ids, block_size=16, created_at=clock.now,
        expires_at=clock.now + ttl)


async def warm(*stores: SessionStore, n: int = 50) -> None:
    """Open `n` pooled connections first: claims racing on connections that already
    exist really interleave in Redis (a cold pool connects one by one and would hide a
    non-atomic claim: checked, a GET-then-DEL claim then has 50 winners here)."""
    await asyncio.gather(*(stores[i % len(stores)].ping() for i in range(n)))


@pytest.fixture(params=["memory", pytest.param("redis", marks=pytest.mark.redis)])
def store(request: pytest.FixtureRequest, clock: FakeClock) -> SessionStore:
    if request.param == "memory":
        return MemoryStore(clock=clock)
    make = request.getfixturevalue("redis_stores")
    return make(clock=clock)


# ------------------------------------------------------------------ serialisation


def test_pack_round_trip_keeps_everything() -> None:
    clock = FakeClock()
    h = handle(clock, tokens=[0, 1, 2**32 - 1, 151_643, 7] * 1000)
    assert unpack_handle(pack_handle(h)) == h
    assert handle_meta(pack_handle(h))["decode_epoch"] == "e1"
    assert len(pack_handle(h)) < 4 * 5000 + 1000  # 4 bytes a token


def test_handle_validation() -> None:
    clock = FakeClock()
    good = handle(clock).model_dump()
    for bad in ({"token_ids": [-1]}, {"token_ids": [2**32]}, {"block_size": 0},
                {"expires_at": clock.now - 1}, {"handle_id": ""}, {"extra": 1}):
        with pytest.raises(ValueError):
            Handle(**(good | bad))


# ------------------------------------------------------------------ store contract


async def test_claim_is_single_use(store: SessionStore, clock: FakeClock) -> None:
    h = handle(clock)
    await store.put(h)
    assert await store.claim("acme", h.handle_id) == h
    assert await store.claim("acme", h.handle_id) is None
    assert await store.claim_latest("acme", "s1") is None
    assert await store.peek_latest("acme", "s1") is None


async def test_unknown_and_other_tenant_claims_get_nothing(store: SessionStore,
                                                           clock: FakeClock) -> None:
    h = handle(clock)
    await store.put(h)
    assert await store.claim("acme", "no-such-handle") is None
    assert await store.claim("globex", h.handle_id) is None
    assert await store.claim_latest("globex", "s1") is None
    assert await store.peek_latest("globex", "s1") is None
    assert await store.claim("acme", "") is None
    assert await store.claim("acme", h.handle_id + ":x") is None
    assert await store.claim("acme", h.handle_id) == h  # still there for its owner


async def test_latest_follows_the_newest_put(store: SessionStore, clock: FakeClock) -> None:
    old, new = handle(clock, "h-old"), handle(clock, "h-new")
    await store.put(old)
    assert await store.peek_latest("acme", "s1") == old
    await store.put(new)
    assert await store.peek_latest("acme", "s1") == new
    assert await store.peek_latest("acme", "s1") == new  # peeking does not claim
    assert await store.claim_latest("acme", "s1") == new
    assert await store.claim_latest("acme", "s1") is None
    assert await store.claim("acme", "h-new") is None
    # the older handle stays claimable by its own token (a forked conversation)
    assert await store.claim("acme", "h-old") == old


async def test_claim_by_id_invalidates_the_latest_pointer(store: SessionStore,
                                                          clock: FakeClock) -> None:
    h = handle(clock)
    await store.put(h)
    assert await store.claim("acme", h.handle_id) == h
    assert await store.peek_latest("acme", "s1") is None
    assert await store.claim_latest("acme", "s1") is None


async def test_sessions_and_tenants_do_not_collide(store: SessionStore,
                                                   clock: FakeClock) -> None:
    # ':' is legal in session ids and tenant names: "a:b"+"c" must not meet "a"+"b:c"
    h1 = handle(clock, "h1", tenant="a:b", session="c")
    h2 = handle(clock, "h2", tenant="a", session="b:c")
    h3 = handle(clock, "h1", tenant="a", session="c")  # same handle id, other tenant
    for h in (h1, h2, h3):
        await store.put(h)
    assert await store.peek_latest("a:b", "c") == h1
    assert await store.peek_latest("a", "b:c") == h2
    assert await store.peek_latest("a", "c") == h3
    assert await store.claim("a:b", "h1") == h1
    assert await store.claim("a", "h1") == h3
    assert await store.claim_latest("a", "b:c") == h2


async def test_expired_handles_are_never_returned(store: SessionStore,
                                                  clock: FakeClock) -> None:
    await store.put(handle(clock, "dead", ttl=0))  # already expired: not stored
    assert await store.claim("acme", "dead") is None
    h = handle(clock, "h", ttl=10)
    await store.put(h)
    clock.advance(9.9)
    assert await store.peek_latest("acme", "s1") == h
    clock.advance(0.1)
    assert await store.peek_latest("acme", "s1") is None
    assert await store.claim_latest("acme", "s1") is None
    assert await store.claim("acme", "h") is None


async def test_drop_node(store: SessionStore, clock: FakeClock) -> None:
    for i in range(3):
        await store.put(handle(clock, f"a{i}", session=f"s{i}", node="d0", epoch="old"))
    await store.put(handle(clock, "b0", session="s9", node="d1"))
    await store.put(handle(clock, "a3", session="s3", node="d0", epoch="new"))
    assert await store.drop_node("d0", keep_epoch="new") == 3
    assert await store.claim("acme", "a0") is None
    assert await store.peek_latest("acme", "s1") is None
    assert await store.claim("acme", "a3") is not None
    assert await store.claim("acme", "b0") is not None
    assert await store.drop_node("d0") == 0
    assert await store.drop_node("never-seen") == 0


async def test_evict_oldest_takes_a_nodes_oldest_until_enough_blocks(
        store: SessionStore, clock: FakeClock) -> None:
    for i in range(6):  # 3 blocks each, one second apart: a0 is the oldest
        await store.put(handle(clock, f"a{i}", session=f"s{i}", node="d0"))
        await store.put(handle(clock, f"b{i}", session=f"t{i}", node="d1"))
        clock.advance(1)
    evicted = await store.evict_oldest("d0", 5, 100)  # 5 blocks: two handles
    ids = [h.handle_id for h in evicted]
    assert ids[:2] == ["a0", "a1"] and all(h.decode_node == "d0" for h in evicted)
    # Redis takes a small batch at once; never more than the node holds or the bound.
    assert len(ids) <= 6
    for h in evicted:  # evicted is claimed: no turn can present it any more
        assert await store.claim("acme", h.handle_id) is None
    assert await store.claim("acme", "b0") is not None  # other nodes untouched
    left = await store.evict_oldest("d0", -1, 100)  # negative: up to the bound
    assert {h.handle_id for h in left} == {f"a{i}" for i in range(6)} - set(ids)
    assert await store.evict_oldest("d0", 10, 100) == []


async def test_evict_oldest_respects_the_bound_and_skips_expired(
        store: SessionStore, clock: FakeClock) -> None:
    await store.put(handle(clock, "old", session="s0", node="d0", ttl=5))
    clock.advance(1)
    for i in range(4):
        await store.put(handle(clock, f"a{i}", session=f"s{i + 1}", node="d0"))
    clock.advance(10)  # "old" expired
    evicted = await store.evict_oldest("d0", 1000, 2)
    assert [h.handle_id for h in evicted] == ["a0", "a1"]


async def test_large_token_lists_round_trip(store: SessionStore, clock: FakeClock) -> None:
    h = handle(clock, tokens=[(i * 7919) % 152_000 for i in range(120_000)])
    await store.put(h)
    got = await store.claim("acme", h.handle_id)
    assert got is not None and got.token_ids == h.token_ids


async def test_ping(store: SessionStore) -> None:
    assert await store.ping() is True


async def test_concurrent_claims_of_one_handle_have_one_winner(store: SessionStore,
                                                               clock: FakeClock) -> None:
    h = handle(clock)
    await store.put(h)
    await warm(store)
    results = await asyncio.gather(*(store.claim("acme", h.handle_id) for _ in range(50)))
    assert [r for r in results if r is not None] == [h]


# ------------------------------------------------------------------ memory store bounds


async def test_memory_store_evicts_oldest_over_the_handle_bound(clock: FakeClock) -> None:
    store = MemoryStore(max_handles=3, clock=clock)
    for i in range(5):
        await store.put(handle(clock, f"h{i}", session=f"s{i}"))
    assert len(store) == 3
    assert await store.claim("acme", "h0") is None
    assert await store.peek_latest("acme", "s1") is None  # evicted with its handle
    assert await store.claim("acme", "h4") is not None


async def test_memory_store_bounds_total_tokens(clock: FakeClock) -> None:
    store = MemoryStore(max_tokens=250, clock=clock)
    for i in range(4):
        await store.put(handle(clock, f"h{i}", session=f"s{i}"))  # 100 tokens each
    assert len(store) == 2 and store.retained_tokens == 200
    # a single handle over the bound is still kept (the newest is never evicted)
    await store.put(handle(clock, "big", tokens=list(range(1000))))
    assert len(store) == 1 and await store.claim("acme", "big") is not None
    assert store.retained_tokens == 0


async def test_memory_store_sweeps_expired_entries(clock: FakeClock) -> None:
    store = MemoryStore(clock=clock)
    await store.put(handle(clock, "short", session="a", ttl=5))
    await store.put(handle(clock, "long", session="b", ttl=50))
    clock.advance(10)
    await store.put(handle(clock, "new", session="c"))  # put sweeps from the oldest
    assert len(store) == 2
    clock.advance(1000)
    assert store.sweep() == 2 and len(store) == 0 and store.retained_tokens == 0


async def test_memory_store_replacing_a_handle_keeps_counts_right(clock: FakeClock) -> None:
    store = MemoryStore(clock=clock)
    await store.put(handle(clock, "h"))
    await store.put(handle(clock, "h"))
    assert len(store) == 1 and store.retained_tokens == 100
    await store.close()
    assert len(store) == 0


def test_memory_store_rejects_bad_bounds() -> None:
    with pytest.raises(ValueError):
        MemoryStore(max_handles=0)


# ------------------------------------------------------------------ redis specifics


@pytest.mark.redis
async def test_redis_two_replicas_race_for_one_handle(
        redis_stores: Callable[..., RedisStore], clock: FakeClock) -> None:
    a, b = redis_stores(clock=clock), redis_stores(clock=clock)
    for round_ in range(5):
        h = handle(clock, f"h{round_}")
        await a.put(h)
        await warm(a, b)
        claims = [(a if i % 2 else b).claim("acme", h.handle_id) for i in range(50)]
        results = await asyncio.gather(*claims)
        assert [r for r in results if r is not None] == [h]


@pytest.mark.redis
async def test_redis_two_replicas_race_for_the_latest_pointer(
        redis_stores: Callable[..., RedisStore], clock: FakeClock) -> None:
    """claim_latest and claim-by-token racing on both replicas: still one winner."""
    a, b = redis_stores(clock=clock), redis_stores(clock=clock)
    for round_ in range(5):
        h = handle(clock, f"h{round_}", session="race")
        await b.put(h)
        await warm(a, b)
        calls = []
        for i in range(50):
            replica = a if i % 2 else b
            calls.append(replica.claim_latest("acme", "race") if i % 3
                         else replica.claim("acme", h.handle_id))
        results = await asyncio.gather(*calls)
        assert [r for r in results if r is not None] == [h]


@pytest.mark.redis
def test_redis_replicas_in_separate_threads_and_loops(redis_server: Any) -> None:
    """Two replicas with their own event loops and connections, released together."""
    import uuid

    prefix = f"kvt{uuid.uuid4().hex[:8]}"
    clock = FakeClock()
    h = handle(clock)
    barrier = threading.Barrier(2)
    wins: list[int] = []

    async def replica(put_first: bool) -> None:
        store = RedisStore.from_url(redis_server.url, prefix=prefix, clock=clock)
        try:
            if put_first:
                await store.put(h)
            await warm(store, n=25)  # connect before the start line
            barrier.wait()
            results = await asyncio.gather(*(store.claim("acme", h.handle_id)
                                             for _ in range(25)))
            wins.append(sum(r is not None for r in results))
        finally:
            await store.close()

    first = threading.Thread(target=lambda: asyncio.run(replica(True)))
    first.start()
    time.sleep(0.2)  # the put happens before the second replica reaches the barrier
    second = threading.Thread(target=lambda: asyncio.run(replica(False)))
    second.start()
    first.join(30)
    second.join(30)
    assert sorted(wins) in ([0, 1],)


@pytest.mark.redis
async def test_redis_keys_expire_in_redis_and_are_namespaced(
        redis_stores: Callable[..., RedisStore]) -> None:
    store = redis_stores()  # real clock
    now = time.time()
    h = Handle(**(handle(FakeClock(now), "hx", tenant="ten:ant", session="s:1",
                         ttl=0.4).model_dump()))
    await store.put(h)
    raw = store._r  # the test inspects the real keys
    keys = sorted(k.decode() for k in await raw.keys(f"{store._prefix}:*"))
    assert keys == [f"{store._prefix}:node:d0", f"{store._prefix}:ten%3Aant:h:hx",
                    f"{store._prefix}:ten%3Aant:l:s%3A1", f"{store._prefix}:ten%3Aant:q"]
    for key in keys:
        assert 0 < await raw.pttl(key) <= 400
    await asyncio.sleep(0.6)
    assert await raw.keys(f"{store._prefix}:*") == []
    assert await store.claim("ten:ant", "hx") is None


@pytest.mark.redis
async def test_redis_node_index_lives_as_long_as_its_longest_handle(
        redis_stores: Callable[..., RedisStore], clock: FakeClock) -> None:
    store = redis_stores(clock=clock)
    nkey = f"{store._prefix}:node:d0"
    await store.put(handle(clock, "long", session="a", ttl=300))
    await store.put(handle(clock, "short", session="b", ttl=10))
    assert 290_000 < await store._r.pttl(nkey) <= 300_000  # not shortened
    await store.put(handle(clock, "longer", session="c", ttl=600))
    assert 590_000 < await store._r.pttl(nkey) <= 600_000  # extended
    # entries whose handles expired are trimmed on the next put
    clock.advance(20)
    await store.put(handle(clock, "next", session="d"))
    members = {m.decode().rsplit(":", 1)[1] for m in await store._r.zrange(nkey, 0, -1)}
    assert members == {"long", "longer", "next"}


@pytest.mark.redis
async def test_redis_ping_fails_cleanly_when_unreachable() -> None:
    from kvagent_server.common.ports import free_port

    port = free_port()  # a port nobody listens on
    store = RedisStore.from_url(f"redis://127.0.0.1:{port}/0")
    try:
        assert await store.ping() is False
    finally:
        await store.close()


@pytest.mark.redis
async def test_redis_replicas_share_one_signing_key(
        redis_stores: Callable[..., RedisStore]) -> None:
    a, b = redis_stores(), redis_stores()
    ring_a, ring_b = await asyncio.gather(key_ring_for(RouterSettings(), a),
                                          key_ring_for(RouterSettings(), b))
    assert ring_a.active_kid == ring_b.active_kid
    assert ring_a.key(ring_a.active_kid) == ring_b.key(ring_b.active_kid)
    assert len(ring_a.key(ring_a.active_kid) or b"") == 32


async def test_configured_keys_win_and_memory_gets_a_random_key() -> None:
    configured = RouterSettings(signing_keys={"k1": "z" * 32})
    assert (await key_ring_for(configured, MemoryStore())).key("k1") == b"z" * 32
    one = await key_ring_for(RouterSettings(), MemoryStore())
    two = await key_ring_for(RouterSettings(), MemoryStore())
    assert isinstance(one, KeyRing) and one.active_kid != two.active_kid


async def test_make_store(redis_server: Any) -> None:
    assert isinstance(make_store(RouterSettings()), MemoryStore)
    store = make_store(RouterSettings(redis_url=redis_server.url))
    try:
        assert isinstance(store, RedisStore) and await store.ping()
    finally:
        await store.close()


def test_both_stores_satisfy_the_protocol() -> None:
    assert isinstance(MemoryStore(), SessionStore)
    assert isinstance(RedisStore.from_url("redis://127.0.0.1:1/0"), SessionStore)


# ------------------------------------------------------------------ model-based test


TENANTS = ["a", "b:c"]
SESSIONS = ["s1", "s2", "x:y"]


class StoreMachine(RuleBasedStateMachine):
    """Random sequences of store operations, checked against a dict-based model."""

    redis_url: str | None = None  # set by the test that runs the machine

    def __init__(self) -> None:
        super().__init__()
        import uuid

        self.clock = FakeClock()
        self.loop = asyncio.new_event_loop()
        if self.redis_url is None:
            self.store: SessionStore = MemoryStore(clock=self.clock)
        else:
            self.store = RedisStore.from_url(self.redis_url, prefix=f"sm{uuid.uuid4().hex[:8]}",
                                             clock=self.clock)
        self.handles: dict[tuple[str, str], Handle] = {}
        self.latest: dict[tuple[str, str], str] = {}
        self.issued: list[tuple[str, str]] = [("a", "never-issued")]
        self.counter = 0

    def run(self, coro: Any) -> Any:
        return self.loop.run_until_complete(coro)

    def live(self, h: Handle | None) -> Handle | None:
        return h if h is not None and not h.expired(self.clock.now) else None

    def forget(self, key: tuple[str, str]) -> Handle | None:
        h = self.handles.pop(key, None)
        if h is not None and self.latest.get((key[0], h.session)) == key[1]:
            del self.latest[(key[0], h.session)]
        return h

    @rule(tenant=st.sampled_from(TENANTS), session=st.sampled_from(SESSIONS),
          node=st.sampled_from(["d0", "d1"]), epoch=st.sampled_from(["e1", "e2"]),
          ttl=st.sampled_from([0, 5, 50, 400]))
    def put(self, tenant: str, session: str, node: str, epoch: str, ttl: int) -> None:
        self.counter += 1
        h = handle(self.clock, f"h{self.counter}", tenant=tenant, session=session, node=node,
                   epoch=epoch, ttl=ttl, tokens=list(range(self.counter % 40)))
        self.run(self.store.put(h))
        self.issued.append((tenant, h.handle_id))
        if ttl > 0:
            self.handles[(tenant, h.handle_id)] = h
            self.latest[(tenant, session)] = h.handle_id

    @rule(data=st.data(), other_tenant=st.booleans())
    def claim(self, data: st.DataObject, other_tenant: bool) -> None:
        tenant, handle_id = data.draw(st.sampled_from(self.issued))
        if other_tenant:
            tenant = next(t for t in TENANTS if t != tenant)
        expected = self.live(self.forget((tenant, handle_id)))
        assert self.run(self.store.claim(tenant, handle_id)) == expected

    @rule(tenant=st.sampled_from(TENANTS), session=st.sampled_from(SESSIONS))
    def claim_latest(self, tenant: str, session: str) -> None:
        handle_id = self.latest.get((tenant, session))
        expected = None if handle_id is None else self.live(self.forget((tenant, handle_id)))
        assert self.run(self.store.claim_latest(tenant, session)) == expected

    @rule(tenant=st.sampled_from(TENANTS), session=st.sampled_from(SESSIONS))
    def peek_latest(self, tenant: str, session: str) -> None:
        handle_id = self.latest.get((tenant, session))
        expected = None if handle_id is None else self.live(
            self.handles.get((tenant, handle_id)))
        assert self.run(self.store.peek_latest(tenant, session)) == expected

    @rule(node=st.sampled_from(["d0", "d1"]), keep=st.sampled_from([None, "e1", "e2"]))
    def drop_node(self, node: str, keep: str | None) -> None:
        doomed = [k for k, h in self.handles.items()
                  if h.decode_node == node and (keep is None or h.decode_epoch != keep)]
        expected = sum(self.live(self.forget(k)) is not None for k in doomed)
        assert self.run(self.store.drop_node(node, keep_epoch=keep)) == expected

    @rule(seconds=st.sampled_from([1, 10, 60]))
    def advance(self, seconds: int) -> None:
        self.clock.advance(seconds)

    def teardown(self) -> None:
        self.run(self.store.close())
        self.loop.close()


MACHINE_SETTINGS = settings(max_examples=60, stateful_step_count=30, deadline=None)


def test_memory_store_matches_the_model() -> None:
    StoreMachine.redis_url = None
    run_state_machine_as_test(StoreMachine, settings=settings(
        MACHINE_SETTINGS, max_examples=300, database=None))


@pytest.mark.redis
def test_redis_store_matches_the_model(redis_server: Any) -> None:
    StoreMachine.redis_url = redis_server.url
    try:
        run_state_machine_as_test(StoreMachine, settings=settings(MACHINE_SETTINGS,
                                                                  database=None))
    finally:
        StoreMachine.redis_url = None


async def test_redis_down_at_start_gives_a_process_key_not_a_crash() -> None:
    """Routing works without Redis, so its absence at start-up must not stop the router:
    the replica signs with a key of its own (reuse across replicas degrades, nothing fails)."""
    from support import free_port

    store = RedisStore.from_url(f"redis://127.0.0.1:{free_port()}/0")
    try:
        ring = await key_ring_for(RouterSettings(), store)
        assert ring.key(ring.active_kid)
    finally:
        await store.close()


# ------------------------------------------------------------------ retention's reads


def test_turn_end_is_read_from_the_relayed_answer() -> None:
    end = TurnEnd.of("tool_calls", ["grep", "", "grep", "x" * 500, "ls"], 5.0)
    assert end.kind == "tool_call" and end.tools == ("grep", "x" * 128, "ls")
    assert TurnEnd.of("stop", ["run"], 1.0).kind == "tool_call"  # a forced tool_choice
    assert TurnEnd.of("stop", [], 1.0) == TurnEnd(kind="final", at=1.0)
    assert TurnEnd.of("length", [], 1.0).kind == "other"
    assert TurnEnd.of(None, [], 1.0).kind == "other"
    assert len(TurnEnd.of("tool_calls", [f"t{i}" for i in range(50)], 1.0).tools) == 8


def test_pack_round_trip_keeps_the_turn_end_and_omits_it_when_unknown() -> None:
    clock = FakeClock()
    h = handle(clock).model_copy(update={"end": TurnEnd(kind="tool_call", tools=("grep",),
                                                         at=clock.now)})
    assert unpack_handle(pack_handle(h)) == h
    assert handle_meta(pack_handle(h))["end"]["tools"] == ["grep"]
    assert "end" not in handle_meta(pack_handle(handle(clock)))  # readable by older routers


async def test_retained_lists_a_nodes_live_handles_with_their_ends(
        store: SessionStore, clock: FakeClock) -> None:
    tool = TurnEnd(kind="tool_call", tools=("search", "fetch"), at=clock.now)
    await store.put(handle(clock, "t", session="s0").model_copy(update={"end": tool}))
    await store.put(handle(clock, "f", session="s1", ttl=300).model_copy(
        update={"end": TurnEnd(kind="final", at=clock.now)}))
    await store.put(handle(clock, "u", session="s2", ttl=600))  # no end recorded
    await store.put(handle(clock, "gone", session="s3", ttl=5))
    await store.put(handle(clock, "other", session="s4", node="d1"))
    clock.advance(10)  # "gone" expired
    got = await store.retained("d0", 100)
    assert [r.handle_id for r in got] == ["f", "t", "u"]  # soonest to expire first
    by_id = {r.handle_id: r for r in got}
    assert by_id["t"].end == tool and by_id["f"].end is not None
    assert by_id["f"].end.kind == "final" and by_id["u"].end is None
    assert {r.blocks for r in got} == {3} and by_id["t"].key == ("acme", "t")
    assert by_id["t"].created_at == clock.now - 10 and by_id["t"].session == "s0"
    assert [r.handle_id for r in await store.retained("d0", 2)] == ["f", "t"]
    # A read claims nothing.
    assert await store.claim("acme", "t") is not None
    assert [r.handle_id for r in await store.retained("d0", 100)] == ["f", "u"]


async def test_evict_handles_claims_exactly_those_still_there(
        store: SessionStore, clock: FakeClock) -> None:
    for i in range(4):
        await store.put(handle(clock, f"a{i}", session=f"s{i}"))
    await store.put(handle(clock, "b0", session="t0", node="d1"))
    assert await store.claim("acme", "a1") is not None  # a turn took it first
    evicted = await store.evict_handles(
        "d0", [("acme", "a2"), ("acme", "a1"), ("acme", "nope"), ("acme", "b0"),
               ("other", "a3"), ("acme", "a0")])
    assert [h.handle_id for h in evicted] == ["a2", "a0"]  # in the order asked
    for hid in ("a0", "a2"):  # evicted is claimed: no turn can present it any more
        assert await store.claim("acme", hid) is None
    assert await store.claim_latest("acme", "s0") is None
    assert await store.claim("acme", "b0") is not None  # another node's: untouched
    assert [r.handle_id for r in await store.retained("d0", 10)] == ["a3"]
    assert await store.evict_handles("d0", []) == []
    assert await store.evict_handles("d0", [("acme", "a:3")]) == []


async def test_evict_handles_races_a_claim_with_one_winner(
        store: SessionStore, clock: FakeClock) -> None:
    await warm(store)
    for i in range(20):
        await store.put(handle(clock, f"h{i}", session=f"s{i}"))
    keys = [("acme", f"h{i}") for i in range(20)]
    results = await asyncio.gather(store.evict_handles("d0", keys),
                                   *(store.claim("acme", f"h{i}") for i in range(20)))
    evicted = {h.handle_id for h in results[0]}
    claimed = {h.handle_id for h in results[1:] if h is not None}
    assert not evicted & claimed and evicted | claimed == {f"h{i}" for i in range(20)}
