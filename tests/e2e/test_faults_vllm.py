"""Fault injection on the real bundle, each fault mid-conversation.

After every fault the conversation must go on with answers equal to the reuse-off
answers (see test_conversation_vllm.py), and nothing the client already has may be lost: a
turn fails only when its stream was already cut (`StreamInterrupted` with the partial
text, history and token unchanged) or when no node could serve it at all (an HTTP error
before any byte); a plain retry then works. docs/reliability.md ("Faults") tabulates it.
Processes are killed by the pid the supervisor recorded, never by name.
"""

from __future__ import annotations

import shutil
import signal
import threading
import time
from typing import Any

import pytest
from kvagent import APIStatusError, StreamInterrupted, TextDelta
from kvagent_server.demo.agent import USER_TURNS
from support import start_redis

from .e2e_helpers import (
    E2E,
    EXTERNAL_HITS,
    PREFILL_LEASE_S,
    TEXT_TURN,
    TOOL_TURN,
    answer,
    assert_pulled,
    checked_send,
    p_hits,
    reference,
    run_tools,
    session,
)

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def start_turns(e: E2E, s: Any) -> Any:
    """Turn 1 (tool call) and its tool results: the conversation every fault hits."""
    call = checked_send(e, s, USER_TURNS[0], TOOL_TURN)
    run_tools(s, call)
    return call


def reuses(r: Any) -> bool:
    return bool(r.reused_tokens) and r.path in ("pd_reuse", "d_direct")


def test_router_restart_keeps_reusing(e2e: E2E) -> None:
    """Tokens are signed with the configured key and handles live in Redis, so a router
    that crashed and was restarted by the supervisor verifies and reuses them."""
    with session(e2e) as s:
        start_turns(e2e, s)
        before = e2e.restarts("router")
        e2e.kill("router")
        e2e.wait_restarted("router", before)
        r = checked_send(e2e, s, None, TEXT_TURN)
        assert reuses(r), (r.path, r.reused_tokens)


def test_decode_killed_during_stream_then_restarted(e2e: E2E) -> None:
    """D dies mid-stream (a 2000-token answer: `ignore_eos`, the demo model's own answers end
    within 224 tokens): the client gets `StreamInterrupted` with the partial text and
    keeps its history and token. Once the supervisor has restarted D (same address, new
    epoch) the retried turn is recomputed, never read from the dead node's blocks, and the
    turn after it reuses again from the new D. The retry continues a handle held on the
    dead node, as a turn after a kill between turns does: one restart covers both."""
    with session(e2e) as s:
        start_turns(e2e, s)
        token, n_messages = s.cache_token, len(s.messages)
        before = e2e.restarts("decode-0")
        partial = ""
        with (pytest.raises(StreamInterrupted) as info,
              s.stream(None, tool_choice="none", max_tokens=2000,
                       extra_body={"ignore_eos": True}) as events):
            for ev in events:
                if isinstance(ev, TextDelta) and not partial:
                    partial = ev.text
                    e2e.kill("decode-0")
        assert partial and info.value.partial_text.startswith(partial)
        assert s.cache_token == token and len(s.messages) == n_messages
        e2e.wait_restarted("decode-0", before)
        e2e.wait_router_sees("d0", True)
        retry = checked_send(e2e, s, None, TEXT_TURN)
        assert retry.path in ("recompute", "pd_fresh") and not retry.reused_tokens
        assert retry.cache_token_received
        nxt = checked_send(e2e, s, "Thanks, go on.", TEXT_TURN)
        assert reuses(nxt), (nxt.path, nxt.reused_tokens)
        call = checked_send(e2e, s, USER_TURNS[1], TOOL_TURN)
        run_tools(s, call)
        after_tool = checked_send(e2e, s, None, TEXT_TURN)
        assert reuses(after_tool), (after_tool.path, after_tool.reused_tokens)


def test_prefill_killed_during_its_leg(e2e: E2E) -> None:
    """P is frozen with the P leg in it, then killed: the client gets a 502 before any
    byte (nothing to lose), and the retry after P's restart is served correctly."""
    with session(e2e) as s:
        start_turns(e2e, s)
        before = e2e.restarts("prefill-0")
        e2e.kill("prefill-0", signal.SIGSTOP)
        err: dict[str, Any] = {}

        def turn() -> None:
            try:
                err["result"] = s.send(None, **TEXT_TURN)
            except Exception as exc:  # noqa: BLE001 - recorded and asserted below
                err["exc"] = exc

        t = threading.Thread(target=turn)
        t.start()
        time.sleep(2.0)
        e2e.kill("prefill-0", signal.SIGKILL)
        t.join(600)
        assert isinstance(err.get("exc"), APIStatusError), err
        assert err["exc"].status_code in (502, 503)
        e2e.wait_restarted("prefill-0", before)
        e2e.wait_router_sees("p0", True)
        r = checked_send(e2e, s, None, TEXT_TURN)
        assert r.cache_token_received
    # D must read the new P's KV over NIXL: a peer that kept the NIXL agent of the killed P
    # (same engine id) would fail every read and recompute, right answers and no transfer.
    d_loaded = e2e.metric(e2e.decode_url, EXTERNAL_HITS)
    with session(e2e) as fresh:
        first = checked_send(e2e, fresh, USER_TURNS[1], TOOL_TURN)
    assert first.path == "pd_fresh", first.path
    deadline = time.monotonic() + 5  # counters follow the outputs: poll briefly
    while e2e.metric(e2e.decode_url, EXTERNAL_HITS) <= d_loaded:
        assert time.monotonic() < deadline, "D read nothing from the new P over NIXL"
        time.sleep(0.2)


