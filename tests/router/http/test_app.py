"""The router against fake P/D nodes: the turn flow, reuse, tokens and degradation.

Every test runs real HTTP (uvicorn on 127.0.0.1) between client, router and fake nodes,
and every response byte the client receives is scanned for internal fields.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from typing import Any

import httpx
import pytest
from fakes import FakeCluster, Reply, router_stack
from router_client import (
    FIRST,
    LONG,
    MODEL,
    assert_clean,
    chat_body,
    events,
    no_wrong_kv,
    second,
    turn,
    wait_ready,
)

# --------------------------------------------------------------------------- the flow


async def test_fresh_then_reuse_pd() -> None:
    async with router_stack(policy={"params": {"skip_prefill_max_tokens": 0}}) as st:
        kva, answer, evs = await turn(st, FIRST)
        assert kva["path"] == "pd_fresh" and kva["reused_tokens"] == 0
        assert kva["cache_token"].startswith("kva1.") and 0 < kva["expires_in"] <= 480
        p, d = st.prefill[0], st.decode[0]
        p_body, d_body = p.requests[-1], d.requests[-1]
        assert p_body["max_tokens"] == 1 and p_body["stream"] is False
        assert p_body["kv_transfer_params"] == {"do_remote_decode": True,
                                                "do_remote_prefill": False}
        assert "stream_options" not in p_body
        assert d_body["kv_transfer_params"]["remote_engine_id"] == p.engine_id
        assert d_body["kv_transfer_params"]["do_remote_prefill"] is True
        # D loads its prompt over NIXL: no tier reads for it (nor P's own computed prompt)
        assert d_body["kv_transfer_params"]["kv_load_tiers"] == []
        assert "kv_load_tiers" not in p_body["kv_transfer_params"]
        assert d_body["stream"] is True and d_body["return_token_ids"] is True
        assert p_body["cache_salt"] == d_body["cache_salt"]
        assert evs[-2]["usage"]["prompt_tokens_details"]["cached_tokens"] == 0

        kva2, _, evs2 = await turn(st, second(answer), token=kva["cache_token"])
        assert kva2["path"] == "pd_reuse"
        params = p.requests[-1]["kv_transfer_params"]
        assert params["remote_engine_id"] == d.engine_id  # P pulls from D
        assert params["do_remote_decode"] is True and params["do_remote_prefill"] is False
        assert params["kv_load_tiers"] == [] and d.requests[-1]["kv_transfer_params"][
            "kv_load_tiers"] == []
        n = params["remote_num_tokens"]
        assert n == kva2["reused_tokens"] and n % st.cluster.block_size == 0 and n > 0
        assert len(params["remote_block_ids"][0]) == n // st.cluster.block_size
        assert evs2[-2]["usage"]["prompt_tokens_details"]["cached_tokens"] >= n
        p_pulls = [e for e in st.cluster.events_of("pull") if e.node == p.engine_id]
        assert [e.detail["from"] for e in p_pulls] == [d.engine_id]
        assert p_pulls[0].detail["tokens"] == n
        assert kva2["cache_token"] != kva["cache_token"]
        no_wrong_kv(st)


async def test_token_round_trip_over_many_turns() -> None:
    async with router_stack(policy={"params": {"skip_prefill_max_tokens": 0}}) as st:
        messages = list(FIRST)
        token = None
        reused = []
        for i in range(4):
            kva, answer, _ = await turn(st, messages, token=token)
            reused.append(kva["reused_tokens"])
            token = kva["cache_token"]
            messages += [{"role": "assistant", "content": answer},
                         {"role": "user", "content": f"follow-up number {i} " * 3}]
        assert reused[0] == 0 and all(r > 0 for r in reused[1:])
        assert reused == sorted(reused)  # the reused prefix grows with the conversation
        no_wrong_kv(st)


async def test_session_without_token_reuses_latest_handle() -> None:
    async with router_stack(policy={"params": {"skip_prefill_max_tokens": 0}}) as st:
        _, answer, _ = await turn(st, FIRST)
        kva, _, _ = await turn(st, second(answer))
        assert kva["path"] == "pd_reuse" and kva["reused_tokens"] > 0
        no_wrong_kv(st)


async def test_no_session_no_token() -> None:
    async with router_stack() as st:
        kva, _, _ = await turn(st, FIRST, session=None)
        assert kva["path"] == "pd_fresh" and kva["cache_token"] is None


async def test_edited_history_reuses_only_verified_prefix() -> None:
    async with router_stack(policy={"params": {"skip_prefill_max_tokens": 0}}) as st:
        kva, answer, _ = await turn(st, FIRST)
        edited = second(answer[:-3] + "XYZ")  # the client rewrote the assistant's answer
        kva2, _, _ = await turn(st, edited, token=kva["cache_token"])
        assert kva2["path"] == "pd_reuse"
        # the reuse stops before the edit: at most the first message's whole blocks
        first_len = len(FIRST[0]["content"]) + 2
        assert 0 < kva2["reused_tokens"] <= first_len + len(answer)
        no_wrong_kv(st)

        kva3, _, _ = await turn(st, [{"role": "user", "content": "entirely new"}],
                                token=kva2["cache_token"])
        assert kva3["path"] == "recompute" and kva3["reused_tokens"] == 0
        assert kva3["cache_token"]
        # the claimed, unusable handle was released on D by P declining it (no TTL wait)
        assert st.prefill[0].requests[-1]["kv_transfer_params"]["remote_num_tokens"] == 0
        assert st.cluster.events_of("decline")
        no_wrong_kv(st)


async def test_work_in_flight_is_counted_and_released() -> None:
    """The router's ledger of legs (what placement, the queue-aware path choice and the
    decode gate read) is back to idle once the turns are answered, streamed or not,
    whatever path they took."""
    from kvagent_server.router.reuse.queue import IDLE

    async with router_stack(policy={"params": {"queue_aware_paths": True}}) as st:
        kva, answer, _ = await turn(st, FIRST)
        router = st.router
        # the first turn's P leg, estimated from the body's size, taught the ratio
        assert router.learned.chars.ratio != 0.25
        kva2, _, _ = await turn(st, second(answer, "ok"), token=kva["cache_token"])
        assert kva2["path"] in ("d_direct", "pd_reuse")
        r = await st.client.post("/v1/chat/completions",
                                 json=chat_body(FIRST, stream=False),
                                 headers={"X-Session-ID": "s2"})
        assert r.status_code == 200
        now = time.monotonic()
        for node in st.nodes:
            name = "p0" if node in st.prefill else "d0"
            assert router.ledger.work(name, now=now, per_token_s=1e-3) == IDLE
            assert router.ledger.in_flight(name) == 0
        # What the D legs allocated counts against D's room until a read of D shows it.
        assert router.retention is not None
        await router.retention.refresh(router.registry.nodes["d0"])
        assert len(router.ledger) == 0 and router.ledger.promised("d0") == 0


async def test_d_direct_when_delta_small() -> None:
    async with router_stack(policy={"params": {"skip_prefill_max_tokens": 64}}) as st:
        kva, answer, _ = await turn(st, FIRST)
        p_calls = len(st.prefill[0].requests)
        kva2, _, evs = await turn(st, second(answer, "ok"), token=kva["cache_token"])
        assert kva2["path"] == "d_direct" and kva2["reused_tokens"] > 0
        assert len(st.prefill[0].requests) == p_calls  # P skipped
        # D computes the delta itself and releases the handle this turn superseded: it is
        # never offered again, so it must not pin D's memory until the TTL.
        sent = st.decode[0].requests[-1]["kv_transfer_params"]
        assert (sent["do_remote_prefill"], sent["do_remote_decode"]) == (False, False)
        turn1 = next(r.request_id for r in st.cluster.retained.values()
                     if r.engine_id == st.decode[0].engine_id)
        released = [e.detail["id"] for e in st.cluster.events_of("release")]
        assert sent["kvagent_release"] == released == [turn1]
        assert evs[-2]["usage"]["prompt_tokens_details"]["cached_tokens"] == kva2[
            "reused_tokens"]
        kva3, _, _ = await turn(st, second(answer, "ok") + [
            {"role": "assistant", "content": "x"}, {"role": "user", "content": LONG * 2}],
            token=kva2["cache_token"])
        assert kva3["path"] == "pd_reuse"  # a long delta goes through P again
        no_wrong_kv(st)


# --------------------------------------------------------------------------- tokens


async def test_bad_tokens_recompute_with_fresh_token() -> None:
    async with router_stack(policy={"params": {"skip_prefill_max_tokens": 0}}) as st:
        kva, answer, _ = await turn(st, FIRST)
        good = kva["cache_token"]
        head, payload, mac = good.split(".")
        tampered = f"{head}.{payload}.{mac[:-2]}{'AA' if mac[-2:] != 'AA' else 'BB'}"
        codec = st.router.codec
        now = int(time.time())
        expired = codec.encode(tenant="default", session="s1", handle="whatever",
                               iat=now - 1000, exp=now - 10)
        for bad in (tampered, expired, "garbage", "kva1." + "A" * 3000):
            kva_bad, _, _ = await turn(st, second(answer), token=bad)
            assert kva_bad["path"] == "recompute" and kva_bad["reused_tokens"] == 0
            assert kva_bad["cache_token"] and kva_bad["cache_token"] != bad
        # a token for another session of the same tenant
        kva_other, _, _ = await turn(st, second(answer), session="s2", token=good)
        assert kva_other["path"] == "recompute"
        no_wrong_kv(st)


async def test_replayed_token_recomputes() -> None:
    async with router_stack(policy={"params": {"skip_prefill_max_tokens": 0}}) as st:
        kva, answer, _ = await turn(st, FIRST)
        ok, _, _ = await turn(st, second(answer), token=kva["cache_token"])
        replay, _, _ = await turn(st, second(answer), token=kva["cache_token"])
        assert ok["path"] == "pd_reuse" and replay["path"] == "recompute"
        no_wrong_kv(st)


async def test_racing_requests_on_one_handle_reuse_once() -> None:
    async with router_stack(policy={"params": {"skip_prefill_max_tokens": 0}}) as st:
        kva, answer, _ = await turn(st, FIRST)
        results = await asyncio.gather(*(turn(st, second(answer), token=kva["cache_token"])
                                         for _ in range(4)))
        paths = sorted(k["path"] for k, _, _ in results)
        assert paths == ["pd_reuse", "recompute", "recompute", "recompute"]
        p_pulls = [e for e in st.cluster.events_of("pull") if e.node.startswith("engine-p")]
        assert len(p_pulls) == 1  # one P pull from D: the handle was used once
        no_wrong_kv(st)


async def test_other_tenant_token_recomputes() -> None:
    tenants = [{"name": "acme", "api_keys": ["key-acme"], "max_concurrent_streams": 8},
               {"name": "globex", "api_keys": ["key-globex"]}]
    async with router_stack(policy={"params": {"skip_prefill_max_tokens": 0}},
                            tenants=tenants) as st:
        acme = {"Authorization": "Bearer key-acme"}
        globex = {"Authorization": "Bearer key-globex"}
        kva, answer, _ = await turn(st, FIRST, headers=acme)
        stolen, _, _ = await turn(st, second(answer), token=kva["cache_token"], headers=globex)
        assert stolen["path"] == "recompute"
        # the rightful owner can still use it: the stolen attempt claimed nothing
        own, _, _ = await turn(st, second(answer), token=kva["cache_token"], headers=acme)
        assert own["path"] == "pd_reuse"
        salts = {r["cache_salt"] for r in st.prefill[0].requests}
        assert len(salts) == 2  # one per tenant, always set by the router
        r = await st.client.post("/v1/chat/completions", json=chat_body(FIRST))
        assert r.status_code == 401 and r.json()["error"]["code"] == "missing_api_key"
        r = await st.client.post("/v1/chat/completions", json=chat_body(FIRST),
                                 headers={"Authorization": "Bearer nope"})
        assert r.status_code == 401 and "nope" not in r.text
        no_wrong_kv(st)


async def test_tenant_concurrency_limit() -> None:
    tenants = [{"name": "solo", "api_keys": ["k"], "max_concurrent_streams": 1}]
    cluster = FakeCluster(token_delay_s=0.05, reply=lambda p: Reply(content="short answer"))
    async with router_stack(tenants=tenants, cluster=cluster) as st:
        h = {"Authorization": "Bearer k"}
        async with st.client.stream("POST", "/v1/chat/completions", json=chat_body(FIRST),
                                    headers=h) as first:
            assert first.status_code == 200
            r = await st.client.post("/v1/chat/completions", json=chat_body(FIRST), headers=h)
            assert r.status_code == 429 and r.headers["retry-after"] == "1"
            assert r.json()["error"]["type"] == "rate_limit_error"
            await first.aread()
        r = await st.client.post("/v1/chat/completions", json=chat_body(FIRST), headers=h)
        assert r.status_code == 200


# --------------------------------------------------------------------------- failures


async def test_decode_lost_between_turns_recomputes_elsewhere() -> None:
    async with router_stack(n_decode=2, policy={"params": {"skip_prefill_max_tokens": 0}}) as st:
        kva, answer, _ = await turn(st, FIRST)
        holder = next(d for d in st.decode if d.requests)
        other = next(d for d in st.decode if d is not holder)
        holder.healthy = False  # fails /health and every request
        holder.restart()
        kva2, _, _ = await turn(st, second(answer), token=kva["cache_token"])
        assert kva2["path"] == "recompute" and kva2["cache_token"]
        assert other.requests, "the turn must be served by the surviving decode node"
        no_wrong_kv(st)


async def test_a_failed_d_direct_recomputes_on_another_decode_node() -> None:
    """A holder that answers 500 to its `d_direct` leg is tried last for the recompute,
    whose D leg pulls from P and so is not retried elsewhere."""
    async with router_stack(n_decode=2,
                            policy={"params": {"skip_prefill_max_tokens": 100_000}}) as st:
        kva, answer, _ = await turn(st, FIRST)
        holder = next(d for d in st.decode if d.requests)
        other = next(d for d in st.decode if d is not holder)
        holder.fail_next = [500, 500]
        kva2, _, _ = await turn(st, second(answer), token=kva["cache_token"])
        assert kva2["path"] == "recompute" and kva2["reason"] == "decode_failed"
        assert other.requests, "the recompute must start on the node that did not fail"
        no_wrong_kv(st)


async def test_decode_restart_detected_by_epoch() -> None:
    async with router_stack(policy={"params": {"skip_prefill_max_tokens": 0}},
                            nodes={"health_interval_s": 0.05}) as st:
        kva, answer, _ = await turn(st, FIRST)
        d = st.decode[0]
        d.healthy = False
        await asyncio.sleep(0.3)
        d.restart()
        d.healthy = True
        await asyncio.sleep(0.3)
        kva2, _, _ = await turn(st, second(answer), token=kva["cache_token"])
        assert kva2["path"] == "recompute"
        assert not st.cluster.events_of("failed_pull")  # the router knew; no dead pull
        no_wrong_kv(st)


async def test_prefill_failure_before_first_byte_retried_on_another() -> None:
    async with router_stack(n_prefill=2) as st:
        st.prefill[0].fail_next = [503]
        st.prefill[1].fail_next = []
        kva, _, _ = await turn(st, FIRST)
        assert kva["path"] == "pd_fresh"
        served = [p for p in st.prefill if p.requests and p.requests[-1].get("max_tokens") == 1]
        assert len(served) == 2  # tried p0 (503), then p1
        metrics = (await st.client.get("/metrics")).text
        assert 'kvagent_router_leg_retries_total{leg="prefill"} 1.0' in metrics
        no_wrong_kv(st)


async def test_all_prefill_down_is_an_openai_error() -> None:
    async with router_stack(n_prefill=1) as st:
        st.prefill[0].fail_next = [503, 503, 503]
        r = await st.client.post("/v1/chat/completions", json=chat_body(FIRST))
        assert r.status_code in (502, 503)
        err = r.json()["error"]
        assert err["type"] == "server_error" and err["message"]
        assert_clean(st, r.text)


async def test_decode_failure_before_first_byte_retried_and_no_orphan() -> None:
    async with router_stack(n_decode=2) as st:
        for d in st.decode:
            d.fail_next = [503]
        r = await st.client.post("/v1/chat/completions", json=chat_body(FIRST),
                                 headers={"X-Session-ID": "s"})
        assert r.status_code == 502
        assert_clean(st, r.text)
        # P's blocks were read by a decode node afterwards: never left to the lease expiry
        assert not st.cluster.open_leases()


async def test_stream_cut_midway_cuts_client_stream() -> None:
    async with router_stack() as st:
        st.decode[0].cut_after_chunks = 3
        got = b""
        with pytest.raises(httpx.HTTPError):
            async with st.client.stream("POST", "/v1/chat/completions",
                                        json=chat_body(FIRST)) as r:
                assert r.status_code == 200
                async for piece in r.aiter_raw():
                    got += piece
        assert got and b"[DONE]" not in got and b"kvagent" not in got
        assert len(st.decode[0].requests) == 1  # never retried behind the client's back
        assert_clean(st, got)
        metrics = (await st.client.get("/metrics")).text
        assert "kvagent_router_stream_cuts_total 1.0" in metrics


async def test_client_disconnect_aborts_decode_leg() -> None:
    cluster = FakeCluster(token_delay_s=0.05, reply=lambda p: Reply(content="word " * 200))
    async with router_stack(cluster=cluster) as st:
        async with st.client.stream("POST", "/v1/chat/completions",
                                    json=chat_body(FIRST)) as r:
            async for _ in r.aiter_raw():
                break
        for _ in range(100):
            if st.decode[0].aborted:
                break
            await asyncio.sleep(0.02)
        assert st.decode[0].aborted, "D's stream must be aborted when the client leaves"
        assert st.decode[0].in_flight == 0
        assert not cluster.open_leases()


async def test_client_disconnect_during_prefill_aborts_it() -> None:
    cluster = FakeCluster(prefill_delay_s=5.0)
    async with router_stack(cluster=cluster) as st:
        request = asyncio.create_task(
            st.client.post("/v1/chat/completions", json=chat_body(FIRST)))
        for _ in range(500):  # until P holds the leg
            if st.prefill[0].requests:
                break
            await asyncio.sleep(0.01)
        request.cancel()  # the client goes away mid-prefill
        with pytest.raises(asyncio.CancelledError):
            await request
        for _ in range(400):
            if st.prefill[0].aborted:
                break
            await asyncio.sleep(0.01)
        assert st.prefill[0].aborted, "the P leg must be cancelled when the client leaves"
        assert not st.decode[0].requests
        assert not cluster.open_leases()


# --------------------------------------------------------------------------- wire forms


async def test_conversation_id_alias_and_body_object_removed() -> None:
    async with router_stack(policy={"params": {"skip_prefill_max_tokens": 0}}) as st:
        kva, answer, _ = await turn(st, FIRST, session=None, conversation_id="conv-7")
        assert kva["cache_token"]
        kva2, _, _ = await turn(st, second(answer), session=None,
                                kvagent={"session_id": "conv-7",
                                         "cache_token": kva["cache_token"]})
        assert kva2["path"] == "pd_reuse"
        for node in st.nodes:
            for body in node.requests:
                assert "conversation_id" not in body and "kvagent" not in body
        no_wrong_kv(st)


async def test_non_streamed_keeps_tool_calls_usage_logprobs() -> None:
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    cluster = FakeCluster(reply=lambda p: Reply(tool_calls=[call]))
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    async with router_stack(cluster=cluster,
                            policy={"params": {"skip_prefill_max_tokens": 0}}) as st:
        r = await st.client.post("/v1/chat/completions", headers={"X-Session-ID": "t"},
                                 json=chat_body(FIRST, stream=False, tools=tools, logprobs=True))
        assert r.status_code == 200
        assert_clean(st, r.text)
        data = r.json()
        choice = data["choices"][0]
        assert choice["message"]["tool_calls"] == [call]
        assert choice["finish_reason"] == "tool_calls"
        assert choice["logprobs"]["content"]
        assert data["usage"]["completion_tokens"] > 0
        assert data["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert data["kvagent"]["path"] == "pd_fresh" and data["kvagent"]["cache_token"]
        # turn 2 after a tool call: the tool result extends the cached tokens
        messages = [*FIRST, {"role": "assistant", "content": None, "tool_calls": [call]},
                    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21C"}]
        r2 = await st.client.post(
            "/v1/chat/completions", json=chat_body(messages, stream=False, tools=tools),
            headers={"X-Session-ID": "t", "X-KVAgent-Cache-Token": data["kvagent"]["cache_token"]})
        assert r2.json()["kvagent"]["path"] == "pd_reuse"
        tok = st.prefill[0].tokenize_requests[-1]
        assert tok["tools"] == tools and "cache_salt" not in tok
        no_wrong_kv(st)


async def test_streamed_tool_call_deltas_pass_through() -> None:
    call = {"id": "call_9", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    cluster = FakeCluster(reply=lambda p: Reply(tool_calls=[call]))
    async with router_stack(cluster=cluster) as st:
        _kva, _, evs = await turn(st, FIRST)
        deltas = [e["choices"][0]["delta"] for e in evs if isinstance(e, dict) and e["choices"]]
        assert any(d.get("tool_calls") for d in deltas)
        finish = [e["choices"][0]["finish_reason"] for e in evs
                  if isinstance(e, dict) and e["choices"]]
        assert finish[-1] == "tool_calls"


async def test_client_cannot_inject_transfer_params_or_salt() -> None:
    async with router_stack() as st:
        forged = {"do_remote_decode": True, "remote_engine_id": "engine-d0-7f3a9c",
                  "remote_request_id": "d-1", "remote_host": "10.66.0.23",
                  "remote_port": 5650, "remote_block_ids": [[7000]], "remote_num_tokens": 16}
        r = await st.client.post("/v1/chat/completions", json=chat_body(
            FIRST, stream=False, kv_transfer_params=forged, cache_salt="mine"))
        assert r.status_code == 200
        p_body = st.prefill[0].requests[-1]
        assert p_body["kv_transfer_params"] == {"do_remote_decode": True,
                                                "do_remote_prefill": False}
        assert p_body["cache_salt"] != "mine"
        assert st.decode[0].requests[-1]["kv_transfer_params"]["remote_engine_id"] == (
            st.prefill[0].engine_id)


async def test_return_token_ids_kept_when_client_asks() -> None:
    async with router_stack() as st:
        r = await st.client.post("/v1/chat/completions", json=chat_body(
            FIRST, return_token_ids=True))
        evs = events(r.text)
        assert evs[0]["prompt_token_ids"] and "kv_transfer_params" not in r.text
        assert any(e["choices"] and e["choices"][0].get("token_ids") for e in evs[:-1]
                   if isinstance(e, dict))


async def test_usage_chunk_only_when_asked() -> None:
    async with router_stack() as st:
        body = chat_body(FIRST)
        body.pop("stream_options")
        r = await st.client.post("/v1/chat/completions", json=body,
                                 headers={"X-Session-ID": "u"})
        evs = events(r.text)
        assert "usage" not in evs[-2] and evs[-2]["kvagent"]["cache_token"]
        # Every chunk has a choice (clients index `choices[0]`); `kvagent` rides on the
        # finish chunk.
        assert all(e["choices"] and "usage" not in e for e in evs[:-1])
        assert evs[-2]["choices"][0]["finish_reason"] == "stop"
        assert st.decode[0].requests[-1]["stream_options"] == {"include_usage": True}
        # Per-chunk usage is the client's to ask for, together with usage.
        body["stream_options"] = {"include_usage": False, "continuous_usage_stats": True}
        await st.client.post("/v1/chat/completions", json=body)
        assert st.decode[0].requests[-1]["stream_options"] == {"include_usage": True}


async def test_completions_endpoint_stream_and_whole() -> None:
    async with router_stack(policy={"params": {"skip_prefill_max_tokens": 0}}) as st:
        prompt = LONG
        r = await st.client.post("/v1/completions", headers={"X-Session-ID": "c"}, json={
            "model": MODEL, "prompt": prompt, "stream": True,
            "stream_options": {"include_usage": True}})
        assert r.status_code == 200
        assert_clean(st, r.text)
        evs = events(r.text)
        text = "".join(e["choices"][0].get("text", "") for e in evs
                       if isinstance(e, dict) and e["choices"])
        token = evs[-2]["kvagent"]["cache_token"]
        r2 = await st.client.post("/v1/completions", headers={
            "X-Session-ID": "c", "X-KVAgent-Cache-Token": token}, json={
            "model": MODEL, "prompt": prompt + text + "\x00" + " and more", "max_tokens": 50})
        assert r2.status_code == 200
        assert_clean(st, r2.text)
        data = r2.json()
        assert data["kvagent"]["path"] == "pd_reuse" and data["choices"][0]["text"]
        no_wrong_kv(st)


async def test_several_samples_or_prompts_served_whole_on_decode() -> None:
    async with router_stack() as st:
        r = await st.client.post("/v1/chat/completions", headers={"X-Session-ID": "n"},
                                 json=chat_body(FIRST, stream=False, n=2))
        assert r.status_code == 200
        assert_clean(st, r.text)
        assert r.json()["kvagent"]["cache_token"] is None
        r = await st.client.post("/v1/completions", json={
            "model": MODEL, "prompt": ["one", "two"], "max_tokens": 4})
        assert r.status_code == 200
        assert not st.prefill[0].requests  # P never saw them
        assert all("kv_transfer_params" not in b for b in st.decode[0].requests)


# --------------------------------------------------------------------------- surface


async def test_errors_are_openai_shaped() -> None:
    async with router_stack(limits={"max_body_bytes": 4096}) as st:
        c = st.client
        r = await c.post("/v1/chat/completions", content=b"{not json",
                         headers={"content-type": "application/json"})
        assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
        r = await c.post("/v1/chat/completions", json=[1, 2])
        assert r.status_code == 400 and "JSON object" in r.json()["error"]["message"]
        r = await c.post("/v1/chat/completions", json={"model": MODEL, "messages": []})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
        r = await c.post("/v1/completions", json={"model": MODEL})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
        r = await c.post("/v1/chat/completions", json=chat_body(FIRST),
                         headers={"X-Session-ID": "bad id!"})
        assert r.status_code == 400
        r = await c.post("/v1/chat/completions",
                         json=chat_body([{"role": "user", "content": "x" * 5000}]))
        assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"
        r = await c.get("/v1/nothing")
        assert r.status_code == 404 and "error" in r.json()
        for node in st.nodes:
            assert not node.requests  # none of these reached a node


async def test_upstream_4xx_passed_as_openai_error() -> None:
    async with router_stack() as st:
        st.prefill[0].fail_next = [400]  # a message that names a node's address: not passed
        st.prefill[0].fail_message = "prefill at 127.0.0.1:8100 refused the pull"
        r = await st.client.post("/v1/chat/completions", json=chat_body(FIRST))
        assert r.status_code == 400
        assert r.json()["error"]["message"] == "the model server rejected the request"
        st.prefill[0].fail_next = [400]
        st.prefill[0].fail_message = (
            "This model's maximum context length is 2048 tokens. However, you requested "
            "4000 tokens (3000 in the messages, 1000 in the completion). Please reduce the "
            "length of the messages or completion.")
        r = await st.client.post("/v1/chat/completions", json=chat_body(FIRST))
        assert r.status_code == 400
        assert r.json()["error"]["message"] == st.prefill[0].fail_message
        assert_clean(st, r.text)
        st.decode[0].fail_next = [422]
        st.decode[0].echo_errors = True  # D's error echoes the body, P's params included
        r = await st.client.post("/v1/chat/completions", json=chat_body(FIRST))
        assert r.status_code == 422 and r.json()["error"]["message"]
        assert_clean(st, r.text)
        assert not st.cluster.open_leases()


async def test_models_health_ready_metrics() -> None:
    async with router_stack(n_decode=2, policy={"params": {"skip_prefill_max_tokens": 0}},
                            nodes={"health_interval_s": 0.05}) as st:
        c = st.client
        models = (await c.get("/v1/models")).json()
        assert models["data"][0]["id"] == MODEL
        assert (await c.get("/health")).status_code == 200
        assert (await c.get("/livez")).status_code == 200
        ready = await c.get("/ready")
        assert ready.status_code == 200
        assert_clean(st, ready.text)
        kva, answer, _ = await turn(st, FIRST)
        await turn(st, second(answer), token=kva["cache_token"])
        await turn(st, second(answer), token=kva["cache_token"])  # replay: a miss
        text = (await c.get("/metrics")).text
        assert 'kvagent_router_turns_total{path="pd_fresh"} 1.0' in text
        assert 'kvagent_router_turns_total{path="pd_reuse"} 1.0' in text
        assert 'kvagent_router_reuse_misses_total{reason="token_rejected"} 1.0' in text
        assert "kvagent_router_reuse_hits_total 1.0" in text
        assert re.search(r"kvagent_router_reused_tokens_total [1-9]", text)
        assert re.search(r"kvagent_router_recomputed_tokens_total [1-9]", text)
        assert 'kvagent_router_leg_seconds_count{leg="prefill"} 3.0' in text
        assert "kvagent_router_ttft_seconds_count 3.0" in text
        assert "kvagent_router_in_flight 0.0" in text
        for d in st.decode:
            d.healthy = False
        await asyncio.sleep(0.3)
        assert (await c.get("/ready")).status_code == 503
        assert (await c.get("/health")).status_code == 200


async def test_spans_per_turn_and_leg(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvagent_server.router.telemetry import spans as telemetry
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(telemetry, "_tracer", provider.get_tracer("test"))
    async with router_stack(policy={"params": {"skip_prefill_max_tokens": 0}}) as st:
        kva, answer, _ = await turn(st, FIRST, session="otel-1")
        await turn(st, second(answer), session="otel-1", token=kva["cache_token"])
        for _ in range(50):  # the streamed turn's span ends after the last byte
            if len([s for s in exporter.get_finished_spans() if s.name == "kvagent.turn"]) == 2:
                break
            await asyncio.sleep(0.02)
    spans = exporter.get_finished_spans()
    turns = [s for s in spans if s.name == "kvagent.turn"]
    assert [t.attributes["kvagent.path"] for t in turns] == ["pd_fresh", "pd_reuse"]
    assert turns[1].attributes["gen_ai.conversation.id"] == "otel-1"
    assert turns[1].attributes["kvagent.reused_tokens"] > 0
    assert turns[1].attributes["gen_ai.request.model"] == MODEL
    legs = [s for s in spans if s.name in ("kvagent.prefill_leg", "kvagent.decode_leg")]
    assert len(legs) == 4
    turn_ids = {t.context.span_id for t in turns}
    assert all(leg.parent is not None and leg.parent.span_id in turn_ids for leg in legs)
    assert {leg.attributes["kvagent.node"] for leg in legs} == {"p0", "d0"}
    for s in spans:  # node names only, never addresses
        assert not any(secret in str(s.attributes) for secret in st.internal_strings())


@pytest.mark.parametrize("p_checks", [False, True])
async def test_negative_control_unverified_reuse_is_caught(monkeypatch: pytest.MonkeyPatch,
                                                           p_checks: bool) -> None:
    """The fakes catch a router that reuses unverified KV on a P node that pulls whatever
    it is offered: this suite can fail. A P node with the plugin's pull check (the fake
    runs the same function) pulls only the blocks its prompt repeats: no wrong KV."""
    from kvagent_server.router.reuse import planner, transfer

    original = planner.plan_reuse

    def trusting(prompt_ids: Any, handle: Any, **kw: Any) -> Any:  # no token comparison
        if handle is None:
            return original(prompt_ids, handle, **kw)
        n = min(transfer.retained_tokens(handle), len(prompt_ids) - 1)
        n = n // handle.block_size * handle.block_size
        return planner.ReusePlan(reuse_tokens=n, reason="hit")

    monkeypatch.setattr(planner, "plan_reuse", trusting)
    async with router_stack(policy={"params": {"skip_prefill_max_tokens": 0}},
                            cluster=FakeCluster(pull_check=p_checks)) as st:
        kva, _, _ = await turn(st, FIRST)
        await turn(st, second("a rewritten answer " * 12), token=kva["cache_token"])
        assert bool(st.cluster.events_of("wrong_kv")) is not p_checks


async def test_cli_serves_with_settings_file(tmp_path: Any) -> None:
    """`python -m kvagent_server.router` with a settings file, against fake nodes."""
    import sys

    from fakes import FakeNode, free_port, serve

    cluster = FakeCluster()
    p, d = FakeNode(cluster, "prefill"), FakeNode(cluster, "decode")
    cfg = tmp_path / "router.json"
    cfg.write_text(json.dumps({"router": {"skip_prefill_max_tokens": 0,
                                          "nodes": {"health_interval_s": 0.5}}}))
    port = free_port()
    async with serve(p.app) as p_url, serve(d.app) as d_url:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "kvagent_server.router", "--port", str(port), "--prefill",
            p_url, "--decode", d_url, "--settings", str(cfg), "--log-level", "warning")
        try:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as c:
                await wait_ready(c, tries=200)
                models = (await c.get("/v1/models")).json()
                assert models["data"][0]["id"] == MODEL  # asked from the nodes
                r = await c.post("/v1/chat/completions", json=chat_body(FIRST, stream=False),
                                 headers={"X-Session-ID": "cli"})
                assert r.status_code == 200 and r.json()["kvagent"]["path"] == "pd_fresh"
        finally:
            proc.terminate()
            await asyncio.wait_for(proc.wait(), 10)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"nope": 1}))
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvagent_server.router", "--prefill", "x", "--decode", "y",
        "--settings", str(bad), stderr=asyncio.subprocess.PIPE)
    _, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 2 and b"invalid settings" in err


@pytest.mark.parametrize("hook_on", [False, True])
async def test_shift_blocks_header_is_honoured_only_with_the_test_setting(hook_on: bool) -> None:
    """The negative control's hook: only `test_shift_blocks_header` makes the header hand
    P shifted blocks; every D leg carries P's lease end."""
    async with router_stack(policy={"params": {"skip_prefill_max_tokens": 0}},
                            test_shift_blocks_header=hook_on) as st:
        kva, answer, _ = await turn(st, FIRST)
        d_params = st.decode[0].requests[-1]["kv_transfer_params"]
        assert 20 < d_params["kvagent_read_by"] - time.time() <= 30
        await turn(st, second(answer), token=kva["cache_token"],
                   headers={"X-Kvagent-Test-Shift-Blocks": "1"})
        ids = st.prefill[0].requests[-1]["kv_transfer_params"]["remote_block_ids"][0]
        if len(ids) < 2:
            pytest.skip("the fake conversation reuses a single block")
        # The fake numbers a sequence's blocks consecutively: shifted ids repeat the first.
        assert (len(set(ids)) < len(ids)) is hook_on, ids
        if hook_on:
            k = len(ids) // 2
            assert ids == [ids[0]] * (k + 1) + list(range(ids[0] + 1, ids[0] + len(ids) - k))
            assert st.prefill[0].requests[-1]["cache_salt"].startswith("shifted-")
