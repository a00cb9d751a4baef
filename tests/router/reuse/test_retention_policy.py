"""Retention policies on plain facts: which retained turns a decode node drops first."""

from __future__ import annotations

import pytest
from kvagent_server.router.reuse.pauses import PauseStats
from kvagent_server.router.reuse.retention_policy import (
    AWAY,
    RETENTION_POLICIES,
    SOON,
    ExpectedReturn,
    ExpectedReturnParams,
    NoParams,
    OldestFirst,
    RetentionFacts,
    register,
    retention_policy_for,
    take,
)
from kvagent_server.router.settings import RouterSettings
from kvagent_server.router.store.handle import Retained, TurnEnd

NOW = 10_000.0
#: Keeps only what is back within 10 s (the default keeps an unseen tool's 30 s prior).
SHORT_KEEP = ExpectedReturn(ExpectedReturnParams(keep_soon_s=10))


def held(hid: str, *, ended_ago: float, kind: str | None = "final", tools: tuple = (),
         blocks: int = 10, tenant: str = "t") -> Retained:
    at = NOW - ended_ago
    end = None if kind is None else TurnEnd(kind=kind, tools=tools, at=at)  # type: ignore[arg-type]
    return Retained(tenant=tenant, handle_id=hid, session=f"s-{hid}", blocks=blocks,
                    created_at=at, expires_at=at + 480, end=end)


def facts(handles: list[Retained], need: int = 1000, *, max_handles: int = 100,
          pauses: dict | None = None, waiting: bool = False) -> RetentionFacts:
    return RetentionFacts(handles=handles, need_blocks=need, max_handles=max_handles,
                          now=NOW, pauses=pauses or {}, for_waiting_turn=waiting)


def ids(chosen: list[Retained]) -> list[str]:
    return [h.handle_id for h in chosen]


def test_take_stops_once_the_blocks_are_covered_or_at_the_bound() -> None:
    hs = [held(f"h{i}", ended_ago=i, blocks=3) for i in range(5)]
    assert ids(take(hs, 5, 100)) == ["h0", "h1"]
    assert ids(take(hs, 0, 100)) == []
    assert ids(take(hs, -1, 3)) == ["h0", "h1", "h2"]  # size unknown: the bound
    assert ids(take(hs, 1000, 2)) == ["h0", "h1"]


def test_oldest_first_is_by_age_alone() -> None:
    hs = [held("tool", ended_ago=300, kind="tool_call", tools=("grep",)),
          held("final", ended_ago=100), held("new", ended_ago=5, kind=None)]
    assert ids(OldestFirst().choose(facts(hs, 15))) == ["tool", "final"]


def test_final_answers_go_before_a_session_waiting_on_a_tool() -> None:
    hs = [held("tool", ended_ago=300, kind="tool_call", tools=("build",)),
          held("final-new", ended_ago=1), held("final-old", ended_ago=50)]
    pauses = {("t", "build"): PauseStats(mean_s=400, dev_s=20, samples=5)}
    policy = ExpectedReturn()
    # The finals, the longest idle first, even though the tool session is older.
    assert ids(policy.choose(facts(hs, 15, pauses=pauses))) == ["final-old", "final-new"]
    # Only when they do not cover the need does the waiting session go.
    assert ids(policy.choose(facts(hs, 25, pauses=pauses))) == [
        "final-old", "final-new", "tool"]


def test_the_furthest_expected_return_goes_first_and_the_soonest_is_kept() -> None:
    pauses = {("t", "quick"): PauseStats(mean_s=20, dev_s=2, samples=9),
              ("t", "slow"): PauseStats(mean_s=600, dev_s=60, samples=9)}
    hs = [held("quick", ended_ago=15, kind="tool_call", tools=("quick",)),  # back in 5 s
          held("slow", ended_ago=15, kind="tool_call", tools=("slow",)),    # in 585 s
          held("unseen", ended_ago=0, kind="tool_call", tools=("new",))]    # prior: 30 s
    policy = SHORT_KEEP
    assert ids(policy.choose(facts(hs, pauses=pauses))) == ["slow", "unseen"]
    # The watermark keeps `quick` (back within keep_soon_s); a waiting turn takes it last.
    assert ids(policy.choose(facts(hs, pauses=pauses, waiting=True))) == [
        "slow", "unseen", "quick"]
    ranks = {h.handle_id: rank for rank, h in policy.rank(facts(hs, pauses=pauses))}
    assert ranks["quick"][0] == SOON and ranks["slow"][0] == AWAY
    # By default a session that just called a tool not seen yet is kept too.
    assert ids(ExpectedReturn().choose(facts(hs, pauses=pauses))) == ["slow"]


