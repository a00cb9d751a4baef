"""The router with one decode node and no prefill node (the `single` topology), against a
fake vLLM node over real HTTP: every turn is served by that node, with every router
feature (verified reuse, cache tokens, content lookup, the agent front doors, retention).
"""

from __future__ import annotations

import asyncio
import re
import sys
from typing import Any

import httpx
from fakes import FakeCluster, FakeNode, free_port, router_stack, serve
from kvagent_server.router.reuse.transfer import RELEASE_KEY
from router_client import (
    FIRST,
    LONG,
    MODEL,
    assert_clean,
    chat_body,
    no_wrong_kv,
    second,
    turn,
    wait_ready,
)


def _d_params(st: Any) -> dict[str, Any]:
    return st.decode[0].requests[-1]["kv_transfer_params"]


def _retained_ids(st: Any) -> list[str]:
    d = st.decode[0]
    return [r.request_id for r in st.cluster.retained.values() if r.engine_id == d.engine_id]


async def test_a_conversation_is_d_fresh_then_d_direct_with_verified_reuse() -> None:
    async with router_stack(n_prefill=0) as st:
        d = st.decode[0]
        kva, answer, _ = await turn(st, FIRST)
        assert (kva["path"], kva["reason"], kva["reused_tokens"]) == ("d_fresh", "no_handle", 0)
        assert kva["cache_token"].startswith("kva1.")
        # D computes the prompt itself and keeps the finished sequence for the next turn.
        sent = _d_params(st)
        assert (sent["do_remote_prefill"], sent["do_remote_decode"]) == (False, False)
        assert d.requests[-1]["return_token_ids"] is True
        turn1 = _retained_ids(st)
        assert len(turn1) == 1

        kva2, answer2, evs2 = await turn(st, second(answer), token=kva["cache_token"])
        assert kva2["path"] == "d_direct" and kva2["reason"] == "hit"
        assert kva2["reused_tokens"] > 0 and kva2["reused_tokens"] % st.cluster.block_size == 0
        assert evs2[-2]["usage"]["prompt_tokens_details"]["cached_tokens"] == kva2[
            "reused_tokens"]
        # The turn it superseded is released when this one finishes (a tool pause ends).
        assert _d_params(st)[RELEASE_KEY] == turn1
        assert [e.detail["id"] for e in st.cluster.events_of("release")] == turn1
        # The prompt was verified: tokenized by the decode node, the only node there is.
        assert d.tokenize_requests
        # Same answer as the node computing it whole (the fake answers by prompt).
        async with router_stack(n_prefill=0) as fresh:
            _, again, _ = await turn(fresh, second(answer), session="other")
        assert again == answer2
        # The session alone (no token) claims its latest turn too.
        kva3, _, _ = await turn(st, [*second(answer), {"role": "assistant", "content": answer2},
                                     {"role": "user", "content": "and once more"}])
        assert kva3["path"] == "d_direct" and kva3["reused_tokens"] > kva2["reused_tokens"]
        assert not st.cluster.events_of("pull")  # nothing moved between nodes
        no_wrong_kv(st)


async def test_a_turn_that_cannot_reuse_is_computed_on_d_and_frees_the_claimed_turn() -> None:
    async with router_stack(n_prefill=0) as st:
        kva, answer, _ = await turn(st, FIRST)
        turn1 = _retained_ids(st)
        edited = [{"role": "user", "content": "Something else entirely. " + LONG}]
        kva2, _, _ = await turn(st, edited, token=kva["cache_token"])
        assert (kva2["path"], kva2["reused_tokens"]) == ("d_fresh", 0)
        assert kva2["reason"] == "below_threshold"  # only the template's head is shared
        assert _d_params(st)[RELEASE_KEY] == turn1  # claimed, never offered again
        # A replayed (already used) token: computed on D, no reuse.
        kva3, _, _ = await turn(st, second(answer), token=kva["cache_token"])
        assert (kva3["path"], kva3["reason"]) == ("d_fresh", "token_rejected:already_used")
        no_wrong_kv(st)


