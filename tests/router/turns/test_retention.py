"""Decode retention bounded by memory: the pure parts, and the guard against fake nodes."""

from __future__ import annotations

import asyncio
import time

import pytest
from fakes import FakeCluster, router_stack
from kvagent_server.router.reuse.transfer import (
    RELEASE_KEY,
    REMOTE_BLOCK_IDS,
    REMOTE_REQUEST_ID,
    with_release,
)
from kvagent_server.router.store.handle import Handle, handle_blocks
from kvagent_server.router.turns.retention import (
    NodeKV,
    ReleaseQueue,
    blocks_to_free,
    parse_node_kv,
    remote_request_id,
)
from router_client import LONG, no_wrong_kv, turn


def _handle(params: dict) -> Handle:
    now = time.time()
    return Handle(handle_id="h1", tenant="t", session="s", decode_node="d0", decode_epoch="e",
                  kv_transfer_params=params, token_ids=[1, 2, 3], block_size=16,
                  created_at=now, expires_at=now + 60)


def test_blocks_to_free_only_above_the_high_watermark() -> None:
    assert blocks_to_free(NodeKV(0.79, 1000), high=0.8, low=0.6) == 0
    assert blocks_to_free(NodeKV(0.8, 1000), high=0.8, low=0.6) == 200
    assert blocks_to_free(NodeKV(1.0, 1000), high=0.8, low=0.6) == 400
    assert blocks_to_free(NodeKV(0.9, None), high=0.8, low=0.6) == -1  # count unknown
    for high, low in ((0.5, 0.5), (0.5, 0.7), (1.2, 0.5), (0.5, 0.0)):
        with pytest.raises(ValueError):
            blocks_to_free(NodeKV(0.9, 10), high=high, low=low)


def test_parse_node_kv_reads_vllm_metrics() -> None:
    text = ("# HELP vllm:kv_cache_usage_perc KV-cache usage.\n"
            'vllm:cache_config_info{block_size="128",cache_dtype="auto",'
            'num_gpu_blocks="2048",num_cpu_blocks="None"} 1.0\n'
            'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.4375\n')
    assert parse_node_kv(text) == NodeKV(usage=0.4375, total_blocks=2048)
    assert parse_node_kv('vllm:kv_cache_usage_perc{model_name="m"} 0.5\n') == NodeKV(0.5, None)
    assert parse_node_kv("process_start_time_seconds 1\n") is None
    assert parse_node_kv("vllm:kv_cache_usage_perc nan-ish\n") is None
    # Nothing running while requests wait: no blocks for any of them (the decode gate's cue).
    queue = ('vllm:num_requests_running{engine="0",model_name="m"} 0.0\n'
             'vllm:num_requests_waiting{engine="0",model_name="m"} 2.0\n'
             'vllm:num_requests_waiting_by_reason{engine="0",reason="capacity"} 2.0\n')
    kv = parse_node_kv(text + queue)
    assert kv is not None and (kv.running, kv.waiting, kv.stalled) == (0, 2, True)
    kv = parse_node_kv(text + queue.replace("} 0.0", "} 1.0", 1))
    assert kv is not None and not kv.stalled
    kv = parse_node_kv(text)
    assert kv is not None and not kv.stalled  # not reported: not stalled


def test_handle_helpers() -> None:
    h = _handle({REMOTE_REQUEST_ID: "cmpl-1", REMOTE_BLOCK_IDS: [[4, 5, 6], [7, 8, 9]]})
    assert remote_request_id(h) == "cmpl-1" and handle_blocks(h) == 3
    flat = _handle({REMOTE_REQUEST_ID: "", REMOTE_BLOCK_IDS: [4, 5]})
    assert remote_request_id(flat) is None and handle_blocks(flat) == 2
    assert handle_blocks(_handle({})) == 0


def test_with_release_copies_and_bounds() -> None:
    params = {"do_remote_prefill": False}
    assert with_release(params, []) is params
    out = with_release(params, ["a", "", "b"])
    assert out == {"do_remote_prefill": False, RELEASE_KEY: ["a", "b"]} and params == {
        "do_remote_prefill": False}
    assert len(with_release({}, [f"r{i}" for i in range(1000)])[RELEASE_KEY]) == 256


