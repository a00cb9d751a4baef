"""A turn with nothing to reuse computed on the decode node (`d_fresh`,
router.fresh_on_decode): the rule (`paths.fresh_path`) and the turn through the router
against fake nodes. On real vLLM: tests/router/reuse/test_fresh_on_decode_vllm.py."""

from __future__ import annotations

import time

import pytest
from fakes import router_stack
from kvagent_server.router.reuse.paths import LinearCost, PathCosts, fresh_path
from kvagent_server.router.reuse.queue import IDLE, NodeWork
from router_client import FIRST, no_wrong_kv, second, turn

#: Roughly this machine's measured lines (P ~0.4 ms/token, D ~0.5 ms/token).
COSTS = PathCosts(prefill=LinearCost(fixed_s=0.08, per_token_s=4e-4),
                  pull=LinearCost(fixed_s=0.03, per_token_s=2e-5),
                  d_direct=LinearCost(fixed_s=0.02, per_token_s=5e-4))
FIRST_TURN = 850  # a first turn's tokens past the shared system prompt
P_BUSY = NodeWork(prefill_tokens=2500)  # a long tool result being computed on P


def _auto(p_work: NodeWork | None, d_work: NodeWork | None = IDLE, **kw: object) -> str:
    return fresh_path(FIRST_TURN, COSTS, policy="auto", d_healthy=True, p_work=p_work,
                      d_work=d_work, **kw)  # type: ignore[arg-type]


def test_an_idle_p_computes_every_fresh_prompt() -> None:
    """Even where D's line is cheaper for a short prompt: P exists for prompts."""
    assert COSTS.queued_ttft("d_fresh", 100, 0, IDLE) < COSTS.queued_ttft("pd_fresh", 100, 0,
                                                                           IDLE)
    assert fresh_path(100, COSTS, policy="auto", d_healthy=True, p_work=IDLE,
                      d_work=IDLE) == "pd_fresh"


def test_a_busy_p_sends_the_prompt_to_an_idle_d() -> None:
    assert _auto(P_BUSY) == "d_fresh"
    assert _auto(NodeWork(prefill_tokens=50)) == "pd_fresh"  # a short wait on P is cheaper


def test_d_streams_are_priced_against_ps_queue() -> None:
    """Each stream on D waits for the prompt: with enough of them P's queue is cheaper."""
    assert _auto(P_BUSY, NodeWork(streams=1)) == "d_fresh"
    assert _auto(P_BUSY, NodeWork(streams=8)) == "pd_fresh"
    assert _auto(P_BUSY, NodeWork(prefill_tokens=4000)) == "pd_fresh"  # D busier still


def test_the_stall_cap_keeps_a_long_prompt_off_a_decoding_d() -> None:
    streams = NodeWork(streams=1)
    assert _auto(P_BUSY, streams, d_stall_max_s=1.0) == "d_fresh"
    assert _auto(P_BUSY, streams, d_stall_max_s=0.04) == "pd_fresh"
    assert _auto(P_BUSY, IDLE, d_stall_max_s=0.04) == "d_fresh"  # no stream to stall


def test_with_short_steps_on_d_a_busy_p_sends_the_prompt_to_d_beside_its_streams() -> None:
    """D computes a prompt in short steps while it streams: while P computes other legs
    and D no prompt of its own, D takes the first turn, whatever the stall cap says of the
    whole prompt and even once P's estimated queue reads empty (P running late)."""
    late_p = NodeWork(prefill_tokens=0, prompts=1)
    streams = NodeWork(streams=3)
    kw = {"d_stall_max_s": 0.04}
    assert _auto(late_p, streams, **kw) == "pd_fresh"  # steps unknown: the cap decides
    assert _auto(late_p, streams, d_prompt_step_tokens=128, **kw) == "d_fresh"
    d_computing = NodeWork(prefill_tokens=300, streams=3, prompts=1)
    assert _auto(late_p, d_computing, d_prompt_step_tokens=128, **kw) == "pd_fresh"
    assert _auto(IDLE, streams, d_prompt_step_tokens=128, **kw) == "pd_fresh"  # P idle


def test_fixed_policies_health_and_blind_queues() -> None:
    for policy, want in (("never", "pd_fresh"), ("always", "d_fresh")):
        assert fresh_path(FIRST_TURN, COSTS, policy=policy, d_healthy=True, p_work=P_BUSY,
                          d_work=IDLE) == want
    assert fresh_path(FIRST_TURN, COSTS, policy="always", d_healthy=False) == "pd_fresh"
    assert _auto(None) == "pd_fresh"  # queues not counted (queue_aware_paths off)
    with pytest.raises(ValueError, match="non-negative"):
        fresh_path(-1, COSTS, policy="auto", d_healthy=True)


def test_d_fresh_is_priced_and_learned_as_d_computing() -> None:
    assert COSTS.estimate("d_fresh", 900, 0) == COSTS.estimate("d_direct", 900, 0)
    work = NodeWork(prefill_tokens=100, streams=2)
    assert (COSTS.queued_cost("d_fresh", 900, 0, work)
            == COSTS.queued_cost("d_direct", 900, 0, work))


# ------------------------------------------------------------------ through the router


