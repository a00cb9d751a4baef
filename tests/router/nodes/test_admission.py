"""The decode gate: a leg goes to a decode node only when the node has KV room for it,
turns wait in line, and a waiting turn's handle is given up when nothing else frees room."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest
from fakes import FakeCluster, router_stack
from fakes.nodes import Stack
from kvagent_server.router.nodes.admission import Admitted, DecodeGate, NoRoom
from kvagent_server.router.nodes.ledger import LegLedger
from kvagent_server.router.nodes.registry import Node
from router_client import LONG, no_wrong_kv, turn


@dataclass
class FakeDecode:
    """A decode node's blocks: unclaimed retained handles (evictable), pinned handles
    (claimed by waiting turns, by request id) and blocks nobody the router knows holds."""

    total: int
    unclaimed: list[int] = field(default_factory=list)  # oldest first
    pinned: dict[str, int] = field(default_factory=dict)
    other: int = 0
    reports: bool = True  # its /metrics has the block count
    stalled: bool = False  # nothing runs while requests wait
    released: list[str] = field(default_factory=list)
    evictions: list[int] = field(default_factory=list)
    #: Blocks of handles given up elsewhere (the watermark's round) whose release has not
    #: reached the node yet: out of the store, still in its figure.
    on_its_way: int = 0

    @property
    def used(self) -> int:
        return sum(self.unclaimed) + sum(self.pinned.values()) + self.other + self.on_its_way


def _gate(d: FakeDecode, room: LegLedger, *, max_wait_s: float = 2.0,
          settle_s: float = 3.0) -> DecodeGate:
    async def refresh(node: Node) -> None:
        if d.reports:
            room.observe(node.name, total_blocks=d.total, usage=d.used / d.total,
                         read_at=time.monotonic(), stalled=d.stalled)

    async def make_room(node: Node, blocks: int) -> int:
        freed = 0
        while d.unclaimed and freed < blocks:
            freed += d.unclaimed.pop(0)
        if freed:
            d.evictions.append(freed)
        return freed

    async def release(node: Node, ids: list[str]) -> None:
        for rid in ids:
            d.pinned.pop(rid, None)
            d.released.append(rid)

    return DecodeGate(room, make_room=make_room, refresh=refresh, release=release,
                      max_wait_s=max_wait_s, poll_s=0.01, settle_s=settle_s,
                      room_on_its_way=lambda node: d.on_its_way > 0)


NODE = Node(name="d0", url="http://d0", role="decode", healthy=True)


def _leg(room: LegLedger) -> int:
    """A D leg for the node, waiting for its room (not sent)."""
    return room.open(NODE.name, role="decode", stream=True, sent=False, now=time.monotonic())


def _running(room: LegLedger) -> int:
    """A leg the router sent to the node that has not ended (the node is busy)."""
    return room.open(NODE.name, role="decode", stream=True, now=time.monotonic())


async def _admit(gate: DecodeGate, blocks: int, *, pinned: str | None = None,
                 pinned_blocks: int = 0, freed_by_p: bool = False) -> Admitted:
    """A new D leg's admission to the node."""
    return await gate.admit(NODE, _leg(gate.ledger), blocks, pinned=pinned,
                            pinned_blocks=pinned_blocks, freed_by_p=freed_by_p)


async def test_admits_at_once_with_room_and_without_a_known_size() -> None:
    d, room = FakeDecode(total=100, unclaimed=[30], reports=False), LegLedger()
    gate = _gate(d, room)
    unknown = await _admit(gate, 500)  # no block count: nothing to promise against
    assert not unknown.promised and not unknown.revoked
    d.reports = True
    a = await _admit(gate, 60)  # read first: the router may have just started
    assert a.promised and room.free("d0", time.monotonic()) == 10
    assert not d.evictions


