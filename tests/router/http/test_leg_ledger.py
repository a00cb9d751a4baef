"""Through the router (fake nodes): every leg it opens in its ledger leaves it exactly once,
whatever ends it — answered, failed before its first byte, cut mid-stream, its client gone
mid-stream or mid-prefill — so no count of legs in flight drifts (the ledger itself:
tests/router/nodes/test_ledger.py)."""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

import httpx
import pytest
from fakes import FakeCluster, Reply, router_stack
from kvagent_server.router.nodes.ledger import LegLedger
from router_client import FIRST, chat_body, turn


class Spy:
    """Records each leg opened and each close, and whether the close ended the leg."""

    def __init__(self, ledger: LegLedger) -> None:
        self.opened: list[int] = []
        self.ended: Counter[int] = Counter()
        real_open, real_close = ledger.open, ledger.close

        def open_(*args: Any, **kw: Any) -> int:
            ticket = real_open(*args, **kw)
            self.opened.append(ticket)
            return ticket

        def close(ticket: int, now: float) -> bool:
            ended = real_close(ticket, now)
            self.ended[ticket] += ended
            return ended

        ledger.open, ledger.close = open_, close  # type: ignore[method-assign]

    def assert_each_leg_ended_once(self) -> None:
        assert self.opened
        assert sorted(self.ended) == sorted(self.opened)  # none leaked, none forgotten
        assert set(self.ended.values()) == {1}


async def _until(check: Any, what: str) -> None:
    for _ in range(500):
        if check():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(what)


async def _idle(st: Any) -> None:
    ledger: LegLedger = st.router.ledger
    names = list(st.router.registry.nodes)
    await _until(lambda: all(ledger.in_flight(n) == 0 for n in names), "legs still in flight")


async def test_answered_and_failed_legs_end_once() -> None:
    async with router_stack(n_decode=2) as st:
        spy = Spy(st.router.ledger)
        await turn(st, FIRST)  # answered, streamed
        r = await st.client.post("/v1/chat/completions", json=chat_body(FIRST, stream=False))
        assert r.status_code == 200  # answered whole
        for d in st.decode:  # D fails before its first byte everywhere: the turn fails
            d.fail_next = [503]
        r = await st.client.post("/v1/chat/completions", json=chat_body(FIRST),
                                 headers={"X-Session-ID": "fails"})
        assert r.status_code == 502
        await _idle(st)
        spy.assert_each_leg_ended_once()


async def test_cut_and_abandoned_legs_end_once() -> None:
    cluster = FakeCluster(token_delay_s=0.02, reply=lambda p: Reply(content="word " * 100))
    async with router_stack(cluster=cluster) as st:
        spy = Spy(st.router.ledger)
        st.decode[0].cut_after_chunks = 3  # the node cuts the stream
        with pytest.raises(httpx.HTTPError):
            async with st.client.stream("POST", "/v1/chat/completions",
                                        json=chat_body(FIRST)) as r:
                async for _ in r.aiter_raw():
                    pass
        st.decode[0].cut_after_chunks = None
        async with st.client.stream("POST", "/v1/chat/completions",
                                    json=chat_body(FIRST)) as r:
            async for _ in r.aiter_raw():
                break  # the client leaves mid-stream
        await _until(lambda: st.decode[0].aborted, "D's stream was not aborted")
        cluster.prefill_delay_s = 5.0
        request = asyncio.create_task(
            st.client.post("/v1/chat/completions", json=chat_body(FIRST)))
        await _until(lambda: st.router.ledger.in_flight("p0") == 1, "no P leg in flight")
        request.cancel()  # the client leaves mid-prefill
        with pytest.raises(asyncio.CancelledError):
            await request
        await _until(lambda: st.prefill[0].aborted, "P's leg was not cancelled")
        await _idle(st)
        spy.assert_each_leg_ended_once()
