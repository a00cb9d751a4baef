"""Spilled, not gone: the spill a given-up handle leaves, its record, and what a turn may
load from it (reuse/spill.py, on plain facts), and its shell over both stores."""

from __future__ import annotations

import time

import pytest
from kvagent_server.router.kv.index import KVIndex, Removed, Stored
from kvagent_server.router.kv.tiers import NodeTiers
from kvagent_server.router.nodes.spills import Spills
from kvagent_server.router.reuse.identity import IdentityCheck
from kvagent_server.router.reuse.spill import (
    Spilled,
    pack_spill,
    plan_spill,
    spill_of,
    tiers_by_name,
    unpack_spill,
)
from kvagent_server.router.store.base import StoreUnavailable
from kvagent_server.router.store.handle import Handle, KVIdentity
from kvagent_server.router.store.memory import MemoryStore
from kvagent_server.router.store.records import SPILLED

HOST = NodeTiers(host=True, chunk_tokens=16)
SHARED = NodeTiers(host=True, disk=True, shared=True, chunk_tokens=16)
AGREE = IdentityCheck()


def handle(tokens: int = 100, prompt: int | None = 80, *, session: str = "s",
           node: str = "d0", tenant: str = "t") -> Handle:
    now = time.time()
    return Handle(handle_id=f"h-{session}", tenant=tenant, session=session, decode_node=node,
                  decode_epoch="e1", kv_transfer_params={"remote_request_id": "r"},
                  token_ids=list(range(tokens)), block_size=16, created_at=now,
                  expires_at=now + 60, identity=KVIdentity(model="m", cache_salt=None),
                  prompt_tokens=prompt)


def test_a_given_up_handle_spills_the_whole_chunks_of_its_prompt() -> None:
    spill = spill_of(handle(100, 80), HOST, now=5.0)
    assert spill is not None and spill.stored_tokens == 80 and spill.host and not spill.disk
    # generated tokens too when the tiers store them; whole chunks only
    everything = spill_of(handle(100, 80), NodeTiers(host=True, chunk_tokens=16,
                                                     prompt_only=False), now=5.0)
    assert everything is not None and everything.stored_tokens == 96
    assert spill_of(handle(), None, now=0) is None  # no tier: gone
    assert spill_of(handle(), NodeTiers(), now=0) is None
    assert spill_of(handle(100, None), HOST, now=0) is None  # prompt length unknown
    assert spill_of(handle(10, 10), HOST, now=0) is None  # less than one chunk


def test_a_spill_record_round_trips() -> None:
    h = handle()
    spill = spill_of(h, SHARED, now=1.0)
    assert spill is not None and spill.shared
    back, back_handle = unpack_spill(pack_spill(spill, h))
    assert back == spill and back_handle == h


def test_a_turn_loads_the_verified_chunks_of_its_spill() -> None:
    h = handle(100, 80)
    spill = spill_of(h, SHARED, now=0)
    assert spill is not None
    prompt = [*range(100), 500, 501]  # the whole held turn, and more
    tier = plan_spill(prompt, Spilled(spill, h), threshold=16, identity=AGREE)
    assert tier is not None and (tier.host_tokens, tier.disk_tokens) == (80, 80)
    assert tier.shared and tier.tokens == 80 and tier.node == "d0"
    # diverging at 40: two whole chunks
    edited = [*range(40), 999, *range(41, 100)]
    tier = plan_spill(edited, Spilled(spill, h), threshold=16, identity=AGREE)
    assert tier is not None and tier.tokens == 32
    # what the KV events show still there caps it (the host tier evicted part)
    tier = plan_spill(prompt, Spilled(spill, h, host_reach=48, disk_reach=None),
                      threshold=16, identity=AGREE)
    assert tier is not None and (tier.host_tokens, tier.disk_tokens) == (48, 80)
    # an identity cap, a short prefix, another identity, nothing held
    assert plan_spill(prompt, Spilled(spill, h), threshold=16,
                      identity=IdentityCheck(cap=20)).tokens == 16  # type: ignore[union-attr]
    assert plan_spill([*range(20), 7], Spilled(spill, h), threshold=32, identity=AGREE) is None
    assert plan_spill(prompt, Spilled(spill, h), threshold=16,
                      identity=IdentityCheck(reason="identity_changed", cap=0)) is None
    assert plan_spill(prompt, Spilled(spill, h), threshold=16, identity=None) is None
    gone = Spilled(spill, h, host_reach=0, disk_reach=0)
    assert plan_spill(prompt, gone, threshold=16, identity=AGREE) is None
    # vLLM computes the last prompt token: a prompt equal to the spill loads one chunk less
    same = plan_spill(list(range(80)), Spilled(spill, h), threshold=16, identity=AGREE)
    assert same is not None and same.tokens == 64