def test_a_session_long_past_its_tools_pause_counts_as_gone() -> None:
    pauses = {("t", "grep"): PauseStats(mean_s=5, dev_s=1, samples=20)}
    hs = [held("far", ended_ago=0, kind="tool_call", tools=("slow",)),  # prior: back in 30 s
          held("late", ended_ago=40, kind="tool_call", tools=("grep",)),  # 5+4+30 = 39 s
          held("due", ended_ago=20, kind="tool_call", tools=("grep",)),   # due, not gone
          held("final", ended_ago=1)]
    policy = SHORT_KEEP
    assert ids(policy.choose(facts(hs, pauses=pauses))) == ["final", "late", "far"]
    # A larger grace keeps `late` as merely due (kept by the watermark).
    lenient = ExpectedReturn(ExpectedReturnParams(overdue_grace_s=120, keep_soon_s=10))
    assert ids(lenient.choose(facts(hs, pauses=pauses))) == ["final", "far"]


def test_parallel_tools_wait_for_the_slowest_and_tenants_learn_apart() -> None:
    pauses = {("t", "a"): PauseStats(mean_s=5, dev_s=1, samples=3),
              ("t", "b"): PauseStats(mean_s=300, dev_s=10, samples=3),
              ("u", "a"): PauseStats(mean_s=900, dev_s=10, samples=3)}
    policy = ExpectedReturn()
    assert policy.expected_pause(("a", "b"), "t", pauses) == (300, 10)
    assert policy.expected_pause(("a",), "t", pauses) == (5, 1)
    assert policy.expected_pause(("a",), "u", pauses) == (900, 10)
    assert policy.expected_pause(("zz",), "t", pauses) == (30, 15)  # the prior
    assert policy.expected_pause((), "t", pauses) == (30, 15)  # no name relayed


def test_turns_that_ended_otherwise_go_by_age_after_answers_and_gone_sessions() -> None:
    pauses = {("t", "grep"): PauseStats(mean_s=5, dev_s=1, samples=20)}
    hs = [held("soon", ended_ago=25, kind="tool_call", tools=("t",)),  # prior 30: back in 5
          held("away", ended_ago=0, kind="tool_call", tools=("t",)),   # back in 30
          held("gone", ended_ago=100, kind="tool_call", tools=("grep",)),
          held("cut-new", ended_ago=1, kind="other"), held("unrecorded", ended_ago=9, kind=None),
          held("answered", ended_ago=0)]
    assert ids(SHORT_KEEP.choose(facts(hs, pauses=pauses, waiting=True))) == [
        "answered", "gone", "unrecorded", "cut-new", "away", "soon"]
    # With no end recorded anywhere (an older router's handles) it is oldest_first.
    plain = [held(f"h{i}", ended_ago=i, kind=None) for i in range(5)]
    assert ids(ExpectedReturn().choose(facts(plain, 25))) == ids(
        OldestFirst().choose(facts(plain, 25))) == ["h4", "h3", "h2"]


def test_policies_are_chosen_by_name_with_their_own_checked_params() -> None:
    assert isinstance(retention_policy_for(RouterSettings()), ExpectedReturn)
    chosen = retention_policy_for(RouterSettings(retention={"policy": {
        "name": "expected_return", "params": {"unseen_tool_pause_s": 5}}}))
    assert isinstance(chosen, ExpectedReturn) and chosen.params.unseen_tool_pause_s == 5
    assert isinstance(retention_policy_for(RouterSettings(
        retention={"policy": {"name": "oldest_first"}})), OldestFirst)
    with pytest.raises(ValueError, match="unknown router.retention.policy.name 'lru'"):
        retention_policy_for(RouterSettings(retention={"policy": {"name": "lru"}}))
    with pytest.raises(ValueError, match="keep_soon_s"):
        retention_policy_for(RouterSettings(retention={"policy": {
            "name": "expected_return", "params": {"keep_soon_s": -1}}}))
    with pytest.raises(ValueError, match="typo"):
        retention_policy_for(RouterSettings(retention={"policy": {
            "name": "oldest_first", "params": {"typo": 1}}}))
    with pytest.raises(ValueError):
        RouterSettings(retention={"policy": {"name": "oldest_first", "nope": 1}})


def test_a_registered_policy_is_built_by_name() -> None:
    def newest_first(params: NoParams) -> OldestFirst:
        return OldestFirst(name="newest_first")

    register("test_newest_first", NoParams, newest_first)
    try:
        policy = retention_policy_for(RouterSettings(
            retention={"policy": {"name": "test_newest_first"}}))
        assert policy.name == "newest_first"
        with pytest.raises(ValueError, match="already registered"):
            register("test_newest_first", NoParams, newest_first)
    finally:
        del RETENTION_POLICIES["test_newest_first"]