async def test_evicts_unclaimed_handles_for_the_shortfall_only() -> None:
    d, room = FakeDecode(total=100, unclaimed=[20, 20, 20, 20]), LegLedger()
    gate = _gate(d, room)
    await gate.refresh(NODE)
    a = await _admit(gate, 50)
    assert a.promised and not a.revoked
    assert d.evictions == [40] and d.unclaimed == [20, 20]  # 30 short: the two oldest


async def test_waits_for_a_release_on_its_way_before_evicting_by_the_figure() -> None:
    # The watermark gave a handle up (out of the store) and its release is on its way:
    # evicting by the figure now would take the last handle, one a session will reuse.
    d = FakeDecode(total=100, unclaimed=[30], other=30, on_its_way=30)
    room = LegLedger()
    gate = _gate(d, room)
    await gate.refresh(NODE)

    async def released() -> None:
        await asyncio.sleep(0.05)
        d.on_its_way = 0

    task = asyncio.create_task(released())
    a = await asyncio.wait_for(_admit(gate, 40), 2)
    await task
    assert a.promised and not d.evictions and d.unclaimed == [30]


async def test_a_release_that_never_shows_is_waited_for_only_settle_s() -> None:
    d = FakeDecode(total=100, unclaimed=[30], other=30, on_its_way=30)
    room = LegLedger()
    gate = _gate(d, room, settle_s=0.1)
    await gate.refresh(NODE)
    t0 = time.monotonic()
    a = await asyncio.wait_for(_admit(gate, 40), 2)
    assert a.promised and d.evictions == [30] and time.monotonic() - t0 >= 0.1


async def test_a_turn_may_count_the_handle_its_own_pull_frees() -> None:
    d, room = FakeDecode(total=100, pinned={"h1": 60}, other=30), LegLedger()
    gate = _gate(d, room)
    await gate.refresh(NODE)
    a = await _admit(gate, 65, pinned="h1", pinned_blocks=60, freed_by_p=True)
    assert a.promised and not a.revoked and not d.released


async def test_waits_in_line_for_legs_in_flight() -> None:
    d, room = FakeDecode(total=100, other=80), LegLedger()
    running = _running(room)
    gate = _gate(d, room)
    await gate.refresh(NODE)
    order: list[str] = []

    async def turn(name: str, blocks: int) -> None:
        await _admit(gate, blocks)
        order.append(name)

    first = asyncio.create_task(turn("first", 50))
    await asyncio.sleep(0.05)
    second = asyncio.create_task(turn("second", 5))  # would fit, but waits its turn
    await asyncio.sleep(0.05)
    assert order == [] and not first.done() and not second.done()
    d.other = 0  # the leg in flight ended
    assert room.close(running, time.monotonic())
    await asyncio.wait_for(asyncio.gather(first, second), 2)
    assert order == ["first", "second"] and not d.released


async def test_gives_up_the_newest_waiters_handle_when_nothing_else_frees_room() -> None:
    # D holds only two conversations' handles, each claimed by a turn that waits: the
    # P/D deadlock's shape. The first in line has no handle of its own on D.
    d = FakeDecode(total=100, pinned={"older": 45, "newer": 45})
    room = LegLedger()
    gate = _gate(d, room)
    await gate.refresh(NODE)
    running = _running(room)
    leg_a, leg_b = _leg(room), _leg(room)
    first = asyncio.create_task(gate.admit(NODE, leg_a, 40))
    await asyncio.sleep(0.02)
    older = asyncio.create_task(gate.admit(NODE, leg_b, 50, pinned="older",
                                           pinned_blocks=45, freed_by_p=True))
    newer = asyncio.create_task(_admit(gate, 50, pinned="newer", pinned_blocks=45,
                                       freed_by_p=True))
    await asyncio.sleep(0.05)
    assert not first.done() and not d.released  # legs in flight: wait for them
    room.close(running, time.monotonic())
    a = await asyncio.wait_for(first, 2)
    assert a.promised and d.released == ["newer"]
    # The first turn's leg is on D: the older turn fits, counting the handle its pull frees.
    room.sent(leg_a, NODE.name, time.monotonic())
    room.first_token(leg_a, time.monotonic())
    d.other = 40
    b = await asyncio.wait_for(older, 2)
    assert not b.revoked and d.released == ["newer"]
    # Both legs end; D retains them unclaimed, evictable: the newer turn, whose handle
    # is gone, is admitted to recompute.
    assert b.promised
    room.sent(leg_b, NODE.name, time.monotonic())
    room.first_token(leg_b, time.monotonic())
    room.close(leg_a, time.monotonic())
    room.close(leg_b, time.monotonic())
    d.pinned.pop("older")
    d.other, d.unclaimed = 0, [40, 50]
    c = await asyncio.wait_for(newer, 2)
    assert c.revoked and c.promised and d.evictions == [40]


