"""The decode nodes' free KV blocks as the router knows them (pure)."""

from __future__ import annotations

import pytest
from kvagent_server.router.kv.room import DecodeRoom, blocks_for


def test_blocks_for_counts_the_partial_block_and_one_to_generate_into() -> None:
    assert blocks_for(0, 128) == 1
    assert blocks_for(128, 128) == 2
    assert blocks_for(129, 128) == 3
    with pytest.raises(ValueError):
        blocks_for(10, 0)


def test_unknown_until_the_node_reports_its_size() -> None:
    room = DecodeRoom()
    assert room.free("d0", now=0.0) is None and room.total("d0") is None
    room.observe("d0", total_blocks=0, usage=0.5, read_at=0.0)  # no size: ignored
    assert room.free("d0", now=0.0) is None


def test_promises_count_until_a_read_after_their_allocation_shows_them() -> None:
    room = DecodeRoom()
    room.observe("d0", total_blocks=100, usage=0.25, read_at=1.0)
    assert room.free("d0", now=1.0) == 75
    t = room.promise("d0", 30, now=2.0)
    assert room.free("d0", now=2.0) == 45 and room.promised("d0") == 30
    room.observe("d0", total_blocks=100, usage=0.25, read_at=3.0)  # not allocated yet
    assert room.free("d0", now=3.0) == 45
    room.allocated(t, now=4.0)
    room.observe("d0", total_blocks=100, usage=0.25, read_at=3.5)  # began before: kept
    assert room.free("d0", now=4.0) == 45
    room.observe("d0", total_blocks=100, usage=0.55, read_at=5.0)  # shows the leg
    assert room.free("d0", now=5.0) == 45 and room.promised("d0") == 0
    room.cancel(t)  # after the promise ended: nothing to undo
    assert room.free("d0", now=5.0) == 45


def test_a_late_answer_to_an_older_read_is_ignored() -> None:
    room = DecodeRoom()
    room.observe("d0", total_blocks=100, usage=0.5, read_at=2.0)
    room.observe("d0", total_blocks=100, usage=0.0, read_at=1.0)
    assert room.free("d0", now=3.0) == 50


def test_cancel_resize_and_expiry() -> None:
    room = DecodeRoom(max_age_s=10)
    room.observe("d0", total_blocks=100, usage=0.0, read_at=0.0)
    room.observe("d1", total_blocks=50, usage=0.0, read_at=0.0)
    a = room.promise("d0", 20, now=0.0)
    b = room.promise("d0", 10, now=5.0)
    room.promise("d1", 7, now=5.0)
    assert room.free("d0", now=5.0) == 70 and room.free("d1", now=5.0) == 43
    room.resize(b, 25)  # the real prompt was longer than estimated
    assert room.free("d0", now=5.0) == 55
    room.cancel(a)
    room.cancel(a)  # idempotent
    assert room.free("d0", now=5.0) == 75
    assert room.free("d0", now=16.0) == 100  # b is older than max_age_s: dropped
    with pytest.raises(ValueError):
        room.promise("d0", -1, now=0.0)
    with pytest.raises(ValueError):
        DecodeRoom(max_age_s=0)