def test_tiers_are_named_like_the_registry() -> None:
    assert tiers_by_name({"http://d:1/": HOST}, {"d0": "http://d:1", "p0": "http://p:1"}) == {
        "d0": HOST}


async def test_given_up_handles_are_recorded_per_session_and_found() -> None:
    store = MemoryStore()
    counted: list[int] = []
    spills = Spills(store, {"d0": HOST}, ttl_s=60, on_spilled=counted.append)
    h1, h2 = handle(session="s1"), handle(session="s2", node="d1")  # d1 has no tier
    assert await spills.record([h1, h2]) == 1 and counted == [1]
    found = await spills.find("t", "s1")
    assert found is not None and found[0].node == "d0" and found[1].token_ids == h1.token_ids
    assert await spills.find("t", "s2") is None and await spills.find("other", "s1") is None
    assert await store.get_record("t", SPILLED, "s1") is not None
    with pytest.raises(ValueError):
        Spills(store, {}, ttl_s=0)


async def test_a_store_down_loses_the_record_not_the_turn() -> None:
    class Down(MemoryStore):
        async def put_records(self, *a: object, **k: object) -> None:
            raise StoreUnavailable("down")

        async def get_record(self, *a: object, **k: object) -> bytes | None:
            raise StoreUnavailable("down")

    spills = Spills(Down(), {"d0": HOST}, ttl_s=60)
    assert await spills.record([handle()]) == 0
    assert await spills.find("t", "s") is None


def test_a_shared_disk_is_one_place_for_every_node_that_shares_it() -> None:
    idx = KVIndex(shared=["p0", "d0"])
    idx.apply("d0", 0, [Stored(hashes=(1, 2, 3), medium="CPU"),
                        Stored(hashes=(1, 2, 3), medium="STORAGE")])
    # D wrote the files: P, which never saw the prompt, reads them from the directory
    assert idx.prefix_blocks("p0", [1, 2, 3, 4]) == {"gpu": 0, "cpu": 0, "disk": 3}
    assert idx.prefix_blocks("d0", [1, 2, 3, 4]) == {"gpu": 0, "cpu": 3, "disk": 3}
    assert idx.holds_any(["p0"])
    # both nodes store the same file; one removal deletes it (not counted)
    idx.apply("p0", 0, [Stored(hashes=(1, 2, 3), medium="STORAGE")])
    idx.apply("p0", 1, [Removed(hashes=(3,), medium="STORAGE")])
    assert idx.prefix_blocks("d0", [1, 2, 3])["disk"] == 3  # the CPU tier still has 3
    assert idx.prefix_blocks("p0", [1, 2, 3])["disk"] == 2
    # a node not sharing it keeps its own disk
    idx.apply("x", 0, [Stored(hashes=(1,), medium="STORAGE")])
    assert idx.prefix_blocks("x", [1, 2])["disk"] == 1 and 1 in idx.shared
    # a sharing node whose events may have been missed empties the shared set
    idx.apply("p0", 5, [])  # a gap
    assert idx.prefix_blocks("p0", [1, 2, 3])["disk"] == 0


def test_the_holding_nodes_events_say_how_much_of_a_spill_is_still_there() -> None:
    from kvagent_server.router.kv.index import KVEventSource
    from kvagent_server.router.nodes.tier_placement import TierPlacement

    idx = KVIndex(shared=["d0", "p0"])
    src = KVEventSource(endpoint="ipc:///x")
    tp = TierPlacement(idx, {"d0": src, "p0": src, "d1": src})
    ids = list(range(64))
    keys = tp.hashers["d0"].keys(ids, 16, cache_salt="s")
    # nothing heard from d0's tiers: unknown, not empty (it may publish none)
    idx.apply("d0", 0, [Stored(hashes=tuple(keys), medium="GPU")])
    assert tp.reach("d0", ids, block_size=16, cache_salt="s") is None
    # its host tier holds two blocks, the shared disk three: engine memory lost them
    idx.apply("d0", 1, [Removed(hashes=tuple(keys), medium="GPU"),
                        Stored(hashes=tuple(keys[:2]), medium="CPU"),
                        Stored(hashes=tuple(keys[:3]), medium="STORAGE")])
    def reach(node: str, salt: str = "s") -> tuple[int, int, int] | None:
        hits = tp.reach(node, ids, block_size=16, cache_salt=salt)
        return None if hits is None else (hits.gpu, hits.cpu, hits.disk)

    assert reach("d0") == (0, 32, 48)
    assert reach("d0", "other") == (0, 0, 0)
    assert reach("d1") is None  # never heard of
    # a P node that computed the conversation's earlier prompt: its engine memory holds
    # the first block, its host tier the second; the shared disk D wrote reaches further
    idx.apply("p0", 0, [Stored(hashes=tuple(keys[:1]), medium="GPU"),
                        Stored(hashes=tuple(keys[1:2]), medium="CPU")])
    assert reach("p0") == (16, 32, 48)
