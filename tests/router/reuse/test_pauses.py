"""Learned tool pauses: per tenant and tool name, from the gap before a session's next
turn, and bounded."""

from __future__ import annotations

import pytest
from kvagent_server.router.reuse.pauses import ToolPauses
from kvagent_server.router.store.handle import TurnEnd


def tool_end(at: float, *tools: str) -> TurnEnd:
    return TurnEnd(kind="tool_call", tools=tools, at=at)


def test_a_tool_pause_is_the_gap_to_the_sessions_next_turn() -> None:
    p = ToolPauses(gain=0.5)
    p.ended("t", "s", tool_end(100.0, "grep"))
    assert p.resumed("t", "s", 110.0) == 10.0
    stats = p.get("t", "grep")
    assert stats is not None and (stats.mean_s, stats.samples) == (10.0, 1)
    p.ended("t", "s", tool_end(200.0, "grep"))
    assert p.resumed("t", "s", 230.0) == 30.0
    stats = p.get("t", "grep")
    assert stats is not None and (stats.mean_s, stats.samples) == (20.0, 2)
    assert stats.dev_s == pytest.approx(0.5 * 5 + 0.5 * 20)  # running mean deviation
    # Once learned from, the end is spent: a second resume learns nothing.
    assert p.resumed("t", "s", 240.0) is None


def test_only_tool_call_ends_teach_and_each_tool_of_a_parallel_call() -> None:
    p = ToolPauses()
    p.ended("t", "a", TurnEnd(kind="final", at=0.0))
    assert p.resumed("t", "a", 50.0) is None
    p.ended("t", "b", tool_end(0.0, "x", "y"))
    assert p.resumed("t", "b", 7.0) == 7.0
    assert p.get("t", "x") is not None and p.get("t", "y") is not None
    assert p.resumed("t", "never", 1.0) is None
    p.ended("t", "c", tool_end(100.0, "x"))  # clocks apart: a negative gap is no pause
    assert p.resumed("t", "c", 90.0) is None


def test_the_claimed_handles_end_teaches_when_this_replica_saw_no_end() -> None:
    p = ToolPauses()
    assert p.resumed("t", "s", 12.0, tool_end(10.0, "fetch")) == 2.0
    stats = p.get("t", "fetch")
    assert stats is not None and stats.mean_s == 2.0


def test_tenants_learn_apart() -> None:
    p = ToolPauses()
    p.ended("t", "s", tool_end(0.0, "search"))
    p.resumed("t", "s", 5.0)
    assert p.get("u", "search") is None
    assert set(p.view()) == {("t", "search")}


def test_state_is_bounded_least_recently_used_first() -> None:
    p = ToolPauses(max_tools=3, max_sessions=2)
    for i in range(5):
        p.ended("t", f"s{i}", tool_end(0.0, f"tool{i}"))
    # Only the last two sessions' ends are kept.
    assert p.resumed("t", "s0", 1.0) is None and p.resumed("t", "s1", 1.0) is None
    assert p.resumed("t", "s3", 1.0) == 1.0 and p.resumed("t", "s4", 1.0) == 1.0
    for i in range(5):
        p.resumed("t", "x", 1.0, tool_end(0.0, f"t{i}"))
    p.resumed("t", "x", 1.0, tool_end(0.0, "t2"))  # used again: the most recent
    p.resumed("t", "x", 1.0, tool_end(0.0, "t5"))
    assert len(p) == 3 and set(p.view()) == {("t", "t4"), ("t", "t2"), ("t", "t5")}
    with pytest.raises(ValueError):
        ToolPauses(max_tools=0)
    with pytest.raises(ValueError):
        ToolPauses(gain=0)


def test_view_is_a_copy() -> None:
    p = ToolPauses()
    p.resumed("t", "s", 3.0, tool_end(0.0, "a"))
    view = p.view()
    p.resumed("t", "s", 9.0, tool_end(0.0, "a"))
    assert view[("t", "a")].samples == 1