def test_release_queue_per_node_and_bounded() -> None:
    q = ReleaseQueue(max_per_node=3)
    q.add("d0", ["a", "b", "", "c", "d"])  # "a" falls off: the TTL frees it
    q.add("d1", ["x"])
    assert q.pending("d0") == 3 and sorted(q.nodes()) == ["d0", "d1"]
    assert q.drain("d0", limit=2) == ["b", "c"] and q.drain("d0") == ["d"]
    assert q.drain("d0") == [] and q.nodes() == ["d1"]


async def _wait_for(cond, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.05)


async def test_decode_over_the_watermark_evicts_and_releases_the_oldest() -> None:
    cluster = FakeCluster(kv_blocks=200)
    async with router_stack(cluster=cluster, skip_prefill_max_tokens=0,
                            retention_high_watermark=0.5, retention_low_watermark=0.25,
                            retention_check_interval_s=0.05) as st:
        d = st.decode[0]
        convs = {}
        for i in range(5):  # ~30 blocks each: the fourth or fifth crosses 50%
            msgs = [{"role": "user", "content": f"conversation {i}: {LONG}"}]
            kva, answer, _ = await turn(st, msgs, session=f"s{i}")
            convs[i] = (msgs, kva, answer)
        await _wait_for(lambda: cluster.events_of("release"))
        # Below the high watermark again (down to the low one when the round saw all
        # five; a round that ran after the fourth leaves the fifth on top of the low one).
        await _wait_for(lambda: d.kv_usage() < 0.5)
        # Each round also tells the router how full D is (what `policy` weighs).
        node = st.app.state.router.registry.get("d0")
        await _wait_for(lambda: node.kv_usage is not None and node.kv_usage < 0.5)
        released = [e.detail["id"] for e in cluster.events_of("release")]
        # Oldest first: conversation 0's retained turn went, the newest stayed.
        order = [r.request_id for r in cluster.retained.values() if r.engine_id == d.engine_id]
        assert released == order[:len(released)] and len(released) < 5
        # The release was one small request that D did not retain itself.
        release_req = next(b for b in d.requests if RELEASE_KEY in (
            b.get("kv_transfer_params") or {}))
        assert release_req["kv_transfer_params"] == {RELEASE_KEY: released}
        assert release_req["max_tokens"] == 1
        # An evicted conversation recomputes (same answer), the newest still reuses.
        msgs, kva, answer = convs[0]
        nxt = [*msgs, {"role": "assistant", "content": answer},
               {"role": "user", "content": "and then?"}]
        kva0, _, _ = await turn(st, nxt, session="s0", token=kva["cache_token"])
        assert kva0["path"] == "recompute" and kva0["reused_tokens"] == 0
        msgs, kva, answer = convs[4]
        nxt = [*msgs, {"role": "assistant", "content": answer},
               {"role": "user", "content": "and then?"}]
        kva4, _, _ = await turn(st, nxt, session="s4", token=kva["cache_token"])
        assert kva4["path"] == "pd_reuse" and kva4["reused_tokens"] > 0
        no_wrong_kv(st)
        metrics = (await st.client.get("/metrics")).text
        assert "kvagent_router_retention_evictions_total" in metrics
        assert 'kvagent_router_retention_releases_total{ok="true"}' in metrics


async def test_no_eviction_below_the_watermark_or_when_disabled() -> None:
    for kw in ({"retention_high_watermark": 0.9}, {"retention_high_watermark": None}):
        cluster = FakeCluster(kv_blocks=200)
        async with router_stack(cluster=cluster, skip_prefill_max_tokens=0,
                                retention_check_interval_s=0.05, **kw) as st:
            for i in range(5):
                await turn(st, [{"role": "user", "content": f"c{i}: {LONG}"}],
                           session=f"s{i}")
            await asyncio.sleep(0.3)
            assert not cluster.events_of("release"), kw


async def test_blocks_no_handle_records_are_released() -> None:
    """A turn nobody can name again (no session, content lookup off) gets no cache token,
    yet D retained its blocks: the router has them freed instead of pinned until the TTL."""
    async with router_stack(retention_check_interval_s=0.05, content_reuse=False) as st:
        await turn(st, [{"role": "user", "content": LONG}], session=None)
        await _wait_for(lambda: st.cluster.events_of("release"))
        assert st.decode[0].kv_usage() == 0
        kva, _, _ = await turn(st, [{"role": "user", "content": "other " + LONG}])
        await asyncio.sleep(0.3)  # a recorded handle is kept for the next turn
        assert len(st.cluster.events_of("release")) == 1 and kva["cache_token"]
        no_wrong_kv(st)