def test_decode_frozen_during_transfer(e2e: E2E) -> None:
    """D's engine (and its NIXL agent) stops (SIGSTOP) while P pulls from it, then
    resumes: the turn is slow, not wrong. D's API server keeps answering health checks."""
    with session(e2e) as s:
        start_turns(e2e, s)
        hits = p_hits(e2e)
        e2e.signal_engine("decode-0", signal.SIGSTOP)
        out: dict[str, Any] = {}
        before = list(s.messages)

        def turn() -> None:
            try:
                out["result"] = s.send(None, **TEXT_TURN)
            except Exception as exc:  # noqa: BLE001
                out["exc"] = exc

        t = threading.Thread(target=turn)
        t.start()
        time.sleep(4.0)
        e2e.signal_engine("decode-0", signal.SIGCONT)
        t.join(600)
        assert "result" in out, out
        ref = reference(e2e, before, None, TEXT_TURN)
        assert answer(out["result"]) == answer(ref)
        r = out["result"]
        print("frozen D:", r.path, r.reused_tokens)
        # Either P's pull waited for D and really came over NIXL, or it failed and the
        # turn recomputed with nothing reused: never a reuse P did not receive.
        assert r.path in ("pd_reuse", "recompute"), r.path
        if r.path == "pd_reuse":
            assert r.reused_tokens and r.reused_tokens > 0
            assert_pulled(e2e, hits, r)
        else:
            assert not r.reused_tokens
        nxt = checked_send(e2e, s, "Thanks, go on.", TEXT_TURN)
        assert nxt.cache_token_received


def test_decode_stalled_past_the_prefill_lease_recomputes(e2e: E2E) -> None:
    """D's engine is stopped before the D leg reaches it and resumed after P's lease has run
    out, so P has freed the prefill's blocks (no heartbeat from D renewed them); D's API
    server stays up, so the router sends the D leg there and waits. The D leg carries
    the router's `kvagent_read_by`; the decode node sees it is late and computes the prompt
    itself: the answer is right and P never sees a read of freed blocks ("Potentially
    invalid KV blocks", `vllm:nixl_num_notifications_after_expiry`)."""
    after_expiry = "vllm:nixl_num_notifications_after_expiry_total"
    expired_before = e2e.metric(e2e.prefill_url, after_expiry)
    log_before = len(e2e.log_text("prefill-0"))
    question = "A stalled decode node: which blocks may it still read?"
    with session(e2e) as s:  # a new session: the P leg does not touch D
        out: dict[str, Any] = {}

        def turn() -> None:
            try:
                out["result"] = s.send(question, **TEXT_TURN)
            except Exception as exc:  # noqa: BLE001
                out["exc"] = exc

        e2e.signal_engine("decode-0", signal.SIGSTOP)
        t = threading.Thread(target=turn)
        try:
            t.start()
            time.sleep(PREFILL_LEASE_S + 15)  # P's lease (and its reaping) passes
        finally:
            e2e.signal_engine("decode-0", signal.SIGCONT)
        t.join(600)
        assert "result" in out, out
        r = out["result"]
        print("stalled D:", r.path, r.reused_tokens)
        ref = reference(e2e, [m for m in s.messages[:-2]], question, TEXT_TURN)
        assert answer(r) == answer(ref)
        assert r.path in ("pd_fresh", "recompute") and not r.reused_tokens, r.path
        e2e.wait_router_sees("d0", True)
        nxt = checked_send(e2e, s, "Thanks, go on.", TEXT_TURN)
        assert nxt.cache_token_received
    time.sleep(2.0)
    assert e2e.metric(e2e.prefill_url, after_expiry) == expired_before
    assert "Potentially invalid KV blocks" not in e2e.log_text("prefill-0")[log_before:]
    assert "after P's lease" in e2e.log_text("decode-0")


def test_redis_down_degrades_reuse_only(e2e: E2E) -> None:
    """Redis dies mid-conversation: turns keep working (recomputed, no token); when Redis
    is back the conversation reuses again. It replaces the Redis process, on the same port."""
    redis = e2e.redis
    with session(e2e) as s:
        start_turns(e2e, s)
        redis.proc.kill()
        redis.proc.wait(10)
        shutil.rmtree(redis.workdir, ignore_errors=True)
        r = checked_send(e2e, s, None, TEXT_TURN)
        assert r.path == "recompute" and not r.reused_tokens
        assert s.cache_token is None  # no token could be stored: none is issued
        r2 = checked_send(e2e, s, "Thanks, go on.", TEXT_TURN)
        assert not r2.reused_tokens
        # Back on the same port, and left running: the session's later tests share this
        # bundle, and the fixture stops whichever Redis `e2e.redis` names.
        e2e.redis = start_redis(port=redis.port)
        call = checked_send(e2e, s, USER_TURNS[1], TOOL_TURN)
        assert call.cache_token_received
        run_tools(s, call)
        r3 = checked_send(e2e, s, None, TEXT_TURN)
        assert reuses(r3), (r3.path, r3.reused_tokens)