async def test_always_computes_the_first_turn_on_d_and_the_next_turn_reuses_it() -> None:
    async with router_stack(policy={"params": {"skip_prefill_max_tokens": 0,
                                               "fresh_on_decode": "always"}}) as st:
        p, d = st.prefill[0], st.decode[0]
        kva, answer, _ = await turn(st, FIRST)
        assert kva["path"] == "d_fresh" and kva["reused_tokens"] == 0
        assert kva["reason"] == "no_handle"
        assert kva["cache_token"].startswith("kva1.")
        assert not p.requests  # P never saw the prompt
        assert d.requests[-1]["kv_transfer_params"] == {"do_remote_decode": False,
                                                        "do_remote_prefill": False}
        # The turn's D leg is over: nothing of it stays counted on D.
        d_name = st.router.registry.role("decode")[0].name
        assert st.router.ledger.work(d_name, now=time.monotonic(), per_token_s=1e-3) == IDLE

        kva2, _, _ = await turn(st, second(answer), token=kva["cache_token"])
        assert kva2["path"] == "pd_reuse" and kva2["reused_tokens"] > 0
        pulls = [e for e in st.cluster.events_of("pull") if e.node == p.engine_id]
        assert [e.detail["from"] for e in pulls] == [d.engine_id]  # the KV D computed
        no_wrong_kv(st)


async def test_auto_moves_a_first_turn_to_d_only_while_p_is_busy() -> None:
    async with router_stack(policy={"params": {"fresh_on_decode": "auto"}}) as st:
        kva, _, _ = await turn(st, FIRST, session="idle")
        assert kva["path"] == "pd_fresh"
        samples = st.router.learned.chars.samples
        p_name = st.router.registry.role("prefill")[0].name
        ticket = st.router.ledger.open(p_name, role="prefill", tokens=100_000,
                                      now=time.monotonic())
        kva, _, _ = await turn(st, FIRST, session="busy")
        assert kva["path"] == "d_fresh" and kva["cache_token"]
        assert st.router.learned.chars.samples == samples + 1  # D's usage teaches tokens per byte
        st.router.ledger.close(ticket, time.monotonic())
        kva, _, _ = await turn(st, FIRST, session="idle-again")
        assert kva["path"] == "pd_fresh"
        no_wrong_kv(st)


async def test_auto_with_short_steps_on_d_counts_ps_legs_not_its_estimate() -> None:
    async with router_stack(policy={"params": {"fresh_on_decode": "auto",
                                               "decode_prompt_step_tokens": 128}}) as st:
        p_name = st.router.registry.role("prefill")[0].name
        d_name = st.router.registry.role("decode")[0].name
        now = time.monotonic()
        # P's leg was due long ago by P's line (the estimate reads 0); D streams.
        st.router.ledger.open(p_name, role="prefill", tokens=10, now=now - 60)
        stream = st.router.ledger.open(d_name, role="decode", stream=True, tokens=0, now=now)
        assert st.router.ledger.work(p_name, now=now, per_token_s=1e-3).prefill_tokens == 0
        kva, _, _ = await turn(st, FIRST, session="late-p")
        assert kva["path"] == "d_fresh"
        st.router.ledger.open(d_name, role="decode", stream=True, tokens=5_000, now=now)
        kva, _, _ = await turn(st, FIRST, session="d-computing")
        assert kva["path"] == "pd_fresh"  # D's steps already carry a prompt
        st.router.ledger.close(stream, time.monotonic())
        no_wrong_kv(st)


async def test_never_keeps_every_fresh_prompt_on_p() -> None:
    async with router_stack(policy={"params": {"fresh_on_decode": "never"}}) as st:
        p_name = st.router.registry.role("prefill")[0].name
        st.router.ledger.open(p_name, role="prefill", tokens=100_000,
                             now=time.monotonic())
        kva, _, _ = await turn(st, FIRST)
        assert kva["path"] == "pd_fresh"


async def test_a_failing_d_leg_falls_back_to_p() -> None:
    async with router_stack(policy={"params": {"fresh_on_decode": "always"}}, n_decode=2) as st:
        st.decode[0].fail_next = [500]
        st.decode[1].fail_next = [500]
        kva, _, _ = await turn(st, FIRST)
        assert kva["path"] == "pd_fresh" and kva["cache_token"]
        assert st.prefill[0].requests  # P computed it after both D nodes failed
        no_wrong_kv(st)


async def test_the_p_d_retry_tries_the_decode_nodes_that_failed_last() -> None:
    """With more decode nodes than a leg tries, the P/D retry of a failed `d_fresh` starts
    on one it has not tried: the one that failed first would refuse P's KV as well, and a
    D leg that pulls is not retried on another node."""
    async with router_stack(policy={"params": {"fresh_on_decode": "always"}}, n_decode=4) as st:
        for node in st.decode[:3]:
            node.fail_next = [500] * 3
        kva, _, _ = await turn(st, FIRST)
        assert kva["path"] == "pd_fresh" and kva["cache_token"]
        assert [len(n.requests) for n in st.decode] == [1, 1, 1, 1]
        assert st.decode[3].requests[-1]["kv_transfer_params"]["do_remote_prefill"]
        no_wrong_kv(st)


async def test_reuse_off_keeps_every_turn_p_d() -> None:
    """`reuse: false` is the P/D-without-reuse baseline: D's prefix cache must not serve
    its turns, so none goes to D alone."""
    async with router_stack(policy={"params": {"fresh_on_decode": "always"}}, reuse=False) as st:
        kva, answer, _ = await turn(st, FIRST)
        kva2, _, _ = await turn(st, second(answer))
        assert kva["path"] == kva2["path"] == "pd_fresh"
        assert len(st.prefill[0].requests) == 2
