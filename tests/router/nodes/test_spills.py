"""Spilled, not gone, through the router on fake nodes: a handle the watermark gives up on
a decode node with KV tiers leaves its conversation recorded as spilled; on a node
without tiers it is forgotten as before."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from fakes import FakeCluster, router_stack
from router_client import LONG, turn

WATERMARK = {"high_watermark": 0.5, "low_watermark": 0.25, "check_interval_s": 0.05}


async def _wait_for(cond: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.05)


async def _fill(st: Any) -> None:
    for i in range(5):  # ~30 blocks each of 200: the watermark gives the first ones up
        await turn(st, [{"role": "user", "content": f"conversation {i}: {LONG}"}],
                   session=f"s{i}")
    await _wait_for(lambda: st.cluster.events_of("release"))


async def test_the_watermark_spills_to_a_tiered_decode_node() -> None:
    async with router_stack(cluster=FakeCluster(kv_blocks=200),
                            policy={"params": {"skip_prefill_max_tokens": 0}},
                            retention=WATERMARK,
                            node_tiers={"d0": {"host": True, "chunk_tokens": 16}}) as st:
        await _fill(st)
        router = st.app.state.router
        assert router.spills is not None
        found = await router.spills.find("default", "s0")
        assert found is not None
        spill, handle = found
        assert spill.node == "d0" and spill.host and spill.stored_tokens > 0
        assert handle.prompt_tokens is not None and spill.stored_tokens <= handle.prompt_tokens
        assert await router.spills.find("default", "s4") is None  # still retained
        metrics = (await st.client.get("/metrics")).text
        assert "kvagent_router_spills_total" in metrics


async def test_without_tiers_nothing_is_spilled() -> None:
    async with router_stack(cluster=FakeCluster(kv_blocks=200),
                            policy={"params": {"skip_prefill_max_tokens": 0}},
                            retention=WATERMARK) as st:
        await _fill(st)
        assert st.app.state.router.spills is None
    async with router_stack(cluster=FakeCluster(kv_blocks=200),
                            policy={"params": {"skip_prefill_max_tokens": 0}},
                            retention={**WATERMARK, "spill_ttl_s": 0},
                            node_tiers={"d0": {"host": True}}) as st:
        assert st.app.state.router.spills is None
