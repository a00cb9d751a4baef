"""Secrets: signing keys rotate without breaking live sessions; no key or token is logged."""

from __future__ import annotations

import base64
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest
from fakes import FakeCluster, FakeNode, Stack, router_stack, serve
from kvagent_server.router.http.app import create_app
from kvagent_server.router.settings import RouterSettings
from kvagent_server.router.store.redis_store import RedisStore

MODEL = "fake-model"
LONG = "Please keep all of this context in mind for later questions. " * 5
K1, K2 = "old-signing-key-0123456789abcdef", "new-signing-key-fedcba9876543210"


def kid_of(token: str) -> str:
    payload = token.split(".")[1]
    return json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))["k"]


async def chat_turn(client: httpx.AsyncClient, messages: list[dict[str, Any]],
                    token: str | None, headers: dict[str, str] | None = None
                    ) -> tuple[dict[str, Any], str]:
    h = {"X-Session-ID": "conv-1", **(headers or {})}
    if token:
        h["X-KVAgent-Cache-Token"] = token
    r = await client.post("/v1/chat/completions", headers=h, json={
        "model": MODEL, "messages": messages, "stream": False})
    assert r.status_code == 200, r.text
    body = r.json()
    return body["kvagent"], body["choices"][0]["message"]["content"]


# --------------------------------------------------------------------- rotation


@pytest.mark.redis
async def test_key_rotation_keeps_live_sessions(redis_server: Any) -> None:
    """The documented procedure, on replicas sharing Redis and the same nodes:
    1. add the new key as a second (verify-only) key everywhere; 2. move it first (it
    signs); 3. after the longest token lifetime, remove the old key. A session's token
    keeps working across every step and across replicas at different steps."""
    cluster = FakeCluster()
    p, d = FakeNode(cluster, "prefill", 0), FakeNode(cluster, "decode", 0)
    stores: list[RedisStore] = []

    @contextlib.asynccontextmanager
    async def replica(keys: dict[str, str]) -> AsyncIterator[httpx.AsyncClient]:
        store = RedisStore.from_url(redis_server.url, prefix="rot")
        stores.append(store)
        settings = RouterSettings(signing_keys=keys,
                                  policy={"params": {"skip_prefill_max_tokens": 0}},
                                  nodes={"health_interval_s": 5.0})
        app = create_app(settings, [p_url], [d_url], model=MODEL, store=store)
        async with serve(app) as url, httpx.AsyncClient(base_url=url, timeout=30) as c:
            yield c

    async with serve(p.app) as p_url, serve(d.app) as d_url:
        messages: list[dict[str, Any]] = [{"role": "user", "content": LONG}]

        async def step(client: httpx.AsyncClient, token: str | None) -> dict[str, Any]:
            kva, answer = await chat_turn(client, messages, token)
            messages.extend([{"role": "assistant", "content": answer},
                             {"role": "user", "content": f"more, part {len(messages)}"}])
            return kva

        async with replica({"k1": K1}) as old, \
                replica({"k1": K1, "k2": K2}) as staged, \
                replica({"k2": K2, "k1": K1}) as active:
            t1 = await step(old, None)
            assert kid_of(t1["cache_token"]) == "k1"
            t2 = await step(staged, t1["cache_token"])  # step 1: k2 verify-only
            assert t2["path"] == "pd_reuse" and kid_of(t2["cache_token"]) == "k1"
            t3 = await step(active, t2["cache_token"])  # step 2: k2 signs, k1 verifies
            assert t3["path"] == "pd_reuse" and kid_of(t3["cache_token"]) == "k2"
            t4 = await step(staged, t3["cache_token"])  # a replica still at step 1
            assert t4["path"] == "pd_reuse"
            t5 = await step(old, t4["cache_token"])  # not yet rotated: k1-signed, fine
            assert t5["path"] == "pd_reuse"
            t6 = await step(active, t5["cache_token"])
            leftover = t6["cache_token"]
            assert kid_of(leftover) == "k2"
            t7 = await step(old, leftover)  # a replica that never got k2: degrades only
            assert t7["path"] == "recompute" and t7["cache_token"]
        async with replica({"k2": K2}) as retired:  # step 3: k1 removed
            t8 = await step(retired, t7["cache_token"])  # a k1 token after retirement
            assert t8["path"] == "recompute" and kid_of(t8["cache_token"]) == "k2"
            t9 = await step(retired, t8["cache_token"])
            assert t9["path"] == "pd_reuse"
    for store in stores:
        await store.close()
    assert not cluster.events_of("wrong_kv")


