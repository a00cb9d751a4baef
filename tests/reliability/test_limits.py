"""Limits: body and header size, per-tenant concurrency, stalled readers, timeouts."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
from fakes import FakeCluster, FakeNode, Reply, Stack, router_stack, serve
from kvagent_server.router.http.app import create_app
from kvagent_server.router.settings import RouterSettings
from reliability_support import is_openai_error
from starlette.responses import Response, StreamingResponse

MODEL = "fake-model"
CHAT = {"model": MODEL, "stream": True, "stream_options": {"include_usage": True},
        "messages": [{"role": "user", "content": "Tell me everything you know. " * 4}]}


async def eventually(check: Callable[[], bool], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.05)


async def test_body_over_limit_is_413_declared_or_streamed() -> None:
    async with router_stack(limits={"max_body_bytes": 4096}) as st:
        big = json.dumps({**CHAT, "messages": [{"role": "user", "content": "x" * 8000}]})
        r = await st.client.post("/v1/chat/completions", content=big.encode())
        assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"

        async def chunks() -> AsyncIterator[bytes]:  # no content-length: chunked upload
            for i in range(0, len(big), 1000):
                yield big[i:i + 1000].encode()

        r = await st.client.post("/v1/chat/completions", content=chunks())
        assert r.status_code == 413 and is_openai_error(r.json())
        assert not any(n.requests for n in st.nodes)


async def test_headers_over_limit_are_431() -> None:
    async with router_stack(limits={"max_header_bytes": 8192}) as st:
        r = await st.client.post("/v1/chat/completions", json=CHAT,
                                 headers={"X-Junk": "j" * 9000})
        assert r.status_code == 431 and r.json()["error"]["code"] == "headers_too_large"
        r = await st.client.get("/health", headers={f"X-H{i}": "v" * 100 for i in range(90)})
        assert r.status_code == 431
        r = await st.client.post("/v1/chat/completions", json=CHAT,
                                 headers={"X-Fine": "f" * 1000})
        assert r.status_code == 200
        assert len(st.prefill[0].requests) == 1


async def test_tenant_limit_is_per_tenant_with_retry_after() -> None:
    tenants = [{"name": "busy", "api_keys": ["key-busy-123456"], "max_concurrent_streams": 2},
               {"name": "calm", "api_keys": ["key-calm-123456"], "max_concurrent_streams": 2}]
    cluster = FakeCluster(token_delay_s=0.05, reply=lambda p: Reply(content="slow reply " * 3))
    async with router_stack(tenants=tenants, cluster=cluster) as st:
        busy = {"Authorization": "Bearer key-busy-123456"}
        calm = {"Authorization": "Bearer key-calm-123456"}
        async with contextlib.AsyncExitStack() as held:
            for _ in range(2):
                r = await held.enter_async_context(
                    st.client.stream("POST", "/v1/chat/completions", json=CHAT, headers=busy))
                assert r.status_code == 200
            r = await st.client.post("/v1/chat/completions", json=CHAT, headers=busy)
            assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
            assert r.json()["error"]["type"] == "rate_limit_error"
            r = await st.client.post("/v1/chat/completions", json=CHAT, headers=calm)
            assert r.status_code == 200  # another tenant is not affected
        r = await st.client.post("/v1/chat/completions", json=CHAT, headers=busy)
        assert r.status_code == 200  # slots are returned when streams end


async def test_first_byte_timeout_is_504_and_aborts_the_prefill_leg() -> None:
    cluster = FakeCluster(prefill_delay_s=60.0)
    async with router_stack(cluster=cluster, limits={"first_byte_timeout_s": 0.5}) as st:
        t0 = time.monotonic()
        r = await st.client.post("/v1/chat/completions", json=CHAT)
        assert r.status_code == 504 and r.json()["error"]["code"] == "upstream_timeout"
        assert time.monotonic() - t0 < 30  # cut at 0.5 s, not after P's 60 s
        await eventually(lambda: bool(st.prefill[0].aborted))  # P saw its client leave
        assert not st.cluster.open_leases()
        assert not st.decode[0].requests


# --------------------------------------------------------------------- stalled readers


class Firehose(FakeNode):
    """A decode node that streams 16 KiB chunks until its client goes away."""

    def __init__(self, cluster: FakeCluster) -> None:
        super().__init__(cluster, "decode", 0)
        self.streaming = 0
        self.chunks_sent = 0

    async def _decode_leg(self, body: dict[str, Any], prompt: list[int],
                          params: dict[str, Any] | None, cached: int, request_id: str,
                          chat: bool) -> Response:
        async def gen() -> AsyncIterator[bytes]:
            self.streaming += 1
            try:
                while True:
                    chunk = {"id": "chatcmpl-x", "object": "chat.completion.chunk",
                             "created": 0, "model": MODEL, "choices": [{
                                 "index": 0, "delta": {"content": "z" * 16384},
                                 "logprobs": None, "finish_reason": None}]}
                    yield f"data: {json.dumps(chunk)}\n\n".encode()
                    self.chunks_sent += 1
                    await asyncio.sleep(0)
            except BaseException:
                self.aborted.append(request_id)
                raise
            finally:
                self.streaming -= 1

        return StreamingResponse(gen(), media_type="text/event-stream")


@contextlib.asynccontextmanager
async def firehose_stack(**settings_kw: Any) -> AsyncIterator[tuple[Stack, Firehose]]:
    cluster = FakeCluster()
    p, d = FakeNode(cluster, "prefill", 0), Firehose(cluster)
    settings = RouterSettings(nodes={"health_interval_s": 5.0}, **settings_kw)
    async with serve(p.app) as p_url, serve(d.app) as d_url:
        app = create_app(settings, [p_url], [d_url], model=MODEL)
        async with serve(app) as url, httpx.AsyncClient(base_url=url, timeout=30) as client:
            yield Stack(cluster, [p], [d], url, app, client), d


async def stalled_client(url: str, body: dict[str, Any],
                         headers: dict[str, str]) -> tuple[asyncio.StreamWriter, bytes]:
    """Send a request, read the response head and a little, then never read again."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, (host, int(port)))
    reader, writer = await asyncio.open_connection(sock=sock, limit=4096)
    payload = json.dumps(body).encode()
    head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    writer.write(f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\n"
                 f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n"
                 f"{head}\r\n".encode() + payload)
    await writer.drain()
    got = await reader.read(2048)
    writer.transport.pause_reading()  # stop reading for good
    return writer, got


