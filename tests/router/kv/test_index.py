"""The KV index (pure), the event decoder, and the router's block hashes."""

from __future__ import annotations

import hashlib
import pickle
from typing import Any

import msgspec
import pytest
from kvagent_server.router.kv.events import BadBatch, decode_batch, parse_message
from kvagent_server.router.kv.hashing import DEFAULT_SEED, BlockHasher, HashUnavailable, event_key
from kvagent_server.router.kv.index import (
    Cleared,
    KVEventSource,
    KVIndex,
    Removed,
    Stored,
    sources_by_node,
)


def stored(*hashes: int, medium: str | None = "GPU", group: int | None = 0,
           block_size: int | None = 16) -> Stored:
    return Stored(hashes=tuple(hashes), medium=medium, group=group, block_size=block_size)


# ------------------------------------------------------------------ index


def test_stored_and_removed_blocks_give_the_prefix_reach() -> None:
    idx = KVIndex()
    assert idx.apply("p0", 0, [stored(1, 2, 3)]) == "first"
    assert idx.prefix_blocks("p0", [1, 2, 3, 4]) == {"gpu": 3, "cpu": 3, "disk": 3}
    assert idx.apply("p0", 1, [Removed(hashes=(2,), medium="GPU", group=0)]) == "ok"
    assert idx.prefix_blocks("p0", [1, 2, 3]) == {"gpu": 1, "cpu": 1, "disk": 1}
    assert idx.prefix_blocks("p0", [9, 1]) == {"gpu": 0, "cpu": 0, "disk": 0}
    assert idx.prefix_blocks("unknown", [1]) == {"gpu": 0, "cpu": 0, "disk": 0}
    assert idx.block_size("p0") == 16


def test_lower_tiers_continue_where_the_faster_ones_stop() -> None:
    idx = KVIndex()
    idx.apply("p0", 0, [stored(1), stored(2, 3, medium="CPU"), stored(4, 5, medium="STORAGE"),
                        stored(6, medium="CPU")])
    reach = idx.prefix_blocks("p0", [1, 2, 3, 4, 5, 6, 7])
    assert reach == {"gpu": 1, "cpu": 3, "disk": 6}
    hits = idx.tier_hits("p0", [1, 2, 3, 4, 5, 6, 7], 16, in_flight=2)
    assert (hits.gpu, hits.cpu, hits.disk, hits.in_flight) == (16, 48, 96, 2)
    # Only a prefix counts: a block held in a tier after a gap is no hit.
    assert idx.prefix_blocks("p0", [2, 3]) == {"gpu": 0, "cpu": 2, "disk": 2}


def test_offload_tiers_count_repeated_announcements_gpu_does_not() -> None:
    idx = KVIndex()
    # Overlapping offloaded chunks announce a shared hash twice and evict it twice.
    idx.apply("p0", 0, [stored(7, medium="CPU"), stored(7, medium="CPU")])
    idx.apply("p0", 1, [Removed(hashes=(7,), medium="CPU")])
    assert idx.prefix_blocks("p0", [7])["cpu"] == 1
    idx.apply("p0", 2, [Removed(hashes=(7,), medium="CPU")])
    assert idx.prefix_blocks("p0", [7])["cpu"] == 0
    # The GPU pool re-announces reused blocks without a removal: one removal frees it.
    idx.apply("p0", 3, [stored(8), stored(8)])
    idx.apply("p0", 4, [Removed(hashes=(8,), medium="GPU")])
    assert idx.prefix_blocks("p0", [8])["gpu"] == 0


def test_gap_restart_clear_and_epoch_forget_the_node() -> None:
    idx = KVIndex()
    idx.apply("p0", 5, [stored(1)])
    assert idx.apply("p0", 7, [stored(2)]) == "gap"  # batch 6 lost: a removal may be in it
    assert idx.prefix_blocks("p0", [1]) == {"gpu": 0, "cpu": 0, "disk": 0}
    assert idx.prefix_blocks("p0", [2])["gpu"] == 1  # the batch itself still applies
    assert idx.apply("p0", 0, [stored(3)]) == "restart"  # a new publisher counts from 0
    assert idx.prefix_blocks("p0", [2])["gpu"] == 0 and idx.nodes["p0"].resets == 2
    idx.apply("p0", 1, [stored(4, medium="CPU"), Cleared()])
    assert not idx.holds_any(["p0"])
    idx.apply("p0", 2, [stored(5)])
    assert idx.observe_epoch("p0", "s1") is False  # first sighting: nothing to forget
    assert idx.holds_any(["p0"])
    assert idx.observe_epoch("p0", "s1") is False
    assert idx.observe_epoch("p0", "s2") is True
    assert not idx.holds_any(["p0", "p1"])
    with pytest.raises(ValueError):
        idx.apply("p0", -1, [])


