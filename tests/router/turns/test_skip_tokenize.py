"""Reuse without the router's `/tokenize`: a turn whose messages extend the held turn's
exactly goes straight to D, whose prefix cache matches the real tokens itself, or to a P
node that checks the offered blocks' digests against its own prompt.

Against fake nodes over real HTTP; the fake D reports as cached only the prefix its own
sequences share with the prompt, as vLLM's prefix cache does, and every routed turn is
checked for wrong KV. The same on real vLLM: tests/router/turns/test_skip_tokenize_vllm.py.
"""

from __future__ import annotations

from typing import Any

import pytest
from fakes import FakeCluster, router_stack
from kvagent_server.router.reuse.transfer import EXPECT_KEY
from kvagent_server.router.turns.policy import MIN_RATIO_SAMPLES
from router_client import FIRST, LONG, no_wrong_kv, turn


def _follow_up(i: int) -> dict[str, Any]:
    return {"role": "user", "content": f"follow-up number {i}, keep it short " * 2}


async def _conversation(st: Any, turns: int, **extra: Any) -> list[dict[str, Any]]:
    """`turns` turns, each the previous messages + the answer + a short user message;
    returns each turn's kvagent object with the number of /tokenize calls before it."""
    messages, token, out = list(FIRST), None, []
    for i in range(turns):
        calls = len(st.prefill[0].tokenize_requests)
        kva, answer, _ = await turn(st, messages, token=token, **extra)
        out.append({**kva, "tokenized": len(st.prefill[0].tokenize_requests) > calls})
        token = kva["cache_token"]
        messages = [*messages, {"role": "assistant", "content": answer}, _follow_up(i)]
    return out


def _skipped(st: Any) -> float:
    return st.router.metrics.tokenize_skipped._value.get()


async def test_extending_turns_skip_tokenize_once_the_ratio_is_learned() -> None:
    async with router_stack(policy={"params": {"skip_prefill_max_tokens": 10_000}}) as st:
        kvas = await _conversation(st, MIN_RATIO_SAMPLES + 3)
        assert [k["tokenized"] for k in kvas] == (
            [False] + [True] * (MIN_RATIO_SAMPLES - 1) + [False] * 3)
        assert all(k["path"] == "d_direct" and k["reused_tokens"] > 0 for k in kvas[1:])
        assert all(k["reason"] == "hit" for k in kvas[1:])
        # reused_tokens is what D reports, growing with the conversation
        reused = [k["reused_tokens"] for k in kvas[1:]]
        assert reused == sorted(reused)
        assert _skipped(st) == 3
        no_wrong_kv(st)


async def test_setting_off_tokenizes_every_reused_turn() -> None:
    async with router_stack(policy={"params": {"skip_prefill_max_tokens": 10_000,
                                               "skip_tokenize_extensions": False}}) as st:
        kvas = await _conversation(st, MIN_RATIO_SAMPLES + 2)
        assert [k["tokenized"] for k in kvas] == [False] + [True] * (MIN_RATIO_SAMPLES + 1)
        assert _skipped(st) == 0
        no_wrong_kv(st)


@pytest.mark.parametrize("change", ["edited_message", "tools", "template_kwargs"])
async def test_a_changed_history_or_rendering_is_tokenized_and_verified(change: str) -> None:
    async with router_stack(policy={"params": {"skip_prefill_max_tokens": 10_000}}) as st:
        messages, token = list(FIRST), None
        for i in range(MIN_RATIO_SAMPLES + 1):
            kva, answer, _ = await turn(st, messages, token=token)
            token = kva["cache_token"]
            messages = [*messages, {"role": "assistant", "content": answer}, _follow_up(i)]
        extra: dict[str, Any] = {}
        if change == "edited_message":
            messages = [{"role": "user", "content": LONG + " (edited)"}, *messages[1:]]
        elif change == "tools":
            extra["tools"] = [{"type": "function", "function": {
                "name": "lookup", "parameters": {"type": "object", "properties": {}}}}]
        else:
            extra["chat_template_kwargs"] = {"enable_thinking": False}
        calls, skipped = len(st.prefill[0].tokenize_requests), _skipped(st)
        kva, _, _ = await turn(st, messages, token=token, **extra)
        assert len(st.prefill[0].tokenize_requests) == calls + 1
        assert _skipped(st) == skipped
        if change == "edited_message":  # verified: the reuse ends before the edit
            assert kva["reused_tokens"] <= len(LONG)
        no_wrong_kv(st)


