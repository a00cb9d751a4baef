"""The HTTP client to nodes (`nodes.client`) against scripted raw-socket HTTP servers.

Each server answers connection by connection from a script, so the failures the legs
must tell apart (refused, dropped before any response, cut mid-stream, silent) happen
exactly where the test says, on real sockets.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from kvagent_server.router.nodes.client import (
    ConnectFailed,
    NodeClient,
    StaleConnection,
    UpstreamError,
)
from kvagent_server.router.nodes.legs import LegError, Legs
from kvagent_server.router.nodes.registry import Node

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter, int], Awaitable[None]]


class Script:
    """A raw HTTP/1.1 server; `handler(reader, writer, connection_index)` per connection."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections = 0
        self.requests: list[dict[str, Any]] = []
        self.closed_by_client: list[int] = []

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        index = self.connections
        self.connections += 1
        try:
            await self.handler(reader, writer, index)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async def read_request(self, reader: asyncio.StreamReader) -> dict[str, Any] | None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = 0
        for line in head.split(b"\r\n")[1:]:
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":", 1)[1])
        body = json.loads(await reader.readexactly(length))
        self.requests.append(body)
        return body


@contextlib.asynccontextmanager
async def scripted(handler: Handler) -> AsyncIterator[tuple[Script, str]]:
    script = Script(handler)
    server = await asyncio.start_server(script._serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield script, f"http://127.0.0.1:{port}"
    finally:
        server.close()


def response(body: bytes, status: int = 200, *, chunked: bool = False) -> bytes:
    if chunked:
        return (f"HTTP/1.1 {status} OK\r\ncontent-type: text/event-stream\r\n"
                "transfer-encoding: chunked\r\n\r\n").encode()
    return (f"HTTP/1.1 {status} OK\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\n\r\n").encode() + body


def chunk(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


OK_P = json.dumps({"choices": [], "usage": {"prompt_tokens": 3},
                   "kv_transfer_params": {"remote_block_ids": [[1]]}}).encode()


def node(url: str, name: str = "p0") -> Node:
    return Node(name=name, url=url, role="prefill", healthy=True)


async def test_connection_dropped_before_response_is_sent_again_once() -> None:
    """A pooled connection the node closed: the leg re-sends on the same node."""
    script: Script

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                      index: int) -> None:
        await script.read_request(reader)
        if index == 0:
            return  # read the request, close without a byte
        writer.write(response(OK_P))
        await writer.drain()

    async with scripted(handler) as (script, url):
        legs = Legs(max_retries=0, timeout_s=5)
        n = node(url)
        result = await legs.prefill([n], "/v1/completions", {"prompt": "x"},
                                    {"do_remote_decode": True})
        await legs.aclose()
    assert result.kv_params == {"remote_block_ids": [[1]]}
    assert script.connections == 2 and len(script.requests) == 2
    assert n.healthy and legs.ledger.in_flight(n.name) == 0 and len(legs.ledger) == 0


async def test_dropped_twice_is_a_failed_leg_not_a_third_send() -> None:
    script: Script

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                      index: int) -> None:
        await script.read_request(reader)

    async with scripted(handler) as (script, url):
        legs = Legs(max_retries=0, timeout_s=5)
        with pytest.raises(LegError) as err:
            await legs.decode([node(url, "d0")], "/v1/completions", {"prompt": "x"},
                              stream=True)
        await legs.aclose()
    assert err.value.status == 502 and "unreachable" in str(err.value)
    assert len(script.requests) == 2


async def test_refused_connection_marks_the_node_down_and_tries_the_next() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                      index: int) -> None:
        await script.read_request(reader)
        writer.write(response(OK_P))
        await writer.drain()

    async with scripted(handler) as (script, url):
        async with scripted(handler) as (_, dead_url):
            pass  # closed again: its port now refuses
        legs = Legs(max_retries=1, timeout_s=5)
        dead, alive = node(dead_url, "p0"), node(url, "p1")
        result = await legs.prefill([dead, alive], "/v1/completions", {"prompt": "x"},
                                    {"do_remote_decode": True})
        await legs.aclose()
    assert result.node is alive
    assert not dead.healthy and dead.last_error == "ClientConnectorError"
    assert legs.ledger.in_flight("p0") == 0 and legs.ledger.in_flight("p1") == 0
    assert len(legs.ledger) == 0


async def test_silent_node_times_out_without_resending() -> None:
    script: Script

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                      index: int) -> None:
        await script.read_request(reader)
        await asyncio.sleep(5)

    async with scripted(handler) as (script, url):
        client = NodeClient(timeout_s=0.3)
        with pytest.raises(UpstreamError) as err:
            await client.post(f"{url}/v1/completions", {"prompt": "x"}, stream=False)
        await client.aclose()
    assert not isinstance(err.value, StaleConnection | ConnectFailed)
    assert len(script.requests) == 1