async def test_the_only_waiter_gives_up_its_own_handle() -> None:
    d, room = FakeDecode(total=100, pinned={"mine": 70}, other=25), LegLedger()
    gate = _gate(d, room)
    await gate.refresh(NODE)
    # d_direct reuses its handle in place (no credit) and needs 10 more blocks
    a = await asyncio.wait_for(_admit(gate, 10, pinned="mine", pinned_blocks=70), 2)
    assert a.revoked and d.released == ["mine"]


async def test_refused_when_what_holds_the_room_is_not_the_routers() -> None:
    d, room = FakeDecode(total=100, other=95), LegLedger()
    gate = _gate(d, room, max_wait_s=0.1)
    await gate.refresh(NODE)
    with pytest.raises(NoRoom) as err:
        await _admit(gate, 20)
    assert err.value.status == 503
    # more than the node holds at all: not the gate's to refuse (vLLM answers)
    assert (await _admit(gate, 500)).promised


async def test_a_stalled_node_gives_up_a_waiters_handle_though_legs_are_on_it() -> None:
    # A leg on D waits for blocks (nothing runs): it will not end by itself, so waiting
    # for it is no way to room.
    d = FakeDecode(total=100, pinned={"h": 60}, other=30, stalled=True)
    room = LegLedger()
    _running(room)
    gate = _gate(d, room, max_wait_s=1.0)
    await gate.refresh(NODE)
    first = asyncio.create_task(_admit(gate, 40))
    waiter = asyncio.create_task(_admit(gate, 5, pinned="h", pinned_blocks=60))
    a = await asyncio.wait_for(first, 2)
    assert a.promised and d.released == ["h"]
    assert (await asyncio.wait_for(waiter, 2)).revoked


@contextlib.asynccontextmanager
async def two_retained() -> AsyncIterator[tuple[Stack, FakeCluster, list[str]]]:
    """The router on fake nodes, D (64 blocks) holding two retained conversations of ~30
    blocks each, oldest first in the list; no watermark eviction below 100 %, so only the
    decode-room gate frees room. P/D always (no path computes on D)."""
    cluster = FakeCluster(kv_blocks=64)
    async with router_stack(cluster=cluster,
                            policy={"params": {"skip_prefill_max_tokens": 0,
                                               "fresh_on_decode": "never"}},
                            retention={"high_watermark": 1.0, "low_watermark": 0.9,
                                       "check_interval_s": 0.05}) as st:
        d = st.decode[0]
        for i in range(2):
            await turn(st, [{"role": "user", "content": f"conversation {i}: {LONG}"}],
                       session=f"s{i}")
        retained = [r.request_id for r in cluster.retained.values()
                    if r.engine_id == d.engine_id]
        assert len(retained) == 2 and d.kv_usage() > 0.9
        yield st, cluster, retained


