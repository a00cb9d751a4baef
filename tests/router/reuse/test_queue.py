"""Queue-aware path choice: the work in flight per node (counted by the router's ledger of
legs, tests/router/nodes/test_ledger.py) and the choice between `d_direct` and `pd_reuse`
it drives."""

from __future__ import annotations

import pytest
from kvagent_server.router.nodes.ledger import LegLedger
from kvagent_server.router.reuse.paths import (
    CostModel,
    LinearCost,
    PathCosts,
    choose_path,
    tokens_ahead,
    untokenized_path,
)
from kvagent_server.router.reuse.planner import ReusePlan
from kvagent_server.router.reuse.queue import IDLE, CharsPerToken, NodeWork

#: Roughly this machine's measured lines (P ~0.4 ms/token, D ~0.5 ms/token).
COSTS = PathCosts(prefill=LinearCost(fixed_s=0.08, per_token_s=4e-4),
                  pull=LinearCost(fixed_s=0.03, per_token_s=2e-5),
                  d_direct=LinearCost(fixed_s=0.02, per_token_s=5e-4))
REUSE = ReusePlan(reuse_tokens=2048, reason="hit")
PROMPT = 2048 + 150  # a 150-token delta, an agent's tool result and the last answer
KW = {"skip_prefill_max_tokens": None, "d_healthy": True}


def test_busy_p_and_idle_d_skip_p() -> None:
    big = 2048 + 1500  # a delta P computes faster than D when both are idle
    assert choose_path(REUSE, big, COSTS, p_work=IDLE, d_work=IDLE, **KW) == "pd_reuse"
    p_busy = NodeWork(prefill_tokens=2000)  # a first turn's prompt being computed on P
    assert choose_path(REUSE, big, COSTS, p_work=p_busy, d_work=IDLE, **KW) == "d_direct"


def test_d_decoding_many_streams_and_idle_p_take_p() -> None:
    assert choose_path(REUSE, PROMPT, COSTS, p_work=IDLE, d_work=IDLE, **KW) == "d_direct"
    d_busy = NodeWork(streams=8)
    assert choose_path(REUSE, PROMPT, COSTS, p_work=IDLE, d_work=d_busy, **KW) == "pd_reuse"


def test_d_with_deltas_queued_and_idle_p_take_p() -> None:
    d_queued = NodeWork(prefill_tokens=600)  # other sessions' deltas waiting on D
    assert choose_path(REUSE, PROMPT, COSTS, p_work=IDLE, d_work=d_queued, **KW) == "pd_reuse"


def test_both_queues_weighed_not_just_one() -> None:
    """D streams decoding would send the turn to P, unless P's queue costs more."""
    d = NodeWork(streams=4)
    assert choose_path(REUSE, PROMPT, COSTS, p_work=IDLE, d_work=d, **KW) == "pd_reuse"
    p = NodeWork(prefill_tokens=2000)
    assert choose_path(REUSE, PROMPT, COSTS, p_work=p, d_work=d, **KW) == "d_direct"


def test_idle_nodes_choose_as_the_ttft_lines_do() -> None:
    for prompt in (2048 + 40, 2048 + 2000):
        ttft_only = choose_path(REUSE, prompt, COSTS, **KW)
        assert choose_path(REUSE, prompt, COSTS, p_work=IDLE, d_work=IDLE, **KW) == ttft_only
    assert choose_path(REUSE, 2048 + 40, COSTS, **KW) == "d_direct"


def test_fixed_policies_ignore_the_queues() -> None:
    p_busy, d_busy = NodeWork(prefill_tokens=10_000), NodeWork(streams=50)
    assert choose_path(REUSE, PROMPT, COSTS, skip_prefill_max_tokens=0, d_healthy=True,
                       p_work=IDLE, d_work=d_busy) == "pd_reuse"
    assert choose_path(REUSE, PROMPT, COSTS, skip_prefill_max_tokens=10**6, d_healthy=True,
                       p_work=p_busy, d_work=IDLE) == "d_direct"


@pytest.mark.parametrize("path", ["d_direct", "pd_reuse"])
def test_estimate_grows_with_work_ahead(path: str) -> None:
    costs = [COSTS.queued_ttft(path, PROMPT, 2048, NodeWork(prefill_tokens=n))  # type: ignore[arg-type]
             for n in (0, 100, 1000, 5000)]
    assert costs == sorted(costs) and costs[0] < costs[-1]
    # the wait is the node's per-token cost times the tokens ahead
    line = COSTS.d_direct if path == "d_direct" else COSTS.prefill
    assert costs[2] - costs[0] == pytest.approx(1000 * line.per_token_s)


def test_stall_on_d_counts_every_stream() -> None:
    one = COSTS.queued_cost("d_direct", PROMPT, 2048, NodeWork(streams=1))
    five = COSTS.queued_cost("d_direct", PROMPT, 2048, NodeWork(streams=5))
    # each stream: one token more in the delta's step, and a stall of the delta's compute
    assert five - one == pytest.approx(4 * 5e-4 * (1 + 150))
    # a P leg stalls no stream: streams on P do not change its cost
    assert COSTS.queued_cost("pd_reuse", PROMPT, 2048, NodeWork(streams=5)) == (
        COSTS.queued_ttft("pd_reuse", PROMPT, 2048, IDLE))