# --------------------------------------------------------------------- logs


class Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[str] = []
        self.setFormatter(logging.Formatter("%(name)s %(levelname)s %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        text = self.format(record)  # includes exc_info / stack_info tracebacks
        self.records.append(f"{text} {record.args!r} {getattr(record, '__dict__', {})!r}")


@contextlib.contextmanager
def capture_all_logs() -> Iterator[Capture]:
    """Everything any logger emits, at DEBUG (uvicorn's loggers do not propagate)."""
    handler = Capture()
    names = ["", "kvagent", "uvicorn", "uvicorn.error", "uvicorn.access", "httpx", "httpcore",
             "starlette", "asyncio"]
    saved = [(logging.getLogger(n), logging.getLogger(n).level) for n in names]
    for logger, _ in saved:
        logger.addHandler(handler)
        logger.setLevel(logging.DEBUG)
    try:
        yield handler
    finally:
        for logger, level in saved:
            logger.removeHandler(handler)
            logger.setLevel(level)


def secret_forms(secret: str) -> list[str]:
    raw = secret.encode()
    return [secret, raw.hex(), base64.b64encode(raw).decode().rstrip("="),
            base64.urlsafe_b64encode(raw).decode().rstrip("=")]


async def test_no_key_or_token_in_any_log() -> None:
    api_keys = {"acme": "sk-acme-4f9c2e7d1b3a5968", "globex": "sk-globex-8e1d7c3b2a4f6059"}
    tenants = [{"name": n, "api_keys": [k]} for n, k in api_keys.items()]
    signing = {"k9": "signing-key-7a1f3e9c5b2d8064aa"}
    wrong_key = "sk-not-a-real-key-1234567890"
    with capture_all_logs() as logs:
        async with router_stack(tenants=tenants, signing_keys=signing,
                                policy={"params": {"skip_prefill_max_tokens": 0}}) as st:
            tokens = await _traffic(st, api_keys, wrong_key)
    text = "\n".join(logs.records)
    assert len(logs.records) > 10, "the capture saw nothing: it would prove nothing"
    secrets = [*api_keys.values(), wrong_key, *signing.values()]
    for secret in secrets:
        for form in secret_forms(secret):
            assert form not in text, f"a key appears in the logs ({form[:6]}...)"
    for token in tokens:
        assert token not in text
        assert token.split(".")[2] not in text  # its MAC alone
        assert token.split(".")[1] not in text  # its payload alone


async def _traffic(st: Stack, api_keys: dict[str, str], wrong_key: str) -> list[str]:
    """Turns with tokens, a stolen and a tampered token, bad keys, a node error."""
    tokens: list[str] = []
    for tenant, key in api_keys.items():
        auth = {"Authorization": f"Bearer {key}"}
        messages: list[dict[str, Any]] = [{"role": "user", "content": f"{tenant}: {LONG}"}]
        kva, answer = await chat_turn(st.client, messages, None, auth)
        tokens.append(kva["cache_token"])
        messages += [{"role": "assistant", "content": answer},
                     {"role": "user", "content": "and more"}]
        kva, _ = await chat_turn(st.client, messages, kva["cache_token"], auth)
        tokens.append(kva["cache_token"])
        kva, _ = await chat_turn(st.client, messages, kva["cache_token"][:-3] + "AAA", auth)
        tokens.append(kva["cache_token"])
    # another tenant's token, a wrong key, no key, a failing node that echoes the body
    stolen = {"Authorization": f"Bearer {api_keys['globex']}"}
    kva, _ = await chat_turn(st.client, [{"role": "user", "content": LONG}], tokens[0], stolen)
    tokens.append(kva["cache_token"])
    for auth in ({"Authorization": f"Bearer {wrong_key}"}, {}):
        r = await st.client.post("/v1/chat/completions", headers=auth, json={
            "model": MODEL, "messages": [{"role": "user", "content": "x"}]})
        assert r.status_code == 401
    st.prefill[0].fail_next = [500, 500, 500]
    st.prefill[0].echo_errors = True
    r = await st.client.post("/v1/chat/completions", headers={
        "Authorization": f"Bearer {api_keys['acme']}", "X-Session-ID": "conv-1",
        "X-KVAgent-Cache-Token": tokens[-1]}, json={
        "model": MODEL, "messages": [{"role": "user", "content": LONG}]})
    assert r.status_code == 502
    return tokens