async def test_a_turn_with_no_room_on_decode_evicts_the_oldest_handle_first() -> None:
    """Through the router (fake nodes that report what they retain): a first turn that
    does not fit beside two retained conversations makes room by evicting the oldest."""
    async with two_retained() as (st, cluster, retained):
        assert not cluster.events_of("release")
        # The fake renders ~1.6 tokens a character, real tokenizers ~0.3: what the router
        # learns of the ratio from two turns is still far below, and a first turn's size
        # is estimated by it. Learned in full:
        st.app.state.router.learned.prompt_chars.ratio = 1.6
        kva, _, _ = await turn(st, [{"role": "user", "content": f"conversation 2: {LONG}"}],
                               session="s2")
        assert kva["path"] == "pd_fresh"
        released = [e.detail["id"] for e in cluster.events_of("release")]
        assert released and released == retained[:len(released)]  # the oldest first
        metrics = (await st.client.get("/metrics")).text
        assert "kvagent_router_decode_room_waits_total 1.0" in metrics
        no_wrong_kv(st)


async def test_a_first_turn_longer_than_estimated_tops_its_room_up() -> None:
    """A first turn's size is estimated from its body: one that tokenizes far denser than
    the router learned (code, identifiers, base64) fits beside the retained
    conversations by its estimate, so the gate admits it at once. P then reports the real
    prompt, too large for what is left, and the oldest handle is evicted before the D leg
    goes (else D waits, nothing running, for blocks only a TTL frees)."""
    async with two_retained() as (st, cluster, retained):
        await asyncio.sleep(0.3)  # the guard has read D holding both
        st.app.state.router.learned.prompt_chars.ratio = 0.05  # ~2 blocks, really ~20
        kva, _, _ = await turn(st, [{"role": "user", "content": f"conversation 2: {LONG}"}],
                               session="s2")
        assert kva["path"] == "pd_fresh"
        released = [e.detail["id"] for e in cluster.events_of("release")]
        assert released == retained[:1]  # the oldest, for what the estimate missed
        metrics = (await st.client.get("/metrics")).text
        assert "kvagent_router_decode_room_waits_total 0.0" in metrics  # never waited
        no_wrong_kv(st)


async def test_top_up_evicts_only_what_the_growth_leaves_short() -> None:
    d, room = FakeDecode(total=100, unclaimed=[20, 20, 20]), LegLedger()
    gate = _gate(d, room)
    await gate.refresh(NODE)  # 60 retained, 40 free
    leg = _leg(room)
    assert (await gate.admit(NODE, leg, 30)).promised and not d.evictions
    assert await gate.top_up(NODE, room.resize(leg, 35)) == 0  # grew by 5: still fits
    assert await gate.top_up(NODE, room.resize(leg, 55)) == 20  # 15 short: one handle
    assert d.evictions == [20] and d.unclaimed == [20, 20]
    assert room.resize(leg, 10) == 0  # shrinking frees its promise, evicts nothing
    assert await gate.top_up(NODE, 0) == 0 and d.evictions == [20]


async def test_top_up_reads_the_node_before_it_evicts() -> None:
    d, room = FakeDecode(total=100, unclaimed=[20, 20, 20]), LegLedger()
    gate = _gate(d, room)
    await gate.refresh(NODE)  # 60 retained, 40 free
    leg = _leg(room)
    assert (await gate.admit(NODE, leg, 30)).promised
    d.unclaimed.pop(0)  # released since the last read (the watermark's round)
    assert await gate.top_up(NODE, room.resize(leg, 55)) == 0  # 5 to spare, not 15 short
    assert not d.evictions and d.unclaimed == [20, 20]
    # ... and after a release on its way
    d.unclaimed, d.on_its_way = [20], 20
    assert room.resize(leg, 30) == 0
    await gate.refresh(NODE)
    task = asyncio.create_task(asyncio.sleep(0.05))
    task.add_done_callback(lambda _: setattr(d, "on_its_way", 0))
    assert await gate.top_up(NODE, room.resize(leg, 65)) == 0  # 5 to spare once it is gone
    assert not d.evictions and d.unclaimed == [20]
