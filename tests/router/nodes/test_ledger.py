"""The router's one ledger of legs in flight (pure): what each view of it answers, and that
a leg leaves it exactly once whatever ends it."""

from __future__ import annotations

import time

import pytest
from kvagent_server.router.nodes.ledger import LegLedger, blocks_for
from kvagent_server.router.nodes.registry import NodeRegistry
from kvagent_server.router.reuse.queue import IDLE, NodeWork


def _room(led: LegLedger, node: str, blocks: int, *, now: float, tokens: int = 0) -> int:
    """A D leg admitted to `node` with `blocks` promised, not sent yet."""
    leg = led.open(node, role="decode", tokens=tokens, stream=True, sent=False, now=now)
    led.promise(leg, blocks)
    return leg


# ------------------------------------------------------------------ legs in flight


def test_in_flight_counts_legs_sent_until_they_close() -> None:
    led = LegLedger()
    p = led.open("p0", role="prefill", tokens=100, now=0.0)
    d = led.open("d0", role="decode", stream=True, sent=False, now=0.0)
    assert (led.in_flight("p0"), led.in_flight("d0")) == (1, 0)  # d waits for its P leg
    led.sent(d, "d0", 1.0)
    assert led.in_flight("d0") == 1
    assert led.close(p, 1.0) and led.in_flight("p0") == 0
    led.first_token(d, 2.0)  # still decoding: still in flight
    assert led.in_flight("d0") == 1
    assert led.close(d, 3.0) and led.in_flight("d0") == 0 and len(led) == 0


def test_a_leg_closes_exactly_once() -> None:
    """Errors, cancellations and a client gone may all reach a leg's close: only the
    first one counts, and no count goes below what is really in flight."""
    led = LegLedger()
    legs = [led.open("d0", role="decode", stream=True, now=0.0) for _ in range(3)]
    assert led.in_flight("d0") == 3
    assert led.close(legs[0], 1.0)
    assert [led.close(legs[0], 1.0) for _ in range(3)] == [False] * 3
    assert led.in_flight("d0") == 2
    assert not led.close(999, 1.0)  # never opened
    assert led.work("d0", now=1.0, per_token_s=1e-3).streams == 2
    # a leg closed is done with: nothing later revives it
    led.first_token(legs[0], 2.0)
    led.sent(legs[0], "d1", 2.0)
    led.promise(legs[0], 10)
    assert led.in_flight("d1") == 0 and led.promised("d1") == 0


def test_a_retry_elsewhere_moves_the_leg_and_what_it_carries() -> None:
    led = LegLedger()
    led.observe("d1", total_blocks=100, usage=0.0, read_at=0.0)
    leg = _room(led, "d0", 30, now=0.0, tokens=200)
    led.sent(leg, "d0", 1.0)
    led.sent(leg, "d1", 2.0)  # d0 failed before its first byte
    assert (led.in_flight("d0"), led.in_flight("d1")) == (0, 1)
    assert led.work("d1", now=2.0, per_token_s=0.0) == NodeWork(prefill_tokens=200,
                                                                 streams=1, prompts=1)
    assert led.promised("d0") == 0 and led.free("d1", 2.0) == 70


def test_the_registry_ranks_and_places_by_the_ledgers_legs() -> None:
    """Placement's load is the ledger's count: a stream decoding on d0 makes d1 the least
    loaded until it ends."""
    reg = NodeRegistry(["http://p:1"], ["http://d:1", "http://d:2"])
    for node in reg.nodes.values():
        node.mark_up()
    leg = reg.ledger.open("d0", role="decode", stream=True, now=time.monotonic())
    assert [n.name for n in reg.ranked("decode")] == ["d1", "d0"]
    assert {s.node_id: s.in_flight for s in reg.states()} == {"p0": 0, "d0": 1, "d1": 0}
    reg.ledger.close(leg, time.monotonic())
    assert [n.name for n in reg.ranked("decode")] == ["d0", "d1"]


# ------------------------------------------------------------------ work ahead (queue.NodeWork)


