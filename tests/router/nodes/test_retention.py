"""Decode retention bounded by memory: the pure parts, and the guard against fake nodes."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from fakes import FakeCluster, Reply, decode_ids, default_reply, router_stack
from kvagent_server.router.nodes.client import NodeResponse, UpstreamError
from kvagent_server.router.nodes.registry import Node
from kvagent_server.router.nodes.retention import (
    NodeKV,
    PolicyEviction,
    ReleaseQueue,
    RetentionGuard,
    blocks_to_free,
    parse_node_kv,
    remote_request_id,
)
from kvagent_server.router.reuse.pauses import ToolPauses
from kvagent_server.router.reuse.retention_policy import (
    ExpectedReturn,
    ExpectedReturnParams,
    OldestFirst,
)
from kvagent_server.router.reuse.transfer import (
    RELEASE_KEY,
    REMOTE_BLOCK_IDS,
    REMOTE_REQUEST_ID,
    with_release,
)
from kvagent_server.router.store.handle import Handle, TurnEnd, handle_blocks
from kvagent_server.router.store.memory import MemoryStore
from router_client import LONG, MODEL, chat_body, no_wrong_kv, turn


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


def test_release_queue_retries_a_failed_send_then_gives_up() -> None:
    q = ReleaseQueue(max_tries=2)
    q.add("d0", ["a", "b", "c"])
    sent = q.drain("d0", limit=2)
    assert q.failed("d0", sent) == [] and q.drain("d0") == ["a", "b", "c"]  # in order
    assert q.failed("d0", ["a", "b"]) == ["a", "b"]  # a second failure: the TTL frees them
    q.sent("d0", ["c"])
    assert q.pending("d0") == 0
    q.add("d0", ["c"])  # a success forgot c's failed try: it gets its own tries again
    assert q.failed("d0", q.drain("d0")) == [] and q.pending("d0") == 1
    with pytest.raises(ValueError):
        ReleaseQueue(max_tries=0)


class _FlakyNode:
    """A decode node's HTTP client whose first release request fails (busy past the
    timeout); it records every release it accepts."""

    def __init__(self) -> None:
        self.calls = 0
        self.released: list[list[str]] = []

    async def post(self, url: str, body: dict[str, Any], *, stream: bool,
                   headers: dict[str, str] | None = None,
                   timeout_s: float | None = None) -> NodeResponse:
        self.calls += 1
        if self.calls == 1:
            raise UpstreamError("timed out")
        self.released.append(list(body["kv_transfer_params"][RELEASE_KEY]))
        return NodeResponse(None, b"", 200)


async def test_a_release_the_node_did_not_take_is_sent_again_next_round() -> None:
    node = _FlakyNode()

    async def evict(name: str, blocks: int, max_handles: int) -> list[Any]:
        return []

    outcomes: list[tuple[bool, int]] = []
    guard = RetentionGuard(lambda name: node, nodes=list, evict=evict,
                           model=lambda: "m", high=0.9, low=0.5, interval_s=60,
                           on_released=lambda ok, n: outcomes.append((ok, n)))
    guard.queue.add("d0", ["r1", "r2"])
    assert await guard.flush("d0", "http://d0") is False
    assert guard.queue.pending("d0") == 2 and node.released == []
    assert await guard.flush("d0", "http://d0") is True
    assert node.released == [["r1", "r2"]] and guard.queue.pending("d0") == 0
    assert outcomes == [(False, 2), (True, 2)]


class _SlowNode:
    """A decode node's HTTP client whose releases wait for `answer`; /metrics answers."""

    def __init__(self) -> None:
        self.answer = asyncio.Event()

    async def post(self, url: str, body: dict[str, Any], *, stream: bool,
                   headers: dict[str, str] | None = None,
                   timeout_s: float | None = None) -> NodeResponse:
        await self.answer.wait()
        return NodeResponse(None, b"", 200)

    async def get(self, url: str, *, timeout_s: float | None = None) -> NodeResponse:
        return NodeResponse(None, b'vllm:kv_cache_usage_perc{model_name="m"} 0.5\n', 200)


async def test_room_is_on_its_way_from_an_eviction_until_a_read_after_its_release() -> None:
    """What the decode gate waits for instead of evicting by a figure that still holds
    blocks the store has given up (nodes/admission.py)."""
    node = _SlowNode()

    async def evict(name: str, blocks: int, max_handles: int) -> list[Handle]:
        return [_handle({REMOTE_REQUEST_ID: "cmpl-1", REMOTE_BLOCK_IDS: [4, 5]})]

    async def evict_nothing(name: str, blocks: int, max_handles: int) -> list[Handle]:
        return []

    guard = RetentionGuard(lambda name: node, nodes=list, evict=evict, model=lambda: "m",
                           high=0.9, low=0.5, interval_s=60)
    assert not guard.room_on_its_way("d0")
    evicting = asyncio.create_task(guard.make_room(Node("d0", "http://d0", "decode", epoch="e"), 2))
    await asyncio.sleep(0.02)
    assert guard.room_on_its_way("d0") and not guard.room_on_its_way("d1")  # being sent
    node.answer.set()
    assert await evicting == 2
    assert guard.room_on_its_way("d0")  # answered; no read since
    assert await guard.read_kv("d0", "http://d0") is not None
    assert not guard.room_on_its_way("d0")
    guard.evict_for_turn = evict_nothing  # nothing given up: nothing on its way
    assert await guard.make_room(Node("d0", "http://d0", "decode", epoch="e"), 2) == 0
    assert not guard.room_on_its_way("d0")