async def test_stalled_reader_is_cut_and_releases_the_decode_node() -> None:
    tenants = [{"name": "solo", "api_keys": ["key-solo-123456"], "max_concurrent_streams": 1}]
    async with firehose_stack(tenants=tenants, limits={"stream_write_timeout_s": 0.5}) as (st, d):
        auth = {"Authorization": "Bearer key-solo-123456"}
        writer, got = await stalled_client(st.url, CHAT, auth)
        try:
            assert got.startswith(b"HTTP/1.1 200")
            await eventually(lambda: d.streaming == 1, timeout=10)
            # The router's write blocks once buffers fill, then times out: D is released.
            await eventually(lambda: d.streaming == 0 and bool(d.aborted), timeout=30)
            sent = d.chunks_sent
            await asyncio.sleep(0.3)
            assert d.chunks_sent == sent  # nothing is produced for the stalled client
            metrics = (await st.client.get("/metrics")).text
            assert "kvagent_router_slow_clients_total 1.0" in metrics
            # The tenant's only slot was returned: a well-behaved request is served.
            async with st.client.stream("POST", "/v1/chat/completions", json=CHAT,
                                        headers=auth) as r:
                assert r.status_code == 200
                async for _ in r.aiter_raw():
                    break
        finally:
            writer.transport.abort()
        assert not st.cluster.open_leases()


async def test_a_slow_but_steady_reader_is_not_cut() -> None:
    """The write timeout bounds a stall, not a stream: a client that keeps reading, however
    slowly, gets its whole answer."""
    cluster = FakeCluster(token_delay_s=0.02, chunk_chars=1,
                          reply=lambda p: Reply(content="steady " * 10))
    async with router_stack(cluster=cluster, limits={"stream_write_timeout_s": 0.5}) as st:
        async with st.client.stream("POST", "/v1/chat/completions", json=CHAT) as r:
            body = b""
            async for piece in r.aiter_raw():
                body += piece
                await asyncio.sleep(0.05)
        assert body.rstrip().endswith(b"data: [DONE]")
        assert "kvagent_router_slow_clients_total 0.0" in (await st.client.get("/metrics")).text
