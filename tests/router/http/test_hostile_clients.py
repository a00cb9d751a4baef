"""Hostile clients against the router (fake nodes, real sockets): each limit and isolation
rule of docs/reliability.md "Hostile clients" and docs/router.md "Who can claim which KV"."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time

import pytest
from fakes import FakeCluster, Reply, router_stack
from kvagent.protocol import valid_cache_token, valid_session_id
from kvagent_server.router.http.app import create_app
from kvagent_server.router.settings import RouterSettings
from kvagent_server.router.store.memory import MemoryStore
from pydantic import ValidationError
from router_client import FIRST, assert_clean, chat_body, content_of, events, second, turn

# --------------------------------------------------------------------- raw sockets


def _connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    s = socket.create_connection((host, int(port)), timeout=5)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


async def _raw(url: str, chunks: list[bytes], *, pause_s: float = 0.0,
               read_timeout_s: float = 5.0) -> tuple[bytes, bool]:
    """Send `chunks` (pausing between them) and read until the server closes. Returns
    what was read and whether every chunk could be sent (False: closed under us)."""

    def run() -> tuple[bytes, bool]:
        s = _connect(url)
        sent_all = True
        try:
            for chunk in chunks:
                try:
                    s.sendall(chunk)
                except OSError:
                    sent_all = False
                    break
                if pause_s:
                    time.sleep(pause_s)
            s.settimeout(read_timeout_s)
            out = b""
            with contextlib.suppress(OSError):
                while piece := s.recv(65536):
                    out += piece
            return out, sent_all
        finally:
            s.close()

    return await asyncio.to_thread(run)


HEAD = b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"


async def test_oversized_header_block_is_answered_while_it_arrives() -> None:
    """A 4 MiB header that never ends: 431 after about max_header_bytes, not buffered."""
    async with router_stack(limits={"max_header_bytes": 16 * 1024}) as st:
        block = [HEAD + b"x-big: "] + [b"a" * 65536] * 64  # never terminated
        out, sent_all = await _raw(st.url, block, read_timeout_s=5)
        assert out.startswith(b"HTTP/1.1 431"), out[:80]
        assert not sent_all  # closed long before the 4 MiB were sent
        for node in st.nodes:
            assert not node.requests


async def test_too_many_headers_is_431() -> None:
    async with router_stack(limits={"max_header_count": 20}) as st:
        lines = b"".join(b"x-h%d: v\r\n" % i for i in range(21))
        out, _ = await _raw(st.url, [HEAD + lines + b"content-length: 2\r\n\r\n{}"])
        assert out.startswith(b"HTTP/1.1 431"), out[:80]
        ok, _ = await _raw(st.url, [b"GET /health HTTP/1.1\r\nhost: x\r\n"
                                    + b"".join(b"x-h%d: v\r\n" % i for i in range(10))
                                    + b"connection: close\r\n\r\n"])
        assert ok.startswith(b"HTTP/1.1 200")


async def test_slow_header_is_cut_by_the_header_timeout() -> None:
    async with router_stack(limits={"header_timeout_s": 0.5}) as st:
        started = time.monotonic()
        # One header byte every 0.1 s, 400 of them: would take 40 s.
        out, _ = await _raw(st.url, [HEAD] + [b"x"] * 400, pause_s=0.1)
        assert out.startswith(b"HTTP/1.1 408"), out[:80]
        assert time.monotonic() - started < 25  # cut at 0.5 s, not after 40 s
        # An idle connection (no byte at all) is closed too, unanswered.
        out, _ = await _raw(st.url, [], read_timeout_s=3)
        assert out == b""


async def _answered_mid_body(url: str, head: bytes, *, window_s: float = 4.0
                             ) -> tuple[bytes, float | None]:
    """Send `head` and then a body byte every 0.1 s, whatever the server answers, reading
    as we go. Returns what was read, and how long after the first byte of the answer the
    server had closed the connection, i.e. our bytes could no longer be sent (None: still
    taking them `window_s` after the answer). A FIN alone (the server shut its side) is
    not closed: a socket still reading holds the connection."""

    def run() -> tuple[bytes, float | None]:
        s = _connect(url)
        s.settimeout(0.1)
        out, answered, eof = b"", None, False
        deadline = time.monotonic() + 15
        try:
            s.sendall(head)
            while time.monotonic() < deadline:
                if answered is not None and time.monotonic() - answered > window_s:
                    return out, None
                try:
                    s.sendall(b" ")
                except OSError:  # reset, or the pipe is gone: the server closed
                    return out, None if answered is None else time.monotonic() - answered
                if eof:
                    time.sleep(0.1)
                    continue
                try:
                    piece = s.recv(65536)
                except TimeoutError:
                    continue
                except OSError:
                    return out, None if answered is None else time.monotonic() - answered
                if answered is None and piece:
                    answered = time.monotonic()
                out += piece
                eof = not piece
            return out, None
        finally:
            s.close()

    return await asyncio.to_thread(run)


async def test_slow_body_is_cut_by_the_body_timeout() -> None:
    """408 at the body timeout, and the connection closed although the body keeps
    arriving: a byte at a time must not hold it open after the answer."""
    async with router_stack(limits={"body_timeout_s": 0.5, "header_timeout_s": 1.0}) as st:
        head = HEAD + b"content-type: application/json\r\ncontent-length: 200\r\n\r\n{"
        out, closed_after = await _answered_mid_body(st.url, head)
        assert out.startswith(b"HTTP/1.1 408"), out[:80]
        assert closed_after is not None and closed_after < 2, closed_after


@pytest.mark.parametrize(("request_line", "extra", "status"), [
    (b"POST /v1/chat/completions", b"", b"401"),  # no key: answered before the body
    (b"POST /v1/nowhere", b"authorization: Bearer k\r\n", b"404"),
    (b"GET /v1/chat/completions", b"authorization: Bearer k\r\n", b"405"),
    (b"POST /v1/chat/completions", b"authorization: Bearer k\r\n", b"413"),
])
async def test_an_answer_before_the_body_ends_closes_the_connection(
        request_line: bytes, extra: bytes, status: bytes) -> None:
    length = b"100000000" if status == b"413" else b"200"
    async with router_stack(tenants=[{"name": "t", "api_keys": ["k"]}],
                            limits={"header_timeout_s": 1.0}) as st:
        head = (request_line + b" HTTP/1.1\r\nhost: x\r\n" + extra
                + b"content-type: application/json\r\ncontent-length: " + length
                + b"\r\n\r\n{")
        out, closed_after = await _answered_mid_body(st.url, head)
        assert out.startswith(b"HTTP/1.1 " + status), out[:80]
        assert closed_after is not None and closed_after < 2, closed_after
        for node in st.nodes:
            assert not node.requests


async def test_an_upload_answered_early_still_gets_its_answer() -> None:
    """A client uploading a body the router refuses at once (413 on its declared length)
    gets the 413: the router reads the rest before closing, so the kernel does not reset
    the connection under the upload."""
    async with router_stack(limits={"max_body_bytes": 1024 * 1024}) as st:
        big = [{"role": "user", "content": "x" * (9 * 1024 * 1024)}]
        for _ in range(3):
            r = await st.client.post("/v1/chat/completions", json=chat_body(big))
            assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"


async def test_a_connection_whose_body_arrived_stays_open_after_an_error() -> None:
    """Keep-alive is untouched when the body was complete: a 401 for a whole request, then
    a second request on the same connection."""
    async with router_stack(tenants=[{"name": "t", "api_keys": ["k"]}]) as st:
        body = b'{"model": "m", "messages": []}'
        first = (HEAD + b"content-type: application/json\r\ncontent-length: %d\r\n\r\n"
                 % len(body) + body)
        health = b"GET /health HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n"
        out, sent_all = await _raw(st.url, [first, health], pause_s=0.3)
        assert sent_all and out.startswith(b"HTTP/1.1 401"), out[:80]
        assert b"HTTP/1.1 200" in out, out


async def test_connections_per_client_are_capped() -> None:
    async with router_stack(limits={"max_connections_per_client": 4}) as st:
        held = [await asyncio.to_thread(_connect, st.url) for _ in range(4)]
        try:
            out, _ = await _raw(st.url, [b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n"],
                                read_timeout_s=3)
            assert out == b""  # closed, unanswered
        finally:
            for s in held:
                s.close()
        await asyncio.sleep(0.2)  # closed ones are uncounted: a new one is served
        r = await st.client.get("/health")
        assert r.status_code == 200


async def test_total_connections_are_capped() -> None:
    async with router_stack(limits={"max_connections": 3}) as st:
        await st.client.aclose()  # its pooled connection would count
        held = [await asyncio.to_thread(_connect, st.url) for _ in range(3)]
        try:
            out, _ = await _raw(st.url, [b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n"],
                                read_timeout_s=3)
            assert out == b""
        finally:
            for s in held:
                s.close()


# --------------------------------------------------------------------- request limits


async def test_messages_and_tools_are_capped() -> None:
    async with router_stack(limits={"max_messages": 4, "max_tools": 2}) as st:
        many = [{"role": "user", "content": "hi"}] * 5
        r = await st.client.post("/v1/chat/completions", json=chat_body(many, stream=False))
        assert r.status_code == 400 and r.json()["error"]["code"] == "too_many_messages"
        tool = {"type": "function", "function": {"name": "f", "parameters": {}}}
        r = await st.client.post("/v1/chat/completions",
                                 json=chat_body(FIRST, stream=False, tools=[tool] * 3))
        assert r.status_code == 400 and r.json()["error"]["code"] == "too_many_tools"
        for node in st.nodes:
            assert not node.requests


async def test_body_bytes_are_capped() -> None:
    async with router_stack(limits={"max_body_bytes": 4096}) as st:
        big = [{"role": "user", "content": "x" * 5000}]
        r = await st.client.post("/v1/chat/completions", json=chat_body(big))
        assert r.status_code == 413


async def test_streams_per_client_are_capped() -> None:
    cluster = FakeCluster(token_delay_s=0.05)
    async with router_stack(cluster=cluster, limits={"max_streams_per_client": 1}) as st:
        slow = asyncio.create_task(st.client.post("/v1/chat/completions",
                                                  json=chat_body(FIRST)))
        await asyncio.sleep(0.3)
        r = await st.client.post("/v1/chat/completions", json=chat_body(FIRST))
        assert r.status_code == 429 and r.headers["retry-after"]
        assert (await slow).status_code == 200
        r = await st.client.post("/v1/chat/completions", json=chat_body(FIRST, stream=False))
        assert r.status_code == 200  # the slot came back


async def test_a_tenant_named_like_a_client_address_has_its_own_count() -> None:
    """Tenants' and client addresses' stream counts are kept apart: a tenant named
    `client:127.0.0.1` calling from 127.0.0.1 counts once in each, not twice in one."""
    cluster = FakeCluster(token_delay_s=0.05)
    tenants = [{"name": "client:127.0.0.1", "api_keys": ["k"], "max_concurrent_streams": 2}]
    auth = {"Authorization": "Bearer k"}
    async with router_stack(cluster=cluster, tenants=tenants,
                            limits={"max_streams_per_client": 2}) as st:
        slow = asyncio.create_task(st.client.post("/v1/chat/completions",
                                                  json=chat_body(FIRST), headers=auth))
        await asyncio.sleep(0.3)
        r = await st.client.post("/v1/chat/completions", json=chat_body(FIRST, stream=False),
                                 headers=auth)
        assert r.status_code == 200, r.text  # two in flight: within both caps
        assert (await slow).status_code == 200
        admission = st.app.state.parts.admission
        for _ in range(50):  # the stream's slot returns as its response ends
            if admission.tenants == {"client:127.0.0.1": 0}:
                break
            await asyncio.sleep(0.05)
        assert admission.tenants == {"client:127.0.0.1": 0} and admission.clients == {}


# --------------------------------------------------------------------- small flaws


def test_session_ids_and_tokens_ending_in_a_newline_are_invalid() -> None:
    assert valid_session_id("abc")
    assert not valid_session_id("abc\n")
    assert not valid_cache_token("abc\n")


async def test_session_id_with_newline_is_rejected_by_the_router() -> None:
    async with router_stack() as st:
        r = await st.client.post("/v1/chat/completions",
                                 json={**chat_body(FIRST), "kvagent": {"session_id": "s1\n"}})
        assert r.status_code == 400


async def test_create_app_keeps_an_empty_store() -> None:
    store = MemoryStore()
    assert len(store) == 0  # falsy: `store or ...` replaced it
    app = create_app(RouterSettings(nodes={"health_interval_s": 60}), ["http://127.0.0.1:9"],
                     ["http://127.0.0.1:9"], model="m", store=store)
    async with app.router.lifespan_context(app):
        assert app.state.router.store is store


async def test_a_node_error_naming_internals_is_hidden() -> None:
    async with router_stack() as st:
        node = st.decode[0]
        node.fail_next = [400]
        node.fail_message = (f"NIXL handshake with {node.engine_id} at "
                             f"{node.side_host}:{node.side_port} failed")
        r = await st.client.post("/v1/chat/completions", json=chat_body(FIRST))
        assert r.status_code == 400
        assert r.json()["error"]["message"] == "the model server rejected the request"
        assert_clean(st, r.text)


async def test_a_streamed_error_event_is_rebuilt_from_safe_parts() -> None:
    """vLLM reports a failure mid-stream as an error event; its message can name the
    engine and the side channel. The client gets the event, rebuilt from safe parts."""
    async with router_stack() as st:
        node = st.decode[0]
        node.error_after_chunks = 3
        node.fail_message = (f"engine {node.engine_id} at {node.side_host}:{node.side_port} "
                             "died: EngineDeadError")
        r = await st.client.post("/v1/chat/completions", json=chat_body(FIRST))
        assert r.status_code == 200
        evs = events(r.text)
        assert content_of(evs)  # the tokens before the error got through
        errors = [e for e in evs if isinstance(e, dict) and "error" in e]
        assert errors == [{"error": {"message": "the model server failed while answering",
                                     "type": "InternalServerError", "param": None,
                                     "code": None}}], errors
        assert evs[-1] == "[DONE]"
        assert_clean(st, r.text)


@pytest.mark.parametrize("role", ["prefill", "decode"])
@pytest.mark.parametrize("stream", [True, False])
async def test_a_node_that_never_answers_is_cut_at_the_request_timeout(
        role: str, stream: bool) -> None:
    async with router_stack(policy={"params": {"skip_prefill_max_tokens": 0}},
                            nodes={"request_timeout_s": 1.0}) as st:
        node = (st.prefill if role == "prefill" else st.decode)[0]
        node.stall_s = 60
        started = time.monotonic()
        r = await st.client.post("/v1/chat/completions", json=chat_body(FIRST, stream=stream))
        elapsed = time.monotonic() - started
        assert r.status_code == 504, r.text
        error = r.json()["error"]
        assert error["code"] == "upstream_timeout" and error["type"] == "server_error"
        assert f"{role} leg timed out" in error["message"]
        assert 0.9 < elapsed < 10, elapsed  # cut at the timeout, not after the node's 60 s
        assert_clean(st, r.text)


async def test_client_request_id_never_reaches_a_node() -> None:
    async with router_stack() as st:
        r = await st.client.post("/v1/chat/completions",
                                 json=chat_body(FIRST, request_id="victim-id"))
        assert r.status_code == 200
        assert st.nodes and all("request_id" not in b for n in st.nodes for b in n.requests)


async def test_non_streamed_answer_is_read_with_a_cap() -> None:
    cluster = FakeCluster(reply=lambda ids: Reply(content="y" * 4000))
    async with router_stack(cluster=cluster, limits={"max_upstream_body_bytes": 2048}) as st:
        r = await st.client.post("/v1/chat/completions", json=chat_body(FIRST, stream=False))
        assert r.status_code == 502
        assert_clean(st, r.text)
        assert not cluster.open_leases()


def test_tenants_salts_must_differ() -> None:
    with pytest.raises(ValidationError, match="same cache_salt"):
        RouterSettings(tenants=[{"name": "a", "api_keys": ["ka"], "cache_salt": "s"},
                                {"name": "b", "api_keys": ["kb"], "cache_salt": "s"}])
    from kvagent_server.router.auth.tenancy import derive_cache_salt
    with pytest.raises(ValidationError, match="same cache_salt"):
        RouterSettings(tenants=[{"name": "a", "api_keys": ["ka"]},
                                {"name": "b", "api_keys": ["kb"],
                                 "cache_salt": derive_cache_salt("a")}])


# --------------------------------------------------------------------- who claims which KV

TWO_CALLERS = [{"name": "acme", "api_keys": ["key-alice", "key-bob"]}]


async def test_a_session_id_alone_does_not_claim_another_callers_kv() -> None:
    alice = {"Authorization": "Bearer key-alice"}
    bob = {"Authorization": "Bearer key-bob"}
    async with router_stack(tenants=TWO_CALLERS,
                            policy={"params": {"skip_prefill_max_tokens": 0}}) as st:
        first, answer, _ = await turn(st, FIRST, session="shared", headers=alice)
        # Bob knows the session id (no token): he must not reuse, nor burn, Alice's KV.
        kv, _, _ = await turn(st, second(answer), session="shared", headers=bob)
        assert kv["reused_tokens"] == 0
        # Bob replays Alice's token: bound to her, so no reuse either.
        kv, _, _ = await turn(st, second(answer), session="shared", token=first["cache_token"],
                              headers=bob)
        assert kv["reused_tokens"] == 0
        # Alice still reuses her own, by session id alone.
        kv, _, _ = await turn(st, second(answer), session="shared", headers=alice)
        assert kv["reused_tokens"] > 0


async def test_anonymous_callers_share_sessions_as_before() -> None:
    async with router_stack(policy={"params": {"skip_prefill_max_tokens": 0}}) as st:
        _, answer, _ = await turn(st, FIRST, session="s")
        kv, _, _ = await turn(st, second(answer), session="s")
        assert kv["reused_tokens"] > 0


# --------------------------------------------------------------------- quotas and eviction


async def test_one_tenant_cannot_evict_another_and_evictions_release_on_d() -> None:
    tenants = [{"name": "flood", "api_keys": ["kf"]}, {"name": "quiet", "api_keys": ["kq"]}]
    async with router_stack(tenants=tenants, policy={"params": {"skip_prefill_max_tokens": 0}},
                            limits={"max_handles_per_tenant": 3},
                            retention={"check_interval_s": 0.2}) as st:
        quiet = {"Authorization": "Bearer kq"}
        _, answer, _ = await turn(st, FIRST, session="q", headers=quiet)
        for i in range(6):  # the flood's one-turn sessions
            await turn(st, FIRST, session=f"f{i}", headers={"Authorization": "Bearer kf"})
        # The flood's 3 oldest were evicted by its own quota, and released on D.
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            released = [e for e in st.cluster.events if e.kind == "release"]
            if len(released) >= 3:
                break
            await asyncio.sleep(0.1)
        assert len(released) >= 3, st.cluster.events
        kv, _, _ = await turn(st, second(answer), session="q", headers=quiet)
        assert kv["reused_tokens"] > 0


async def test_asgi_header_limits_hold_under_any_server() -> None:
    """The app's own middleware: the second line when served by another ASGI server."""
    import httpx

    app = create_app(RouterSettings(limits={"max_header_count": 20}), ["http://127.0.0.1:9"],
                     ["http://127.0.0.1:9"], model="m")
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://r") as c:
        r = await c.get("/health", headers={f"x-h{i}": "v" for i in range(25)})
        assert r.status_code == 431 and r.json()["error"]["code"] == "too_many_headers"
        r = await c.get("/health", headers={"x-big": "a" * 40_000})
        assert r.status_code == 431
        assert (await c.get("/health")).status_code == 200