async def _wait_for(cond, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.05)


async def test_decode_over_the_watermark_evicts_and_releases_the_oldest() -> None:
    cluster = FakeCluster(kv_blocks=200)
    async with router_stack(cluster=cluster, policy={"params": {"skip_prefill_max_tokens": 0}},
                            retention={"high_watermark": 0.5, "low_watermark": 0.25,
                                       "check_interval_s": 0.05}) as st:
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
    for high in (0.9, None):
        cluster = FakeCluster(kv_blocks=200)
        async with router_stack(cluster=cluster, policy={"params": {"skip_prefill_max_tokens": 0}},
                                retention={"high_watermark": high,
                                           "check_interval_s": 0.05}) as st:
            for i in range(5):
                await turn(st, [{"role": "user", "content": f"c{i}: {LONG}"}],
                           session=f"s{i}")
            await asyncio.sleep(0.3)
            assert not cluster.events_of("release"), high


async def test_blocks_no_handle_records_are_released() -> None:
    """A turn nobody can name again (no session, content lookup off) gets no cache token,
    yet D retained its blocks: the router has them freed instead of pinned until the TTL."""
    async with router_stack(content_reuse=False, retention={"check_interval_s": 0.05}) as st:
        await turn(st, [{"role": "user", "content": LONG}], session=None)
        await _wait_for(lambda: st.cluster.events_of("release"))
        assert st.decode[0].kv_usage() == 0
        kva, _, _ = await turn(st, [{"role": "user", "content": "other " + LONG}])
        await asyncio.sleep(0.3)  # a recorded handle is kept for the next turn
        assert len(st.cluster.events_of("release")) == 1 and kva["cache_token"]
        no_wrong_kv(st)


def _tool_or_answer(prompt_ids: list[int]) -> Reply:
    """Conversations whose prompt asks for a tool end on a call to `build`, the others on
    a final answer."""
    if "use a tool" in decode_ids(prompt_ids):
        return Reply(tool_calls=[{"id": "call_1", "type": "function",
                                  "function": {"name": "build", "arguments": "{}"}}])
    return default_reply(prompt_ids)


@pytest.mark.parametrize("policy", ["expected_return", "oldest_first"])
async def test_under_pressure_final_answers_go_before_a_session_waiting_on_a_tool(
        policy: str) -> None:
    """The oldest conversation on D ended on a tool call: it will be back. Over the
    watermark, `expected_return` drops the newer conversations that ended on a final
    answer and the tool session's next turn reuses its KV; `oldest_first` drops it."""
    cluster = FakeCluster(kv_blocks=200, reply=_tool_or_answer)
    async with router_stack(cluster=cluster, policy={"params": {"skip_prefill_max_tokens": 0}},
                            retention={"high_watermark": 0.5, "low_watermark": 0.25,
                                       "check_interval_s": 0.05, "policy": {"name": policy}}) as st:
        d = st.decode[0]
        tool_msgs = [{"role": "user", "content": f"please use a tool: {LONG}"}]
        tool_kva, _, evs = await turn(st, tool_msgs, session="tool")
        assert any((e["choices"][0].get("delta") or {}).get("tool_calls")
                   for e in evs if isinstance(e, dict) and e.get("choices"))
        store = st.app.state.parts.store
        (held,) = await store.retained("d0", 10)
        assert held.end is not None and (held.end.kind, held.end.tools) == (
            "tool_call", ("build",))
        tool_rid = next(r.request_id for r in cluster.retained.values()
                        if r.engine_id == d.engine_id)
        for i in range(4):  # ~30 blocks each: over 50% of 200 blocks
            await turn(st, [{"role": "user", "content": f"conversation {i}: {LONG}"}],
                       session=f"s{i}")
        await _wait_for(lambda: cluster.events_of("release"))
        await _wait_for(lambda: d.kv_usage() < 0.5)
        released = [e.detail["id"] for e in cluster.events_of("release")]
        ends = {h.session: h.end.kind for h in await store.retained("d0", 10) if h.end}
        call = {"id": "call_1", "type": "function",
                "function": {"name": "build", "arguments": "{}"}}
        nxt = [*tool_msgs, {"role": "assistant", "content": None, "tool_calls": [call]},
               {"role": "tool", "tool_call_id": "call_1", "content": "built"}]
        kva, _, _ = await turn(st, nxt, session="tool", token=tool_kva["cache_token"])
        if policy == "expected_return":
            assert tool_rid not in released and ends.get("tool") == "tool_call"
            assert set(ends.values()) <= {"tool_call", "final"} and len(released) >= 2
            assert kva["path"] == "pd_reuse" and kva["reused_tokens"] > 0
        else:
            assert released[0] == tool_rid and "tool" not in ends
            assert kva["path"] == "recompute" and kva["reused_tokens"] == 0
        no_wrong_kv(st)
        # The session came back from `build`: its pause is learned.
        learned = st.app.state.router.learned.pauses.view()
        assert [tool for _tenant, tool in learned] == ["build"]
        assert next(iter(learned.values())).samples == 1


