"""Tier-aware P placement through the router: fake nodes, real ZMQ events, real HTTP.

The fake P nodes' KV events are published the way vLLM's `ZmqEventPublisher` does
(topic, 8-byte sequence number, msgpack batch) on ipc sockets; the router subscribes
with its own `KVEventSubscriber` (the wiring `create_app` does from `settings.engine.kv_events`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq
from fakes import Stack, render_prompt, router_stack
from kvagent_server.router.kv.hashing import BlockHasher
from kvagent_server.router.kv.index import KVEventSource
from kvagent_server.router.nodes import tier_placement
from kvagent_server.router.settings import RouterSettings

TEXT = "Summarise the quarterly report for the board, section by section. " * 4
BLOCK = 16  # the fake cluster's block size


class Publisher:
    """One node's side of the KV event channel."""

    def __init__(self, ctx: zmq.Context, endpoint: str) -> None:
        self.sock = ctx.socket(zmq.PUB)
        self.sock.bind(endpoint)
        self.seq = 0

    def send(self, events: list[dict[str, Any]], *, seq: int | None = None) -> None:
        self.seq = self.seq if seq is None else seq
        payload = msgspec.msgpack.encode([1.0, events, 0])
        self.sock.send_multipart([b"kvagent", self.seq.to_bytes(8, "big"), payload])
        self.seq += 1


def stored(keys: list[int], medium: str) -> dict[str, Any]:
    return {"type": "BlockStored", "block_hashes": keys, "parent_block_hash": None,
            "token_ids": [], "block_size": BLOCK, "lora_id": None, "medium": medium,
            "lora_name": None, "group_idx": 0}


@contextlib.asynccontextmanager
async def tiered(stack: Stack, tmp_path: Path) -> AsyncIterator[dict[str, Publisher]]:
    r = stack.router
    prefill = [n for n in r.registry.nodes.values() if n.role == "prefill"]
    endpoints = {n.name: f"ipc://{tmp_path}/{n.name}.ipc" for n in prefill}
    settings = RouterSettings(engine={"kv_events": {
        n.url: KVEventSource(endpoint=endpoints[n.name], topic="kvagent") for n in prefill}})
    ctx = zmq.Context()
    pubs = {name: Publisher(ctx, ep) for name, ep in endpoints.items()}
    r.tiers, sub = tier_placement.from_settings(settings, r.registry)
    assert sub is not None
    sub.start()
    try:
        yield pubs
    finally:
        await sub.stop()
        r.tiers = None
        for pub in pubs.values():
            pub.sock.close(linger=0)
        ctx.term()


async def publish_until_indexed(stack: Stack, pub: Publisher, name: str,
                                events: list[dict[str, Any]], keys: list[int]) -> None:
    """PUB drops what it sends before the SUB joins: resend until the index has it."""
    index = stack.router.tiers.index
    for _ in range(100):
        pub.send(events)
        await asyncio.sleep(0.05)
        if any(set(keys) <= set(t) for t in index.node(name).tiers.values()):
            return
    raise AssertionError("the router never indexed the published blocks")


async def complete(stack: Stack, prompt: str, session: str) -> None:
    resp = await stack.client.post("/v1/completions", headers={"X-Session-ID": session},
                                   json={"model": "fake-model", "prompt": prompt,
                                         "max_tokens": 4})
    assert resp.status_code == 200, resp.text


def placements(stack: Stack, reason: str) -> float:
    return stack.router.metrics.registry.get_sample_value(
        "kvagent_router_prefill_placements_total", {"reason": reason}) or 0.0


def served(node: Any) -> int:
    return sum(1 for b in node.requests if b.get("prompt") == TEXT)


async def test_fresh_prompt_goes_to_the_p_node_holding_its_prefix(tmp_path: Path) -> None:
    async with router_stack(n_prefill=2, n_decode=1) as stack, tiered(stack, tmp_path) as pubs:
        p0, p1 = stack.prefill
        await complete(stack, TEXT, "a")  # nothing indexed: by load, no /tokenize call
        assert (served(p0), served(p1)) == (1, 0)
        assert placements(stack, "least_loaded") == 1 and not p0.tokenize_requests
        salt = next(b for b in p0.requests if b.get("prompt") == TEXT)["cache_salt"]
        keys = BlockHasher().keys(render_prompt(TEXT), BLOCK, cache_salt=salt)
        assert len(keys) >= 10
        # p1 holds the prefix only in its CPU tier (offloaded from its GPU cache).
        await publish_until_indexed(stack, pubs["p1"], "p1", [stored(keys, "CPU")], keys)

        await complete(stack, TEXT, "b")  # a new session: no handle, fresh P leg
        assert (served(p0), served(p1)) == (1, 1)
        assert placements(stack, "tier_hit") == 1
        assert len(p0.tokenize_requests) == 1  # tokenized once, on the least loaded node

        other = "A different conversation entirely, nothing shared. " * 4
        await complete(stack, other, "c")
        assert placements(stack, "tier_miss") == 1

        # p1 restarts: its publisher counts from 0 again, the router forgets its blocks.
        pubs["p1"].send([stored([12345], "GPU")], seq=0)
        for _ in range(100):
            if stack.router.tiers.index.nodes["p1"].resets:
                break
            await asyncio.sleep(0.05)
        assert not set(keys) & set(stack.router.tiers.index.nodes["p1"].tiers["cpu"])
        await complete(stack, TEXT, "d")
        assert (served(p0), served(p1)) == (2, 1)
        assert placements(stack, "tier_miss") == 2


async def test_one_prefill_node_never_tokenizes_for_placement(tmp_path: Path) -> None:
    async with router_stack(n_prefill=1, n_decode=1) as stack, tiered(stack, tmp_path) as pubs:
        keys = BlockHasher().keys(render_prompt(TEXT), BLOCK)
        await publish_until_indexed(stack, pubs["p0"], "p0", [stored(keys, "GPU")], keys)
        await complete(stack, TEXT, "a")
        assert stack.prefill[0].tokenize_requests == []
        assert placements(stack, "least_loaded") == 1


def test_unreproducible_sources_get_no_subscription() -> None:
    from kvagent_server.router.nodes.registry import NodeRegistry

    reg = NodeRegistry(["http://p:1"], ["http://d:1"])
    bad = RouterSettings(engine={"kv_events": {"http://p:1": KVEventSource(endpoint="ipc:///x",
                                                                hash_algo="xxhash")}})
    tiers, sub = tier_placement.from_settings(bad, reg)
    assert tiers is not None and tiers.hashers == {} and sub is None
    assert tier_placement.from_settings(RouterSettings(), reg) == (None, None)
    unknown = RouterSettings(engine={"kv_events": {
        "http://elsewhere:1": KVEventSource(endpoint="ipc:///x")}})
    assert tier_placement.from_settings(unknown, reg) == (None, None)


@pytest.mark.parametrize("field", ["kv_events"])
def test_settings_round_trip(field: str) -> None:
    s = RouterSettings.model_validate(
        {"engine": {field: {"http://p:1": {"endpoint": "tcp://p:5800"}}}})
    assert s.engine.kv_events["http://p:1"].hash_algo == "sha256"
