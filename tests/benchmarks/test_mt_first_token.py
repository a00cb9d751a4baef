"""The first-token A/B's I/O-free parts: turns alternate between the arms, each arm keeps
its own conversation, and the summary pairs each turn with its other arm's."""

from __future__ import annotations

import httpx
import pytest
from test_mt_driver import Endpoint, spec

from benchmarks.api import ARMS, TENANTS, arm_settings, generate, run_ab
from benchmarks.api import first_token_summarize as summarize


async def test_the_arms_alternate_turn_by_turn_each_with_its_own_history() -> None:
    ep = Endpoint()
    wl = generate(spec(conversations=1, turns=3))
    urls = {ARMS[0]: "http://on/v1", ARMS[1]: "http://off/v1"}
    pairs = await run_ab(urls, "m", wl.conversations, 7, transport=httpx.MockTransport(ep))
    hosts = [h["host"] for _, h in ep.requests]
    assert hosts == ["on", "off", "off", "on", "on", "off"]  # who goes first alternates
    auth = [h.get("authorization") for _, h in ep.requests]
    want = {"on": TENANTS[ARMS[0]], "off": TENANTS[ARMS[1]]}
    assert auth == [f"Bearer {want[h]['api_keys'][0]}" for h in hosts]
    on = [b for b, h in ep.requests if h["host"] == "on"]
    off = [b for b, h in ep.requests if h["host"] == "off"]
    assert [len(b["messages"]) for b in on] == [len(b["messages"]) for b in off]
    # Each arm's history carries its own answers (the fake names the request it answers).
    assert on[1]["messages"] != off[1]["messages"]
    assert [(a["turn"], b["turn"]) for a, b in pairs] == [(0, 0), (1, 1), (2, 2)]


def test_summary_compares_each_reused_turn_with_the_other_arms() -> None:
    def rec(turn: int, ttft: float, e2e: float, answer: str = "a") -> dict:
        return {"turn": turn, "ttft_s": ttft, "e2e_s": e2e, "answer": answer}

    pairs = [(rec(0, 9.0, 9.0), rec(0, 1.0, 1.0)),  # a first turn: not in the figures
             (rec(1, 0.100, 0.400), rec(1, 0.110, 0.400)),
             (rec(2, 0.200, 0.500, "x"), rec(2, 0.190, 0.520))]
    s = summarize(pairs)
    assert s["reused_turns"] == 2 and s["turns"] == 3 and s["answers_equal"] == 2
    assert s["p_token_ttft_ms_p50"] == pytest.approx(150.0)
    assert s["ttft_diff_ms_p50"] == pytest.approx(0.0)  # -10 and +10
    assert s["ttft_on_faster_turns"] == 1
    assert s["e2e_on_faster_turns"] == 1 and s["e2e_diff_ms_p50"] == pytest.approx(-10.0)
    assert s["ttft_ratio_p50"] == pytest.approx((0.100 / 0.110 + 0.200 / 0.190) / 2, abs=1e-3)


def test_the_arms_routers_differ_only_in_forwarding_ps_token() -> None:
    on, off = (arm_settings(arm) for arm in ARMS)
    assert on.pop("engine") == {"forward_first_token": True}
    assert off.pop("engine") == {"forward_first_token": False}
    assert on.pop("tenants") != off.pop("tenants")  # each its own cache salt
    assert on == off