def test_work_counts_tokens_and_streams_per_node() -> None:
    led = LegLedger()
    p1 = led.open("p0", role="prefill", tokens=2000, now=0.0)
    led.open("p0", role="prefill", tokens=500, now=0.0)
    d1 = led.open("d0", role="decode", tokens=150, stream=True, now=0.0)
    led.open("d0", role="decode", stream=True, now=0.0)
    assert led.work("p0", now=0.0, per_token_s=1e-3) == NodeWork(prefill_tokens=2500, prompts=2)
    assert led.work("d0", now=0.0, per_token_s=1e-3) == NodeWork(prefill_tokens=150, streams=2,
                                                              prompts=1)
    assert led.work("p1", now=0.0, per_token_s=1e-3) == IDLE
    led.first_token(d1, 0.05)  # the delta's first token: it decodes from now on
    assert led.work("d0", now=0.05, per_token_s=1e-3) == NodeWork(streams=2)
    led.close(d1, 1.0)
    assert led.work("d0", now=1.0, per_token_s=1e-3) == NodeWork(streams=1)
    led.close(p1, 2.0)
    assert led.work("p0", now=2.0, per_token_s=1e-3) == NodeWork(prefill_tokens=500,
                                                                      prompts=1)


def test_work_counts_only_legs_sent() -> None:
    """A D leg admitted while its P leg runs is not on D yet: no stream there."""
    led = LegLedger()
    led.open("d0", role="decode", stream=True, sent=False, now=0.0)
    assert led.work("d0", now=0.0, per_token_s=1e-3) == IDLE


def test_work_counts_progress_since_the_node_last_finished() -> None:
    led = LegLedger()
    big = led.open("p0", role="prefill", tokens=2000, now=10.0)
    # 0.5 s at 1 ms/token: a quarter of it done
    assert led.work("p0", now=10.5, per_token_s=1e-3).prefill_tokens == pytest.approx(1500)
    assert led.work("p0", now=13.0, per_token_s=1e-3).prefill_tokens == 0  # overdue: 0
    led.close(big, 13.0)
    first = led.open("p0", role="prefill", tokens=1000, now=20.0)
    led.open("p0", role="prefill", tokens=1000, now=20.0)
    led.close(first, 21.0)  # the second one starts only now
    assert led.work("p0", now=21.2, per_token_s=1e-3).prefill_tokens == pytest.approx(800)


def test_legs_never_closed_are_forgotten() -> None:
    led = LegLedger(max_age_s=60)
    leg = led.open("d0", role="decode", stream=True, now=0.0)
    assert led.work("d0", now=59.0, per_token_s=1e-3).streams == 1
    assert led.work("d0", now=61.0, per_token_s=1e-3).streams == 0
    assert led.in_flight("d0") == 0 and not led.close(leg, 62.0)


def test_rejects_bad_input() -> None:
    led = LegLedger()
    with pytest.raises(ValueError):
        led.open("p0", role="prefill", tokens=-1, now=0.0)
    with pytest.raises(ValueError):
        led.promise(led.open("d0", role="decode", now=0.0), -1)
    with pytest.raises(ValueError):
        LegLedger(max_age_s=0)


# ------------------------------------------------------------------ decode room


def test_blocks_for_counts_the_partial_block_and_one_to_generate_into() -> None:
    assert blocks_for(0, 128) == 1
    assert blocks_for(128, 128) == 2
    assert blocks_for(129, 128) == 3
    with pytest.raises(ValueError):
        blocks_for(10, 0)


def test_room_unknown_until_the_node_reports_its_size() -> None:
    led = LegLedger()
    assert led.free("d0", now=0.0) is None and led.total("d0") is None
    led.observe("d0", total_blocks=0, usage=0.5, read_at=0.0)  # no size: ignored
    assert led.free("d0", now=0.0) is None