async def test_the_turn_end_is_recorded_from_every_front_door() -> None:
    """Chat, Messages and Responses all run as chat on the nodes: the relay captures how
    each answer ended, and the handle records it."""
    cluster = FakeCluster(reply=_tool_or_answer)
    tools = [{"type": "function", "function": {"name": "build", "parameters": {
        "type": "object", "properties": {}}}}]
    async with router_stack(cluster=cluster,
                            policy={"params": {"skip_prefill_max_tokens": 0}}) as st:
        store = st.app.state.parts.store
        r = await st.client.post("/v1/chat/completions", headers={"X-Session-ID": "chat"},
                                 json=chat_body([{"role": "user", "content": "use a tool"}],
                                                stream=False, tools=tools))
        assert r.status_code == 200, r.text
        r = await st.client.post("/v1/messages", headers={"X-Session-ID": "msgs"}, json={
            "model": MODEL, "max_tokens": 64, "messages": [
                {"role": "user", "content": "use a tool " + LONG}],
            "tools": [{"name": "build", "input_schema": {"type": "object"}}]})
        assert r.status_code == 200, r.text
        assert r.json()["stop_reason"] == "tool_use"
        r = await st.client.post("/v1/responses", headers={"X-Session-ID": "resp"}, json={
            "model": MODEL, "input": "just answer " + LONG, "stream": True})
        assert r.status_code == 200, r.text
        got = {h.session.rsplit("/", 1)[-1]: h.end for h in await store.retained("d0", 10)}
        assert {k: (e.kind, e.tools) for k, e in got.items() if e is not None} == {
            "chat": ("tool_call", ("build",)), "msgs": ("tool_call", ("build",)),
            "resp": ("final", ())}


def _held(hid: str, end: TurnEnd | None, at: float, blocks: int = 4) -> Handle:
    return Handle(handle_id=hid, tenant="t", session=f"s-{hid}", decode_node="d0",
                  decode_epoch="e", kv_transfer_params={
                      REMOTE_REQUEST_ID: f"r-{hid}", REMOTE_BLOCK_IDS: [list(range(blocks))]},
                  token_ids=[1, 2, 3], block_size=16, created_at=at, expires_at=at + 480,
                  end=end)


async def test_policy_eviction_claims_what_the_policy_ranks_first() -> None:
    now = time.time()
    store = MemoryStore()
    soon = TurnEnd(kind="tool_call", tools=("quick",), at=now - 25)  # prior 30 s: back in 5
    await store.put(_held("soon", soon, now - 25))
    await store.put(_held("final", TurnEnd(kind="final", at=now - 1), now - 1))
    await store.put(_held("later", TurnEnd(kind="tool_call", tools=("x",), at=now), now))
    evict = PolicyEviction(store, ExpectedReturn(ExpectedReturnParams(keep_soon_s=10)),
                           ToolPauses())
    # The watermark keeps the session expected back soon, whatever it needs.
    assert [h.handle_id for h in await evict("d0", 100, 10)] == ["final", "later"]
    # A turn waiting for room takes it, last.
    assert [h.handle_id for h in await evict.for_turn("d0", 1, 10)] == ["soon"]
    assert await store.retained("d0", 10) == []


async def test_policy_eviction_passes_again_when_a_turn_claimed_its_choice() -> None:
    now = time.time()
    store = MemoryStore()
    for i in range(4):
        await store.put(_held(f"h{i}", TurnEnd(kind="final", at=now - 10 + i), now - 10 + i))
    real_evict = store.evict_handles

    raced: list[str] = []

    async def racing(node: str, keys: list[tuple[str, str]]) -> list[Handle]:
        if not raced:  # a turn claims the first choice between the read and the eviction
            raced.append(keys[0][1])
            await store.claim(*keys[0])
        return await real_evict(node, keys)

    store.evict_handles = racing  # type: ignore[method-assign]
    evict = PolicyEviction(store, OldestFirst(), ToolPauses())
    got = await evict("d0", 8, 10)  # two handles' blocks: h0 went to a turn, so h2 goes
    assert raced == ["h0"] and [h.handle_id for h in got] == ["h1", "h2"]
    assert sum(map(handle_blocks, got)) == 8
