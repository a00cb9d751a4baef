"""tools/gpu/check_tiers.py: its --dry-run renders a node vLLM accepts (no GPU needed),
and the judge of its `tier_events` check (tools/gpu/tier_events.py) fails when the
router's index or placement would not find prefix A in the node's CPU tier."""

from __future__ import annotations

import time
from pathlib import Path

import msgspec
import pytest
import zmq
from kvagent_server.router.kv.hashing import BlockHasher
from kvagent_server.router.kv.index import KVEventSource, KVIndex, Removed, Stored

from benchmarks.api import tier_events

ROOT = Path(__file__).resolve().parents[2]

BLOCK = 16
A_IDS = [1000 + i for i in range(200)]  # 12 full blocks
SOURCE = KVEventSource(endpoint="ipc:///unused", topic="kvagent")


def _keys(seed: str | None = None, ids: list[int] = A_IDS) -> list[int]:
    return BlockHasher("sha256", seed).keys(ids, BLOCK)


def _gpu(keys: list[int]) -> Stored:
    return Stored(hashes=tuple(keys), medium="GPU", block_size=BLOCK, group=0)


def _index(*batches: list) -> KVIndex:
    idx = KVIndex()
    for seq, events in enumerate(batches):
        idx.apply("prefill-0", seq, events)
    return idx


def _judge(idx: KVIndex) -> dict:
    return tier_events.judge(idx, "prefill-0", SOURCE, A_IDS, block_size=BLOCK)


def test_a_offloaded_to_cpu_and_gone_from_gpu_passes() -> None:
    a = _keys()
    idx = _index([_gpu(a)], [Stored(hashes=(k,), medium="CPU", block_size=BLOCK, group=0)
                             for k in a], [Removed(hashes=tuple(a), medium="GPU", group=0)])
    v = _judge(idx)
    assert v["ok"], v
    assert (v["a_blocks"], v["a_blocks_in_cpu"], v["a_blocks_on_gpu"]) == (12, 12, 0)
    assert v["chosen"] == "prefill-0" and v["reason"] == "tier_hit"
    # 200 tokens: 12 full blocks from the CPU tier, the partial last block recomputed.
    assert v["ranked"][0]["tokens"] == {"gpu": 0, "cpu": 12 * BLOCK, "disk": 0, "recompute": 8}
    assert tier_events.a_in_cpu(idx, "prefill-0", a)


def test_the_check_fails_when_the_index_would_not_find_a_in_cpu() -> None:
    a = _keys()
    # Never offloaded (still on GPU only): placement prefers the node, but (a) fails.
    v = _judge(_index([_gpu(a)]))
    assert not v["ok"] and not v["index_ok"] and v["placement_ok"]
    # Offloaded under another seed (the router hashes differently from the node).
    wrong = _keys("not-the-node-seed")
    v = _judge(_index([Stored(hashes=tuple(wrong), medium="CPU", block_size=BLOCK)]))
    assert not v["ok"] and v["a_blocks_in_cpu"] == 0
    assert v["chosen"] == "empty-node" and v["reason"] == "tier_miss"
    # Only half of A reached the CPU tier.
    v = _judge(_index([Stored(hashes=tuple(a[:6]), medium="CPU", block_size=BLOCK)]))
    assert not v["ok"] and v["placement_ok"] and v["reach_blocks"]["cpu"] == 6
    # A medium the index does not know is ignored, not guessed.
    v = _judge(_index([Stored(hashes=tuple(a), medium="HBM", block_size=BLOCK)]))
    assert not v["ok"] and v["chosen"] == "empty-node"
    assert not tier_events.a_in_cpu(_index([_gpu(a)]), "prefill-0", a)


def test_a_prompt_shorter_than_a_block_never_passes() -> None:
    v = tier_events.judge(KVIndex(), "prefill-0", SOURCE, A_IDS[:BLOCK - 1],
                          block_size=BLOCK)
    assert v["a_blocks"] == 0 and not v["ok"]


def test_event_source_is_the_bundles_router_setting() -> None:
    settings = {"engine": {"kv_events": {"http://127.0.0.1:18300": {
        "endpoint": "ipc:///tmp/x.ipc", "topic": "kvagent", "hash_algo": "sha256",
        "hash_seed": "7"}}}}
    src = tier_events.event_source(settings, "http://127.0.0.1:18300")
    assert (src.endpoint, src.hash_seed) == ("ipc:///tmp/x.ipc", "7")
    with pytest.raises(SystemExit, match="publishes no KV events"):
        tier_events.event_source({}, "http://127.0.0.1:18300")


def _payload(*events: dict) -> bytes:
    return msgspec.msgpack.encode([time.time(), list(events), None])


def test_listener_feeds_the_index_over_zmq_and_notices_a_restart(tmp_path: Path) -> None:
    """The threaded wrapper around the router's subscriber, over a real ipc socket."""
    endpoint = f"ipc://{tmp_path}/ev.ipc"
    a = _keys()
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.bind(endpoint)
    try:
        with tier_events.EventListener(
                "prefill-0", KVEventSource(endpoint=endpoint, topic="t")) as listener:
            time.sleep(0.5)  # slow joiner
            stored = {"type": "BlockStored", "block_hashes": a, "medium": "CPU",
                      "block_size": BLOCK, "group_idx": 0}
            pub.send_multipart((b"t", (0).to_bytes(8, "big"), _payload(stored)))
            assert listener.wait_for(lambda idx: tier_events.a_in_cpu(idx, "prefill-0", a),
                                     timeout=10)
            # A restarted node numbers from 0 again: the index forgets the old blocks.
            pub.send_multipart((b"t", (0).to_bytes(8, "big"), _payload()))
            assert listener.wait_for(
                lambda idx: tier_events.snapshot(idx, "prefill-0", a)["resets"] == 1, 10)
            snap = listener.read(lambda idx: tier_events.snapshot(idx, "prefill-0", a))
            assert snap["reach_blocks"]["cpu"] == 0
            pub.send_multipart((b"t", (1).to_bytes(8, "big"), b"not msgpack"))
            assert listener.wait_for(lambda idx: listener.bad_messages == 1, 10)
    finally:
        pub.close(linger=0)
        ctx.term()