async def test_a_failed_d_direct_leg_is_recomputed_on_the_node() -> None:
    async with router_stack(n_prefill=0) as st:
        kva, answer, _ = await turn(st, FIRST)
        st.decode[0].fail_next = [500]
        kva2, answer2, _ = await turn(st, second(answer), token=kva["cache_token"])
        assert (kva2["path"], kva2["reason"], kva2["reused_tokens"]) == (
            "d_fresh", "decode_failed", 0)
        kva3, _, _ = await turn(st, second(answer2), token=kva2["cache_token"])
        assert kva3["path"] == "d_direct"
        st.decode[0].fail_next = [500, 500]  # the node failing a first turn: an error
        r = await st.client.post("/v1/chat/completions", json=chat_body(FIRST, stream=False),
                                 headers={"X-Session-ID": "down"})
        assert r.status_code >= 500 and r.json()["error"]
        assert_clean(st, r.content)


async def test_a_turn_that_names_no_conversation_is_found_by_content_on_d() -> None:
    async with router_stack(n_prefill=0) as st:
        kva, answer, _ = await turn(st, FIRST, session=None)
        assert kva["path"] == "d_fresh" and kva["cache_token"] is None
        kva2, _, _ = await turn(st, second(answer), session=None)
        assert kva2["path"] == "d_direct" and kva2["reused_tokens"] > 0
        assert len(st.decode[0].tokenize_requests) >= 2  # each looked up by its tokens
        no_wrong_kv(st)


async def test_the_agent_front_doors_reuse_on_the_one_node() -> None:
    async with router_stack(n_prefill=0) as st:
        c = st.client
        msgs: list[dict[str, Any]] = [{"role": "user", "content": LONG}]
        r = await c.post("/v1/messages", headers={"X-Session-ID": "m"}, json={
            "model": MODEL, "max_tokens": 64, "messages": msgs})
        assert r.status_code == 200, r.text
        first = r.json()
        assert first["kvagent"]["path"] == "d_fresh"
        msgs += [{"role": "assistant", "content": first["content"]},
                 {"role": "user", "content": "Shorter please."}]
        r = await c.post("/v1/messages", headers={"X-Session-ID": "m"}, json={
            "model": MODEL, "max_tokens": 64, "messages": msgs})
        assert r.status_code == 200, r.text
        assert r.json()["kvagent"]["path"] == "d_direct"
        assert r.json()["kvagent"]["reused_tokens"] > 0

        r = await c.post("/v1/responses", json={"model": MODEL, "input": LONG})
        assert r.status_code == 200, r.text
        assert r.json()["kvagent"]["path"] == "d_fresh"
        r = await c.post("/v1/responses", json={
            "model": MODEL, "input": "Shorter please.", "previous_response_id": r.json()["id"]})
        assert r.status_code == 200, r.text
        assert r.json()["kvagent"]["path"] == "d_direct"
        assert r.json()["kvagent"]["reused_tokens"] > 0
        assert_clean(st, r.content)
        no_wrong_kv(st)


async def test_over_the_watermark_the_guard_evicts_on_the_node() -> None:
    cluster = FakeCluster(kv_blocks=200)
    async with router_stack(n_prefill=0, cluster=cluster,
                            retention={"high_watermark": 0.5, "low_watermark": 0.25,
                                       "check_interval_s": 0.05}) as st:
        d = st.decode[0]
        convs = {}
        for i in range(5):  # ~30 blocks each: the fourth or fifth crosses 50%
            msgs = [{"role": "user", "content": f"conversation {i}: {LONG}"}]
            kva, answer, _ = await turn(st, msgs, session=f"s{i}")
            convs[i] = (msgs, kva, answer)
        for _ in range(200):
            if cluster.events_of("release") and d.kv_usage() < 0.5:
                break
            await asyncio.sleep(0.05)
        released = [e.detail["id"] for e in cluster.events_of("release")]
        order = _retained_ids(st)
        assert released and released == order[:len(released)] and len(released) < 5
        for i, path in ((0, "d_fresh"), (4, "d_direct")):  # evicted / still held
            msgs, kva, answer = convs[i]
            nxt = [*msgs, {"role": "assistant", "content": answer},
                   {"role": "user", "content": "and then?"}]
            kva_i, _, _ = await turn(st, nxt, session=f"s{i}", token=kva["cache_token"])
            assert kva_i["path"] == path, (i, kva_i)
        no_wrong_kv(st)