async def test_a_long_new_message_is_tokenized_and_priced() -> None:
    """With `skip_prefill_max_tokens` 1,000, a delta estimated near or past it cannot
    skip: the turn is tokenized and the long delta goes through P."""
    async with router_stack(policy={"params": {"skip_prefill_max_tokens": 1_000}}) as st:
        messages, token = list(FIRST), None
        for i in range(MIN_RATIO_SAMPLES + 1):
            kva, answer, _ = await turn(st, messages, token=token)
            token = kva["cache_token"]
            messages = [*messages, {"role": "assistant", "content": answer},
                        {"role": "user", "content": f"ok {i}"}]
        skipped = _skipped(st)
        assert skipped >= 1  # the short turns skipped
        calls = len(st.prefill[0].tokenize_requests)
        kva, _, _ = await turn(st, [*messages, {"role": "assistant", "content": "x"},
                                    {"role": "user", "content": LONG * 6}], token=token)
        assert len(st.prefill[0].tokenize_requests) == calls + 1
        assert kva["path"] == "pd_reuse" and _skipped(st) == skipped
        no_wrong_kv(st)


async def test_pulls_skip_tokenize_once_p_was_seen_checking_them() -> None:
    """Always `pd_reuse`: P pulls an offer the router did not tokenize for only from a P
    node seen checking what it pulls (its first reuse leg answered with the verified
    count); the fake P cuts the offer with the plugin's own `pull_check`."""
    async with router_stack(policy={"params": {"skip_prefill_max_tokens": 0}}) as st:
        kvas = await _conversation(st, MIN_RATIO_SAMPLES + 3)
        assert [k["tokenized"] for k in kvas] == (
            [False] + [True] * (MIN_RATIO_SAMPLES - 1) + [False] * 3)
        assert all(k["path"] == "pd_reuse" and k["reused_tokens"] > 0 for k in kvas[1:])
        assert _skipped(st) == 3
        assert st.prefill[0].requests[-1]["kv_transfer_params"][EXPECT_KEY]["digests"]
        no_wrong_kv(st)


async def test_a_p_node_that_does_not_check_pulls_gets_tokenized_offers() -> None:
    async with router_stack(policy={"params": {"skip_prefill_max_tokens": 0}},
                            cluster=FakeCluster(pull_check=False)) as st:
        kvas = await _conversation(st, MIN_RATIO_SAMPLES + 3)
        assert all(k["tokenized"] for k in kvas[1:])
        assert all(k["path"] == "pd_reuse" and k["reused_tokens"] > 0 for k in kvas[1:])
        assert _skipped(st) == 0
        no_wrong_kv(st)


def test_an_unverified_offer_goes_only_to_p_nodes_that_check_their_pulls() -> None:
    from kvagent_server.router.nodes.registry import Node
    from kvagent_server.router.reuse import planner
    from kvagent_server.router.reuse.learned import Learned
    from kvagent_server.router.reuse.paths import Path
    from kvagent_server.router.turns import execute
    from kvagent_server.router.turns.shapes import TurnPlan

    checks, plain = (Node(name=n, url=f"http://{n}", role="prefill", healthy=True)
                     for n in ("p0", "p1"))
    learned = Learned()
    learned.observe_checks_pulls(checks.name, checks.epoch)

    def prefill_candidates(ranked: list[Node], plan: TurnPlan) -> list[Node]:
        return execute.prefill_candidates(ranked, plan,
                                          lambda n: learned.checks_pulls(n.name, n.epoch))
    untokenized = planner.ReusePlan(reuse_tokens=256, reason="hit", tokenized=False)
    tokenized = planner.ReusePlan(reuse_tokens=256, reason="hit")

    def plan(reuse: planner.ReusePlan, path: Path = "pd_reuse") -> TurnPlan:
        return TurnPlan(path=path, reuse=reuse)

    assert prefill_candidates([plain, checks], plan(untokenized)) == [checks]
    assert prefill_candidates([plain, checks], plan(tokenized)) == [plain, checks]
    assert prefill_candidates([plain, checks], plan(untokenized, "d_direct")) == [plain, checks]
    checks.mark_down("gone")
    checks.mark_up()  # a new incarnation: not trusted until it shows the check again
    assert not learned.checks_pulls(checks.name, checks.epoch)
    assert prefill_candidates([plain, checks], plan(untokenized)) == []


async def test_with_no_checking_p_node_left_an_unverified_pull_recomputes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The P node that was seen checking is gone between the plan and the P leg: the turn
    recomputes on another P node (D's blocks freed by the release params), no wrong KV."""
    from kvagent_server.router.turns import execute

    async with router_stack(policy={"params": {"skip_prefill_max_tokens": 0}}) as st:
        kvas = await _conversation(st, MIN_RATIO_SAMPLES + 1)
        assert kvas[-1]["tokenized"] is False and kvas[-1]["path"] == "pd_reuse"
        monkeypatch.setattr(execute, "prefill_candidates", lambda ranked, plan, _checks: (
            [] if plan.path == "pd_reuse" and not plan.reuse.tokenized else ranked))
        kvas = await _conversation(st, MIN_RATIO_SAMPLES + 2)
        assert kvas[-1]["tokenized"] is False
        assert kvas[-1]["path"] == "recompute" and kvas[-1]["reused_tokens"] == 0
        assert kvas[-1]["reason"].startswith("node_unhealthy")
        no_wrong_kv(st)
