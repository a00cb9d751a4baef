"""The router's block hashes equal a real vLLM node's, as its KV events publish them.

The shared bundle's prefill node publishes KV events where the bundle told the router to
listen (its router settings: endpoint, topic, hash algorithm and seed); a second
subscriber of the router's own kind (`KVEventSubscriber`) feeds a `KVIndex`, and the
router's `BlockHasher` hashes the prompt's token ids (from the node's `/tokenize`). Equal
hashes are what makes tier-aware placement find a node's cached prefix at all.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest
from kvagent_server.bundle.render import ROUTER_SETTINGS_FILE
from support import KVAgentBundle

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

#: Long enough for several of the bundle's blocks (128 tokens).
TEXT = ("Tier-aware placement sends a prompt where its prefix is cached. " * 72).strip()


async def _stored_keys(index, name: str) -> set[int]:
    return set(index.nodes[name].tiers["gpu"]) if name in index.nodes else set()


async def _wait_for(index, name: str, keys: list[int], timeout: float = 60.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while loop.time() < deadline:
        if set(keys) <= await _stored_keys(index, name):
            return
        await asyncio.sleep(0.1)


async def test_router_hashes_equal_the_node_published_hashes(bundle: KVAgentBundle) -> None:
    from kvagent_server.router.kv.events import KVEventSubscriber
    from kvagent_server.router.kv.hashing import BlockHasher
    from kvagent_server.router.kv.index import KVEventSource, KVIndex

    assert bundle.run_dir is not None
    settings = json.loads(Path(bundle.run_dir, ROUTER_SETTINGS_FILE).read_text())
    node_url = bundle.prefill_urls[0]
    source = settings["engine"]["kv_events"][node_url]
    block = settings["nodes"]["block_size"]
    index = KVIndex()
    sub = KVEventSubscriber(index, {"p0": KVEventSource(endpoint=source["endpoint"],
                                                        topic=source["topic"])})
    sub.start()
    try:
        async with httpx.AsyncClient(base_url=node_url, timeout=120) as client:
            resp = await client.post("/tokenize", json={"model": bundle.model, "prompt": TEXT})
            ids = resp.json()["tokens"]
            assert len(ids) > 4 * block
            hasher = BlockHasher(source["hash_algo"], source["hash_seed"])
            await asyncio.sleep(1.0)  # let the SUB socket join before the first event

            async def complete(salt: str | None) -> list[int]:
                body = {"model": bundle.model, "prompt": TEXT, "max_tokens": 1,
                        "temperature": 0}
                if salt is not None:
                    body["cache_salt"] = salt
                r = await client.post("/v1/completions", json=body)
                assert r.status_code == 200, r.text
                keys = hasher.keys(ids, block, cache_salt=salt)
                assert len(keys) == len(ids) // block
                await _wait_for(index, "p0", keys)
                return keys

            salted = await complete("tenant-a")
            published = await _stored_keys(index, "p0")
            assert set(salted) <= published, "router hashes differ from the node's"
            assert index.prefix_blocks("p0", salted)["gpu"] == len(salted)
            # The salt is part of the hash: another tenant's prompt is not a hit...
            other = hasher.keys(ids, block, cache_salt="tenant-b")
            assert not set(other) & published
            assert index.prefix_blocks("p0", other)["gpu"] == 0
            # ...until that tenant sends it, and the node publishes its own blocks.
            assert set(await complete("tenant-b")) <= await _stored_keys(index, "p0")
            unsalted = await complete(None)
            assert set(unsalted) <= await _stored_keys(index, "p0")
            # A wrong seed never matches: the equality above is not a coincidence.
            wrong = BlockHasher(source["hash_algo"], "not-the-seed").keys(ids, block)
            assert not set(wrong) & await _stored_keys(index, "p0")
            assert index.block_size("p0") == block
            assert sub.bad_messages == 0
    finally:
        await sub.stop()
