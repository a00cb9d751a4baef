"""`x-request-id` on every router response, as vLLM's server sends it when started with
`--enable-request-id-headers`: the client's own `X-Request-Id` echoed, else a fresh uuid4
hex; and the SDK's `request_id` is that header (fake nodes, real sockets)."""

from __future__ import annotations

import asyncio
import re

from fakes import router_stack
from kvagent import AsyncSession, Session
from router_client import FIRST, chat_body

MODEL = "fake-model"
HEX = re.compile(r"[0-9a-f]{32}")


async def test_every_response_has_a_fresh_request_id() -> None:
    async with router_stack() as st:
        streamed = await st.client.post("/v1/chat/completions", json=chat_body(FIRST))
        whole = await st.client.post("/v1/chat/completions",
                                     json=chat_body(FIRST, stream=False))
        bad = await st.client.post("/v1/chat/completions", json=chat_body("hello"))
        missing = await st.client.get("/v1/no-such-route")
        models = await st.client.get("/v1/models")
        answers = [streamed, whole, bad, missing, models]
        assert [r.status_code for r in answers] == [200, 200, 400, 404, 200]
        ids = [r.headers.get("x-request-id") for r in answers]
        assert all(i is not None and HEX.fullmatch(i) for i in ids), ids
        assert len(set(ids)) == len(ids)
        assert all(len(r.headers.get_list("x-request-id")) == 1 for r in answers)


async def test_the_clients_request_id_is_echoed_and_not_sent_to_nodes() -> None:
    async with router_stack() as st:
        for stream in (True, False):
            r = await st.client.post("/v1/chat/completions", json=chat_body(FIRST, stream=stream),
                                     headers={"X-Request-Id": "client-id-7"})
            assert r.status_code == 200 and r.headers["x-request-id"] == "client-id-7"
            # A node that got it would name its request after it (vLLM does; so do the fakes).
            assert "client-id-7" not in r.text
        assert st.nodes and all(n.requests for n in st.decode)


async def test_sdk_result_request_id_is_the_routers() -> None:
    async with router_stack() as st:
        async with AsyncSession(f"{st.url}/v1", MODEL, session_id="rid-1") as s:
            first = await s.send("Tell me about the sea. " * 5)
            mine = await s.send("And the mountains?", headers={"X-Request-Id": "mine-2"})
        assert first.request_id is not None and HEX.fullmatch(first.request_id)
        assert first.headers["x-request-id"] == first.request_id
        assert mine.request_id == "mine-2"

        def sync_turn() -> str | None:
            with Session(f"{st.url}/v1", MODEL, session_id="rid-2") as s:
                return s.send("Describe a lighthouse.").request_id

        rid = await asyncio.to_thread(sync_turn)
        assert rid is not None and HEX.fullmatch(rid)