async def test_health_ready_models_and_metrics_with_no_prefill_node() -> None:
    async with router_stack(n_prefill=0, nodes={"health_interval_s": 0.05}) as st:
        c = st.client
        assert (await c.get("/v1/models")).json()["data"][0]["id"] == MODEL
        assert (await c.get("/health")).status_code == 200
        ready = await c.get("/ready")
        assert ready.status_code == 200 and ready.json()["status"] == "ready"
        assert list(ready.json()["nodes"]) == ["d0"]
        kva, answer, _ = await turn(st, FIRST)
        await turn(st, second(answer), token=kva["cache_token"])
        text = (await c.get("/metrics")).text
        assert 'kvagent_router_turns_total{path="d_fresh"} 1.0' in text
        assert 'kvagent_router_turns_total{path="d_direct"} 1.0' in text
        assert not re.search(r'kvagent_router_turns_total\{path="(pd_|recompute)', text)
        assert 'kvagent_router_leg_seconds_count{leg="prefill"}' not in text
        assert "kvagent_router_prefill_placements_total{" not in text  # no P placement was made
        st.decode[0].healthy = False
        for _ in range(100):
            if (await c.get("/ready")).status_code == 503:
                break
            await asyncio.sleep(0.05)
        assert (await c.get("/ready")).status_code == 503


async def test_the_command_line_runs_single_without_prefill(tmp_path: Any) -> None:
    cluster = FakeCluster()
    d, d2 = FakeNode(cluster, "decode"), FakeNode(cluster, "decode", 1)
    port = free_port()
    async with serve(d.app) as d_url, serve(d2.app) as d2_url:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "kvagent_server.router", "--port", str(port),
            "--decode", d_url, "--log-level", "warning")
        try:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as c:
                await wait_ready(c)
                r = await c.post("/v1/chat/completions", json=chat_body(FIRST, stream=False),
                                 headers={"X-Session-ID": "cli"})
                assert r.status_code == 200 and r.json()["kvagent"]["path"] == "d_fresh"
        finally:
            proc.terminate()
            await asyncio.wait_for(proc.wait(), 10)
        # A policy that needs P, with one decode node or several (replicas): refused.
        settings = tmp_path / "router.json"
        settings.write_text('{"router": {"path_policy": "pd_reuse"}}')
        for args, says in ((["--decode", d_url, "--decode", d2_url, "--settings",
                             str(settings)], (b"'pd_reuse' needs a prefill node; the router "
                                             b"serves the replicas topology")),
                           (["--decode", d_url, "--settings", str(settings)],
                            b"'pd_reuse' needs a prefill node")):
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "kvagent_server.router", "--port", str(free_port()),
                *args, stderr=asyncio.subprocess.PIPE)
            _, err = await asyncio.wait_for(proc.communicate(), 60)
            assert proc.returncode == 2 and says in err, err


async def test_the_single_policy_sends_no_leg_to_a_prefill_node_even_where_one_exists() -> None:
    async with router_stack(policy={"name": "single"}) as st:
        kva, answer, _ = await turn(st, FIRST)
        kva2, _, _ = await turn(st, second(answer), token=kva["cache_token"])
        assert (kva["path"], kva2["path"]) == ("d_fresh", "d_direct")
        assert kva2["reused_tokens"] > 0
        assert st.prefill[0].requests == []  # P only tokenized (it is the P/D topology)
        no_wrong_kv(st)