def test_a_stall_past_the_cap_takes_p_while_d_has_streams() -> None:
    """The summed stall of one stream is small beside P's leg, so the sums pick `d_direct`;
    the cap sends the delta to P when D's compute of it (0.095 s here) is longer."""
    one = NodeWork(streams=1)
    assert choose_path(REUSE, PROMPT, COSTS, p_work=IDLE, d_work=one, **KW) == "d_direct"
    assert choose_path(REUSE, PROMPT, COSTS, p_work=IDLE, d_work=one, d_stall_max_s=0.05,
                       **KW) == "pd_reuse"
    assert choose_path(REUSE, PROMPT, COSTS, p_work=IDLE, d_work=one, d_stall_max_s=0.2,
                       **KW) == "d_direct"
    # no stream on D: nothing to stall, the cap does not apply
    assert choose_path(REUSE, PROMPT, COSTS, p_work=IDLE, d_work=IDLE, d_stall_max_s=0.05,
                       **KW) == "d_direct"
    # the fixed policies are fixed
    assert choose_path(REUSE, PROMPT, COSTS, skip_prefill_max_tokens=10**6, d_healthy=True,
                       p_work=IDLE, d_work=one, d_stall_max_s=0.05) == "d_direct"


def test_p_legs_in_flight_are_streams_about_to_start_on_d() -> None:
    """An idle D with P computing: P's legs will stream on D while D computes the delta,
    so the cap applies though D has no stream yet."""
    busy_p = NodeWork(prefill_tokens=4000, prompts=1)
    assert choose_path(REUSE, PROMPT, COSTS, p_work=busy_p, d_work=IDLE, **KW) == "d_direct"
    assert choose_path(REUSE, PROMPT, COSTS, p_work=busy_p, d_work=IDLE, d_stall_max_s=0.05,
                       **KW) == "pd_reuse"
    assert choose_path(REUSE, PROMPT, COSTS, p_work=busy_p, d_work=IDLE, d_stall_max_s=0.2,
                       **KW) == "d_direct"


def test_p_legs_count_while_ps_estimate_reads_empty() -> None:
    """P slower than its line: the estimate of its queue is 0 while its legs still
    compute, and those legs still start on D (the ledger below gives this `NodeWork`)."""
    led = LegLedger()
    led.open("p0", role="prefill", tokens=5000, now=0.0)
    overdue = led.work("p0", now=2.0, per_token_s=1e-4)  # 0.5 s of work by the line
    assert overdue == NodeWork(prefill_tokens=0, prompts=1)
    assert choose_path(REUSE, PROMPT, COSTS, p_work=overdue, d_work=IDLE, d_stall_max_s=0.05,
                       **KW) == "pd_reuse"
    # P idle: nothing about to start on D, the cap does not apply
    assert choose_path(REUSE, PROMPT, COSTS, p_work=IDLE, d_work=IDLE, d_stall_max_s=0.05,
                       **KW) == "d_direct"


def test_an_untokenized_turn_respects_the_cap() -> None:
    def path(cap: float | None, checks: bool = True) -> str | None:
        return untokenized_path(REUSE, (100, 200), COSTS, 0.01, skip_prefill_max_tokens=None,
                                prefill_checks_pulls=checks, p_work=IDLE,
                                d_work=NodeWork(streams=1), d_stall_max_s=cap)

    assert path(None) == "d_direct"
    assert path(0.05) == "pd_reuse"
    # without P's own check the unverified turn must be tokenized to go to P
    assert path(0.05, checks=False) is None


def test_tokens_ahead() -> None:
    w = NodeWork(prefill_tokens=300, streams=4)
    assert tokens_ahead("d_direct", w) == 304
    assert tokens_ahead("pd_reuse", w) == 300
    assert tokens_ahead("pd_fresh", w) == 300


def test_chars_per_token_learns_the_ratio() -> None:
    ratio = CharsPerToken(prior=0.25, alpha=0.5)
    assert ratio.tokens(8000) == 2000
    for _ in range(30):
        ratio.observe(8000, 1000)  # P's prefix cache computes half of what chars say
    assert ratio.tokens(8000) == pytest.approx(1000, abs=1)
    ratio.observe(0, 10)  # nothing to learn from an empty body
    assert ratio.tokens(8000) == pytest.approx(1000, abs=1)


def test_cost_model_learns_against_the_work_ahead() -> None:
    """TTFTs measured behind a queue teach the per-token cost, not a bigger fixed cost."""
    model = CostModel(alpha=0.2)
    for i in range(100):
        ahead, own = (i % 5) * 500, 100 + (i % 3) * 50
        model.observe("d_direct", own, 0.02 + 5e-4 * (ahead + own), ahead_tokens=ahead)
        model.observe("pd_fresh", 2000, 0.08 + 4e-4 * (ahead + 2000), ahead_tokens=ahead)
    costs = model.snapshot()
    assert costs.d_direct.fixed_s == pytest.approx(0.02, rel=1e-3)
    assert costs.d_direct.per_token_s == pytest.approx(5e-4, rel=1e-3)
    assert costs.prefill.fixed_s == pytest.approx(0.08, rel=1e-3)
    assert costs.prefill.per_token_s == pytest.approx(4e-4, rel=1e-3)
    with pytest.raises(ValueError):
        model.observe("d_direct", 1, 0.1, ahead_tokens=-1)
