"""The Messages and Responses front doors over HTTP, before fake P/D nodes: what each
API's clients parse when things go wrong, and the Responses store's scope.

The translations themselves are tested in `apis/`; here, the shells: errors in each API's
own shape (Anthropic's `{"type": "error", ...}`, OpenAI's `{"error": ...}`), stored
Responses readable and chainable by their own caller only, `store: false` keeping nothing,
and a Codex-style WebSocket attempt refused at once (Codex then falls back to HTTP).
"""

from __future__ import annotations

import asyncio
from typing import Any

from fakes import router_stack
from kvagent_server.router.settings import RouterSettings, TenantSettings

MODEL = "fake-model"
KEYS = {"a": {"Authorization": "Bearer key-a"}, "b": {"x-api-key": "key-b"}}


def settings(**kw: Any) -> RouterSettings:
    return RouterSettings(tenants=[TenantSettings(name="t", api_keys=["key-a", "key-b"])],
                          nodes={"health_interval_s": 5.0, "kv_recompute_threshold": 64}, **kw)


async def test_messages_errors_are_anthropic_shaped() -> None:
    async with router_stack(settings=settings()) as st:
        bad = await st.client.post("/v1/messages", json={"model": MODEL, "messages": []},
                                   headers=KEYS["a"])
        assert bad.status_code == 400
        body = bad.json()
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
        unauth = await st.client.post("/v1/messages", json={"model": MODEL, "max_tokens": 4,
                                                            "messages": []})
        assert unauth.status_code == 401
        assert unauth.json()["error"]["type"] == "authentication_error"
        ok = await st.client.post("/v1/messages", headers=KEYS["b"], json={
            "model": MODEL, "max_tokens": 8,
            "messages": [{"role": "user", "content": "hi"}]})
        assert ok.status_code == 200 and ok.json()["type"] == "message"  # x-api-key works
        count = await st.client.post("/v1/messages/count_tokens", headers=KEYS["b"], json={
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
        assert count.status_code == 200 and count.json()["input_tokens"] > 0


async def test_stored_responses_are_their_callers_only() -> None:
    async with router_stack(settings=settings()) as st:
        first = await st.client.post("/v1/responses", headers=KEYS["a"], json={
            "model": MODEL, "input": "hello", "max_output_tokens": 8})
        assert first.status_code == 200, first.text
        rid = first.json()["id"]
        mine = await st.client.get(f"/v1/responses/{rid}", headers=KEYS["a"])
        assert mine.status_code == 200 and mine.json()["id"] == rid
        theirs = await st.client.get(f"/v1/responses/{rid}", headers=KEYS["b"])
        assert theirs.status_code == 404 and theirs.json()["error"]["code"] == "not_found"
        chained = await st.client.post("/v1/responses", headers=KEYS["b"], json={
            "model": MODEL, "input": "more", "previous_response_id": rid})
        assert chained.status_code == 404
        assert chained.json()["error"]["param"] == "previous_response_id"
        ok = await st.client.post("/v1/responses", headers=KEYS["a"], json={
            "model": MODEL, "input": "more", "previous_response_id": rid,
            "max_output_tokens": 8})
        assert ok.status_code == 200 and ok.json()["previous_response_id"] == rid


async def test_store_false_keeps_nothing_and_a_ttl_of_zero_stores_none() -> None:
    async with router_stack(settings=settings()) as st:
        r = await st.client.post("/v1/responses", headers=KEYS["a"], json={
            "model": MODEL, "input": "hello", "max_output_tokens": 8, "store": False})
        assert r.status_code == 200
        gone = await st.client.get(f"/v1/responses/{r.json()['id']}", headers=KEYS["a"])
        assert gone.status_code == 404
    async with router_stack(settings=settings(responses_ttl_s=0)) as st:
        r = await st.client.post("/v1/responses", headers=KEYS["a"], json={
            "model": MODEL, "input": "hello", "max_output_tokens": 8})
        assert (await st.client.get(f"/v1/responses/{r.json()['id']}",
                                    headers=KEYS["a"])).status_code == 404


async def test_unserved_responses_features_are_clear_400s() -> None:
    async with router_stack(settings=settings()) as st:
        for extra in ({"background": True}, {"prompt": {"id": "pmpt_1"}},
                      {"metadata": {"k": "v" * 513}}):
            r = await st.client.post("/v1/responses", headers=KEYS["a"], json={
                "model": MODEL, "input": "hello", **extra})
            assert r.status_code == 400 and r.json()["error"]["message"], r.text


async def test_what_vllm_accepts_the_responses_door_serves() -> None:
    """Codex's default tools (a built-in and a custom tool), a `conversation`, numbers as
    strings: vLLM answers them, so the router does."""
    async with router_stack(settings=settings()) as st:
        for extra in ({"tools": [{"type": "web_search"}, {"type": "custom",
                                                          "name": "apply_patch"}]},
                      {"conversation": "conv_1"}, {"max_output_tokens": "8"},
                      {"stream": "false", "temperature": "0.5"}):
            r = await st.client.post("/v1/responses", headers=KEYS["a"], json={
                "model": MODEL, "input": "hello", **extra})
            assert r.status_code == 200, (extra, r.text)


async def test_a_websocket_attempt_is_refused_at_once() -> None:
    """Codex opens `GET /v1/responses` as a WebSocket first and falls back to HTTP+SSE
    when refused: the refusal must come at once, not after a timeout."""
    import websockets

    async with router_stack(settings=settings()) as st:
        url = st.url.replace("http://", "ws://") + "/v1/responses"
        try:
            async with asyncio.timeout(10):
                async with websockets.connect(url, additional_headers=KEYS["a"]):
                    raise AssertionError("the router accepted a WebSocket")
        except websockets.exceptions.InvalidStatus as exc:
            assert exc.response.status_code in (403, 404, 405)