def test_promises_count_until_a_read_after_their_allocation_shows_them() -> None:
    led = LegLedger()
    led.observe("d0", total_blocks=100, usage=0.25, read_at=1.0)
    assert led.free("d0", now=1.0) == 75
    t = _room(led, "d0", 30, now=2.0)
    assert led.free("d0", now=2.0) == 45 and led.promised("d0") == 30
    led.sent(t, "d0", 2.5)
    led.observe("d0", total_blocks=100, usage=0.25, read_at=3.0)  # not allocated yet
    assert led.free("d0", now=3.0) == 45
    led.first_token(t, now=4.0)
    led.observe("d0", total_blocks=100, usage=0.25, read_at=3.5)  # began before: kept
    assert led.free("d0", now=4.0) == 45
    led.observe("d0", total_blocks=100, usage=0.55, read_at=5.0)  # shows the leg
    assert led.free("d0", now=5.0) == 45 and led.promised("d0") == 0
    assert led.in_flight("d0") == 1  # the leg itself still decodes
    led.close(t, 6.0)
    assert led.free("d0", now=6.0) == 45 and len(led) == 0


def test_a_closed_leg_holds_its_blocks_until_a_read_shows_them() -> None:
    """A leg that allocated and ended before any read: its blocks are on the node (retained
    for the next turn) though it is no longer in flight."""
    led = LegLedger()
    led.observe("d0", total_blocks=100, usage=0.0, read_at=0.0)
    t = _room(led, "d0", 40, now=1.0)
    led.sent(t, "d0", 1.0)
    led.first_token(t, 2.0)
    assert led.close(t, 3.0) and led.in_flight("d0") == 0
    assert led.free("d0", now=3.0) == 60 and len(led) == 1
    assert not led.close(t, 3.0)  # already closed, though its blocks still count
    led.observe("d0", total_blocks=100, usage=0.4, read_at=4.0)
    assert led.free("d0", now=4.0) == 60 and len(led) == 0


def test_a_leg_that_never_allocated_frees_its_promise_when_closed() -> None:
    """Refused, failed, cancelled: nothing of its promise is on the node."""
    led = LegLedger()
    led.observe("d0", total_blocks=100, usage=0.0, read_at=0.0)
    t = _room(led, "d0", 40, now=1.0, tokens=300)
    led.sent(t, "d0", 1.5)
    assert led.free("d0", now=2.0) == 60
    assert led.close(t, 2.0)
    assert led.free("d0", now=2.0) == 100 and len(led) == 0


def test_a_late_answer_to_an_older_read_is_ignored() -> None:
    led = LegLedger()
    led.observe("d0", total_blocks=100, usage=0.5, read_at=2.0)
    led.observe("d0", total_blocks=100, usage=0.0, read_at=1.0)
    assert led.free("d0", now=3.0) == 50


def test_resize_and_expiry_of_promises() -> None:
    led = LegLedger(max_age_s=10)
    led.observe("d0", total_blocks=100, usage=0.0, read_at=0.0)
    led.observe("d1", total_blocks=50, usage=0.0, read_at=0.0)
    a = _room(led, "d0", 20, now=0.0)
    b = _room(led, "d0", 10, now=5.0)
    _room(led, "d1", 7, now=5.0)
    assert led.free("d0", now=5.0) == 70 and led.free("d1", now=5.0) == 43
    assert led.resize(b, 25) == 15  # the real prompt was longer than estimated
    assert led.free("d0", now=5.0) == 55
    led.close(a, 5.0)
    assert led.free("d0", now=5.0) == 75
    assert led.free("d0", now=16.0) == 100  # b is older than max_age_s: dropped
    unpromised = led.open("d0", role="decode", now=20.0)
    assert led.resize(unpromised, 10) == 0  # nothing was promised to it: nothing to resize
    assert led.promised("d0") == 0


def test_stalled_is_the_last_reads() -> None:
    led = LegLedger()
    assert not led.stalled("d0")
    led.observe("d0", total_blocks=10, usage=1.0, read_at=0.0, stalled=True)
    assert led.stalled("d0")
    led.observe("d0", total_blocks=10, usage=1.0, read_at=1.0)
    assert not led.stalled("d0")