async def test_stream_cut_delivers_what_arrived_then_raises() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                      index: int) -> None:
        await script.read_request(reader)
        writer.write(response(b"", chunked=True) + chunk(b"data: {\"a\":1}\n\n")
                     + chunk(b"data: {\"a\":2}\n\n"))
        await writer.drain()
        writer.transport.abort()  # no terminating chunk: the stream is cut

    async with scripted(handler) as (script, url):
        client = NodeClient(timeout_s=5)
        resp = await client.post(f"{url}/v1/chat/completions", {"stream": True}, stream=True)
        await asyncio.sleep(0.2)  # the bytes and the cut both arrive before the first read
        got = b""
        with pytest.raises(UpstreamError):
            async for piece in resp.aiter_raw():
                got += piece
        await resp.aclose()
        await client.aclose()
    assert got == b"data: {\"a\":1}\n\ndata: {\"a\":2}\n\n"


async def test_unfinished_stream_closes_its_connection_finished_one_is_reused() -> None:
    """Closing a stream early must reach the node (vLLM aborts on it); a stream read to
    its end leaves its connection in the pool."""
    eof_seen = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                      index: int) -> None:
        while True:
            try:
                body = await script.read_request(reader)
            except asyncio.IncompleteReadError:
                return
            writer.write(response(b"", chunked=True) + chunk(b"data: 1\n\n"))
            if body and body.get("finish"):
                writer.write(b"0\r\n\r\n")
                await writer.drain()
                continue
            await writer.drain()
            if await reader.read(1) == b"":  # the router hung up
                eof_seen.set()
            return

    async with scripted(handler) as (script, url):
        client = NodeClient(timeout_s=5)
        for _ in range(2):
            resp = await client.post(f"{url}/x", {"finish": True}, stream=True)
            assert [p async for p in resp.aiter_raw()] == [b"data: 1\n\n"]
            await resp.aclose()
        assert script.connections == 1  # both on one kept-alive connection
        resp = await client.post(f"{url}/x", {"finish": False}, stream=True)
        async for _ in resp.aiter_raw():
            break
        await resp.aclose()
        await resp.aclose()  # idempotent
        await asyncio.wait_for(eof_seen.wait(), 5)
        await client.aclose()


async def test_error_status_bodies_are_read_whole_even_when_streamed() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                      index: int) -> None:
        await script.read_request(reader)
        writer.write(response(b'{"error": {"message": "bad", "type": "x"}}', 400))
        await writer.drain()

    async with scripted(handler) as (script, url):
        legs = Legs(max_retries=2, timeout_s=5)
        with pytest.raises(LegError) as err:
            await legs.decode([node(url, "d0")], "/v1/completions", {"prompt": "x"},
                              stream=True)
        await legs.aclose()
    assert err.value.status == 400 and err.value.body == {
        "error": {"message": "bad", "type": "x"}}
    assert len(script.requests) == 1  # a 4xx is the client's fault: not retried


async def test_request_body_is_compact_json_with_identity_encoding() -> None:
    heads: list[bytes] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                      index: int) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        heads.append(head)
        length = int(next(line.split(b":", 1)[1] for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length")))
        heads.append(await reader.readexactly(length))
        writer.write(response(b"{}"))
        await writer.drain()

    async with scripted(handler) as (_, url):
        client = NodeClient(timeout_s=5)
        body = {"prompt": "é", "seed": 2**70, "n": 1}  # 2**70: beyond orjson's integers
        resp = await client.post(f"{url}/x", body, stream=False)
        await client.aclose()
    assert resp.status_code == 200 and resp.json() == {}
    assert json.loads(heads[1]) == body
    assert b"accept-encoding: identity" in heads[0].lower()
    assert b"content-type: application/json" in heads[0].lower()


async def test_a_redirect_is_an_answer_not_followed() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                      index: int) -> None:
        await script.read_request(reader)
        writer.write(b"HTTP/1.1 307 Temporary Redirect\r\nlocation: /elsewhere\r\n"
                     b"content-length: 0\r\n\r\n")
        await writer.drain()

    async with scripted(handler) as (script, url):
        client = NodeClient(timeout_s=5)
        resp = await client.post(f"{url}/v1/completions", {"prompt": "x"}, stream=True)
        await client.aclose()
    assert resp.status_code == 307 and resp.content == b""
    assert len(script.requests) == 1
