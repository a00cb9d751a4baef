"""Spilled, not gone, through the router on fake nodes: a handle the watermark gives up on
a decode node with KV tiers leaves its conversation recorded as spilled; on a node
without tiers it is forgotten as before."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from fakes import FakeCluster, router_stack
from router_client import LONG, no_wrong_kv, turn

WATERMARK = {"high_watermark": 0.5, "low_watermark": 0.25, "check_interval_s": 0.05}


async def _wait_for(cond: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.05)


async def _fill(st: Any) -> dict[int, tuple[list[dict[str, str]], dict[str, Any], str]]:
    convs = {}
    for i in range(5):  # ~30 blocks each of 200: the watermark gives the first ones up
        msgs = [{"role": "user", "content": f"conversation {i}: {LONG}"}]
        kva, answer, _ = await turn(st, msgs, session=f"s{i}")
        convs[i] = (msgs, kva, answer)
    await _wait_for(lambda: st.cluster.events_of("release"))
    return convs


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


async def test_a_spilled_conversation_goes_back_to_the_node_whose_host_tier_holds_it() -> None:
    async with router_stack(cluster=FakeCluster(kv_blocks=200),
                            policy={"params": {"fresh_on_decode": "never"}},
                            retention=WATERMARK,
                            node_tiers={"d0": {"host": True, "chunk_tokens": 16}}) as st:
        convs = await _fill(st)
        # D below its watermark again (at it, the cost model sends D no prompt to compute)
        node = st.app.state.router.registry.get("d0")
        await _wait_for(lambda: node.kv_usage is not None and node.kv_usage < 0.5)
        msgs, kva, answer = convs[0]
        nxt = [*msgs, {"role": "assistant", "content": answer},
               {"role": "user", "content": "and then?"}]
        # the handle is gone (the token names a given-up handle); its spill is not
        kva0, _, _ = await turn(st, nxt, session="s0", token=kva["cache_token"])
        assert kva0["path"] == "d_direct" and kva0["reason"] == "hit:tier_host", kva0
        # its D leg carried no transfer to pull: D's own tiers serve the prefix
        leg = st.decode[0].requests[-1]
        assert leg["kv_transfer_params"]["do_remote_prefill"] is False
        no_wrong_kv(st)
        metrics = (await st.client.get("/metrics")).text
        assert 'kvagent_router_tier_reuse_total{source="tier_host"} 1.0' in metrics
        # the turn left a handle again: its next turn reuses it as before
        nxt2 = [*nxt, {"role": "assistant", "content": "x"}, {"role": "user", "content": "?"}]
        kva1, _, _ = await turn(st, nxt2, session="s0", token=kva0["cache_token"])
        assert kva1["reason"] in ("hit", "prefix_partial"), kva1