# --------------------------------------------------------------------- the pure cores


def test_head_meter_counts_only_while_a_head_is_open() -> None:
    from kvagent_server.router.http.server import ConnectionLimits, HeadMeter

    limits = ConnectionLimits(max_header_bytes=100, max_header_count=2, header_timeout_s=1,
                              max_connections=10, max_connections_per_client=2)
    meter = HeadMeter(limits)
    assert meter.room() == 100
    meter.fed(60)
    assert meter.room() == 40
    assert meter.header() and meter.header() and not meter.header()
    meter.head_done()
    meter.fed(10_000)  # a body: not counted
    assert meter.room() == -1
    meter.next_request()
    assert meter.room() == 100 and meter.header()


def test_connection_counter_caps_in_all_and_per_client() -> None:
    from kvagent_server.router.http.server import ConnectionCounter, ConnectionLimits

    counter = ConnectionCounter(ConnectionLimits(
        max_header_bytes=100, max_header_count=2, header_timeout_s=1, max_connections=3,
        max_connections_per_client=2))
    assert counter.open("a") and counter.open("a") and not counter.open("a")
    counter.close("a")  # every open is closed, refused ones included
    assert counter.open("b")  # 3 open in all
    assert not counter.open("c")  # a fourth is over the total
    counter.close("c")
    assert counter.per_client == {"a": 2, "b": 1}
    for client in ("a", "a", "b"):
        counter.close(client)
    assert counter.total == 0 and counter.per_client == {}
