"""One pooled connection per session: every stream is read to its end, so httpx returns
the connection to the pool and the next turn reuses it. Counted on a real local server."""

from __future__ import annotations

import httpx
from kvagent import AsyncSession, Session

from benchmarks.api import SSE_MODEL as MODEL
from benchmarks.api import base_url, serve

TURNS = 5


def test_a_session_uses_one_tcp_connection_for_all_its_turns() -> None:
    with serve() as server, Session(base_url(server), MODEL) as s:
        for i in range(TURNS):
            assert s.send(f"turn {i}").text == "Hello there."
        assert server.connections == 1


def test_stream_and_until_done_also_release_the_connection() -> None:
    with serve() as server, Session(base_url(server), MODEL) as s:
        for i in range(TURNS):
            with s.stream(f"turn {i}") as events:
                assert events.until_done().request_id == "local-1"
        assert server.connections == 1


async def test_an_async_session_uses_one_tcp_connection_too() -> None:
    with serve() as server:
        async with AsyncSession(base_url(server), MODEL) as s:
            for i in range(TURNS):
                assert (await s.send(f"turn {i}")).text == "Hello there."
        assert server.connections == 1


def test_forks_share_the_pool() -> None:
    with serve() as server, Session(base_url(server), MODEL) as s:
        s.send("a")
        s.fork().send("b")
        s.with_options(timeout=5).send("c")
        assert server.connections == 1


def test_the_count_sees_a_client_without_reuse() -> None:
    """The counter is not blind: a client that keeps no connections opens one per turn."""
    client = httpx.Client(limits=httpx.Limits(max_keepalive_connections=0))
    with serve() as server, client, Session(base_url(server), MODEL, http_client=client) as s:
        for i in range(3):
            s.send(f"turn {i}")
        assert server.connections == 3