def test_other_groups_and_unknown_media_are_ignored() -> None:
    idx = KVIndex()
    idx.apply("p0", 0, [stored(1, group=1), stored(2, medium="HBM3"), stored(3, group=None,
                                                                          medium=None)])
    assert idx.prefix_blocks("p0", [1])["gpu"] == 0
    assert idx.prefix_blocks("p0", [2]) == {"gpu": 0, "cpu": 0, "disk": 0}
    assert idx.prefix_blocks("p0", [3])["gpu"] == 1  # no medium: vLLM's own KV cache


def test_sources_are_matched_to_registry_names_by_url() -> None:
    src = KVEventSource(endpoint="ipc:///tmp/x.ipc")
    got = sources_by_node({"http://h:1/": src, "http://h:9": src},
                          {"p0": "http://h:1", "d0": "http://h:2"})
    assert got == {"p0": src}
    with pytest.raises(ValueError):
        KVEventSource(endpoint="")


# ------------------------------------------------------------------ decoding


def batch(events: list[dict[str, Any]], ts: float = 1.0) -> bytes:
    """A batch as vLLM's ZmqEventPublisher encodes it (array-like batch, tagged events)."""
    return msgspec.msgpack.encode([ts, events, 0])


def test_decode_batch_reads_vllm_shaped_events() -> None:
    digest = hashlib.sha256(b"x").digest()
    payload = batch([
        {"type": "BlockStored", "block_hashes": [12, digest], "parent_block_hash": None,
         "token_ids": [1, 2], "block_size": 16, "lora_id": None, "medium": "CPU",
         "lora_name": None, "group_idx": 0, "something_new": 1},
        {"type": "BlockStored", "block_hashes": [5], "parent_block_hash": None,
         "token_ids": [], "block_size": 16, "lora_id": 3, "medium": "GPU",
         "lora_name": "adapter"},
        {"type": "BlockRemoved", "block_hashes": [12], "medium": "GPU"},
        {"type": "AllBlocksCleared"},
        {"type": "FutureEvent", "x": 1},
        "not-an-event",
    ])
    events = decode_batch(payload)
    assert events == [
        Stored(hashes=(12, event_key(digest)), medium="CPU", group=0, block_size=16),
        Removed(hashes=(12,), medium="GPU", group=None),
        Cleared(),
    ]  # the LoRA block is dropped: the router never computes LoRA hashes
    seq, evs = parse_message([b"kvagent", (41).to_bytes(8, "big"), payload])
    assert seq == 41 and evs == events
    for bad in ([b"t", b"123", payload], [b"t", (1).to_bytes(8, "big")]):
        with pytest.raises(BadBatch):
            parse_message(bad)
    with pytest.raises(BadBatch):
        decode_batch(b"\xc1")
    with pytest.raises(BadBatch):
        decode_batch(msgspec.msgpack.encode({"ts": 1}))


# ------------------------------------------------------------------ hashes


def _sha(value: Any) -> bytes:
    return hashlib.sha256(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def test_block_hashes_chain_from_the_seed_and_salt_the_first_block() -> None:
    h = BlockHasher()
    ids = list(range(40))
    got = h.hashes(ids, 16, cache_salt="t1")
    assert len(got) == 2  # full blocks only
    root = _sha(DEFAULT_SEED)
    b0 = _sha((root, tuple(range(16)), (("cache_salt", "t1"),)))
    assert got == [b0, _sha((b0, tuple(range(16, 32)), None))]
    assert h.keys(ids, 16, cache_salt="t1") == [int.from_bytes(x[-8:], "big") for x in got]
    unsalted = h.keys(ids, 16)
    assert unsalted[0] != h.keys(ids, 16, cache_salt="t1")[0]
    assert BlockHasher("sha256", "42").keys(ids, 16) != unsalted
    assert h.keys(ids[:15], 16) == []
    assert BlockHasher("sha256_cbor").keys(ids, 16) != unsalted
    with pytest.raises(ValueError):
        h.hashes(ids, 0)


def test_unreproducible_hash_configurations_are_refused() -> None:
    with pytest.raises(HashUnavailable, match="PYTHONHASHSEED"):
        BlockHasher("xxhash")
    with pytest.raises(HashUnavailable):
        BlockHasher("md5")  # type: ignore[arg-type]
    assert event_key(1 << 70 | 3) == 3
    assert event_key(b"\x01" * 16) == int.from_bytes(b"\x01" * 8, "big")
