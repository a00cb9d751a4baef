"""Reuse through the router on real vLLM, checked against reuse-off answers.

Every answer of a reusing conversation is compared with the same request served with no
reuse at all (another tenant: its own cache salt, a fresh session): greedy decoding of
the demo model is deterministic, so any wrong KV (a wrong block pulled, a stale handle,
a diverged prefix) shows up as a different answer.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import httpx
import pytest
from kvagent import AssistantMessage, SystemMessage, UserMessage
from kvagent_server.demo.agent import USER_TURNS

from .e2e_helpers import (
    ALPHA_KEY,
    BETA_KEY,
    E2E,
    SIGNING_KEY,
    SIGNING_KID,
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


def codec():
    from kvagent_server.router.auth.cache_token import TokenCodec
    from kvagent_server.router.auth.keys import KeyRing

    return TokenCodec(KeyRing({SIGNING_KID: SIGNING_KEY.encode()}, SIGNING_KID))


def with_token(messages: list[Any], token: str) -> list[Any]:
    """The history with the last answer's cache token replaced (what a client would send)."""
    out = list(messages)
    for i in range(len(out) - 1, -1, -1):
        if isinstance(out[i], AssistantMessage):
            out[i] = out[i].model_copy(update={"cache_token": token,
                                               "cache_token_expires_at": None})
            return out
    raise AssertionError("no assistant message")


def decode_usage(e: E2E) -> float:
    """D's KV block usage now. vLLM updates the gauge only when its engine steps, so make
    it step once with a one-token request of its own (which holds one block meanwhile)."""
    httpx.post(f"{e.decode_url}/v1/completions", timeout=120,
               json={"model": e.model, "prompt": "usage probe", "max_tokens": 1})
    return e.metric(e.decode_url, "vllm:kv_cache_usage_perc")


def test_release_unused_handle_frees_decode_blocks(e2e: E2E) -> None:
    """A claimed handle the turn cannot use (the prompt diverges at token 0) is released:
    the P leg carries `remote_num_tokens=0`, P notifies D, D frees the blocks at once
    instead of holding them for the TTL. Runs first, on an idle D, so D's block usage is
    this conversation's alone."""
    with session(e2e) as s:
        first = s.send(USER_TURNS[0], **TOOL_TURN)
        assert first.cache_token_received
        held = decode_usage(e2e)
        assert held > 0, "D should hold the first turn's blocks"
        # Same session and token, a different conversation: nothing reusable.
        other = with_token([SystemMessage(content="Short."), UserMessage(content="Hi."),
                            AssistantMessage(content="Hello."), UserMessage(content="Bye.")],
                           s.cache_token)
        with session(e2e, system=None, messages=other, session_id=s.session_id) as s2:
            r = s2.send(None, **TEXT_TURN)
    assert r.path == "recompute" and r.reused_tokens == 0, (r.path, r.reused_tokens)
    time.sleep(1.0)  # P's notification reaches D
    after = decode_usage(e2e)
    # The new turn holds ~1 block; the first turn's ~10+ blocks must be gone.
    print(f"D block usage: {held:.4f} -> {after:.4f}")
    assert after < held / 2, f"D still holds the released blocks ({held} -> {after})"


def test_agent_conversation_reuses_and_matches_reuse_off(e2e: E2E) -> None:
    """Tool calls, tool results, short replies: >= 90% of later turns reuse, answers equal
    the reuse-off answers, small deltas skip P (`d_direct`)."""
    results = []
    pulled_before = p_hits(e2e)[0]
    with session(e2e) as s:
        for question in USER_TURNS[:3]:
            call = checked_send(e2e, s, question, TOOL_TURN)
            results.append(call)
            run_tools(s, call)
            results.append(checked_send(e2e, s, None, TEXT_TURN))
            results.append(checked_send(e2e, s, "Thanks, go on.", TEXT_TURN))
    later = results[1:]
    reused = [r for r in later if r.reused_tokens and r.reused_tokens > 0]
    paths = [(r.path, r.reused_tokens, r.usage.prompt_tokens if r.usage else None)
             for r in results]
    print("paths:", paths)
    assert len(reused) >= 0.9 * len(later), paths
    assert all(r.path in ("pd_reuse", "d_direct") for r in reused), paths
    assert any(r.path == "d_direct" for r in later), paths  # short replies skip P
    assert any(r.path == "pd_reuse" for r in later), paths  # tool results do not
    # ... and at least one of them pulled what only D had (a d_direct turn's tokens).
    assert p_hits(e2e)[0] > pulled_before, "no pd_reuse turn pulled anything from D"


def test_history_edit_reuses_only_the_common_prefix(e2e: E2E) -> None:
    """Editing an earlier message: the next turn reuses at most the verified common prefix
    (the system prompt's blocks) and answers exactly like a recompute."""
    with session(e2e) as s:
        call = checked_send(e2e, s, USER_TURNS[0], TOOL_TURN)
        run_tools(s, call)
        last = checked_send(e2e, s, None, TEXT_TURN)
        history = list(s.messages)
    edited_at = next(i for i, m in enumerate(history) if isinstance(m, UserMessage))
    history[edited_at] = UserMessage(content="Payments fail since 09:00. Check the queue.")
    with session(e2e, system=None, messages=history, session_id=s.session_id) as s2:
        r = checked_send(e2e, s2, "And now?", TEXT_TURN)
    assert r.path in ("pd_reuse", "d_direct"), r.path
    assert r.reused_tokens and 0 < r.reused_tokens < last.usage.prompt_tokens, (
        r.reused_tokens, last.usage.prompt_tokens)


def test_shifted_blocks_change_the_answer(e2e: E2E) -> None:
    """Negative control: the router's test-only hook hands P D's blocks shifted by half
    their number (slot i gets block i - n//2: real KV of this conversation in the wrong
    places). The answer must differ from the
    reuse-off answer, proving the greedy-equality checks above can fail."""
    long_text = {**TEXT_TURN, "max_tokens": 32}
    # A long answer (generated on D: blocks P never computed), then a question long
    # enough to run P: the P leg must pull those blocks from D.
    question = USER_TURNS[3] + " Context: " + " ".join(
        f"step {i}: restart the checkout pods and compare p99." for i in range(12))
    with session(e2e) as s:
        call = checked_send(e2e, s, USER_TURNS[0], TOOL_TURN)
        run_tools(s, call)
        checked_send(e2e, s, None, {**TEXT_TURN, "max_tokens": 300})
        history = list(s.messages)
        hits = p_hits(e2e)
        wrong = s.send(question, headers={"X-Kvagent-Test-Shift-Blocks": "1"}, **long_text)
    assert wrong.path == "pd_reuse" and wrong.reused_tokens, (wrong.path, wrong.reused_tokens)
    assert_pulled(e2e, hits, wrong, strict=True)
    ref = reference(e2e, history, question, long_text)
    print("shifted:", answer(wrong), "reference:", answer(ref))
    assert answer(wrong) != answer(ref)


@pytest.mark.parametrize("fault", ["tampered", "expired", "other_tenant", "other_session",
                                   "replayed"])
def test_bad_tokens_recompute_with_the_same_answer(e2e: E2E, fault: str) -> None:
    with session(e2e) as s:
        call = checked_send(e2e, s, USER_TURNS[1], TOOL_TURN)
        run_tools(s, call)
        good = s.cache_token
        assert good
        history = list(s.messages)
        sid, key = s.session_id, ALPHA_KEY
        if fault == "tampered":
            token = good[:-2] + ("AA" if good[-2:] != "AA" else "BB")
        elif fault == "expired":
            claims = codec().decode(good, now=time.time())
            token = codec().encode(tenant=claims.tenant, session=claims.session,
                                   handle=claims.handle, iat=claims.iat - 200,
                                   exp=int(time.time()) - 5)
        elif fault == "other_tenant":
            token, key = good, BETA_KEY
        elif fault == "other_session":
            token, sid = good, s.session_id + "-other"
        else:  # replayed: the legitimate turn uses it first
            used = checked_send(e2e, s, None, TEXT_TURN)
            assert used.reused_tokens and used.reused_tokens > 0, used.path
            token = good
        with session(e2e, api_key=key, system=None, messages=with_token(history, token),
                     session_id=sid) as bad:
            r = checked_send(e2e, bad, None, TEXT_TURN)
    assert r.path == "recompute", (fault, r.path)
    assert r.reused_tokens == 0
    assert r.cache_token_received and bad.cache_token not in (None, token)


def test_two_requests_racing_for_one_handle(e2e: E2E) -> None:
    """Both requests of one session carry the same token: exactly one claims the handle,
    the other recomputes; both answers are right."""
    with session(e2e) as s:
        call = checked_send(e2e, s, USER_TURNS[2], TOOL_TURN)
        run_tools(s, call)
        a, b = s.fork(), s.fork()
        ref = reference(e2e, s.messages, None, TEXT_TURN)
        out: dict[str, Any] = {}

        def go(name: str, sess: Any) -> None:
            out[name] = sess.send(None, **TEXT_TURN)

        threads = [threading.Thread(target=go, args=(n, x)) for n, x in (("a", a), ("b", b))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(600)
    results = [out["a"], out["b"]]
    assert [answer(r) for r in results] == [answer(ref)] * 2
    reused = sorted(bool(r.reused_tokens) for r in results)
    assert reused == [False, True], [(r.path, r.reused_tokens) for r in results]
    assert {r.path for r in results if not r.reused_tokens} == {"recompute"}


def test_orphaned_prefill_leg_is_released(e2e: E2E) -> None:
    """D rejects a request P accepted (P drops logprob fields): the router drains P's
    leased blocks with a one-token D read, so P never reaches its lease-expiry path, and
    the next turn is served normally."""
    releases = "kvagent_router_prefill_releases_total"
    reads = "vllm:nixl_xfer_time_seconds_count"
    before_rel = e2e.metric(e2e.router_url, releases)
    before_reads = e2e.metric(e2e.decode_url, reads)
    from kvagent_server.demo.agent import system_prompt

    body = {"model": e2e.model, "max_tokens": 4, "logprobs": True, "top_logprobs": 25,
            "messages": [{"role": "system", "content": system_prompt()},
                         {"role": "user", "content": "orphan check"}]}
    resp = httpx.post(f"{e2e.base_url}/chat/completions", json=body, timeout=600,
                      headers={"Authorization": f"Bearer {ALPHA_KEY}",
                               "X-Session-ID": "orphan-check"})
    assert resp.status_code == 400, resp.text
    assert "remote_" not in resp.text and "kv_transfer" not in resp.text
    assert e2e.metric(e2e.router_url, releases) >= before_rel + 1
    assert e2e.metric(e2e.decode_url, reads) >= before_reads + 1  # D read P's blocks
    # P is not wedged: past P's 30 s lease, a new turn still completes normally.
    time.sleep(35)
    with session(e2e) as s:
        r = checked_send(e2e, s, USER_TURNS[3], TOOL_TURN)
    assert r.tool_calls


def test_a_prompt_over_the_context_length_gets_vllms_own_message(e2e: E2E) -> None:
    """The node's reason reaches the client through the router (its wording names nothing
    internal), not the router's generic 'rejected' message."""
    words = " ".join(f"w{i}" for i in range(20_000))  # well over the bundle's 16,384
    body = {"model": e2e.model, "max_tokens": 4,
            "messages": [{"role": "user", "content": words}]}
    resp = httpx.post(f"{e2e.base_url}/chat/completions", json=body, timeout=600,
                      headers={"Authorization": f"Bearer {ALPHA_KEY}",
                               "X-Session-ID": "too-long"})
    assert resp.status_code == 400, resp.text
    message = resp.json()["error"]["message"]
    assert message.startswith("This model's maximum context length is 16384 tokens"), message


def test_blocks_expired_on_decode_recompute(e2e: E2E) -> None:
    """The router believes a handle is live but D already dropped its blocks (a TTL
    misconfigured, a clock jump): P's read is declined, P recomputes, the answer is right.
    Simulated by re-dating the router's record of a handle: it stays live for the router
    while D's deadline in its transfer params (`remote_blocks_expiry_time`, what P checks
    before it reads) lies in the past, as it does once D's TTL has run out."""
    import asyncio

    from kvagent_server.router.store.redis_store import RedisStore

    from .e2e_helpers import TTL_S

    with session(e2e) as s:
        call = checked_send(e2e, s, USER_TURNS[4], TOOL_TURN)
        run_tools(s, call)
        # A long answer: D retains blocks of generated tokens that P never computed, so
        # reusing them makes P read from D (not just its own prefix cache).
        checked_send(e2e, s, None, {**TEXT_TURN, "max_tokens": 300})
        history = list(s.messages)
        claims = codec().decode(s.cache_token, now=time.time())

    async def peek() -> Any:
        store = RedisStore.from_url(e2e.redis.url)
        try:
            return await store.peek_latest("alpha", claims.session)
        finally:
            await store.close()

    async def put(handle: Any) -> None:
        store = RedisStore.from_url(e2e.redis.url)
        try:
            await store.put(handle)
        finally:
            await store.close()

    handle = asyncio.run(peek())
    assert handle is not None and handle.handle_id == claims.handle
    deadline = "remote_blocks_expiry_time"  # D sets it; P declines a read past it
    assert isinstance(handle.kv_transfer_params.get(deadline), float), handle.kv_transfer_params
    params = dict(handle.kv_transfer_params)
    params[deadline] -= TTL_S + 10  # on D's clock: passed, as after the TTL
    asyncio.run(put(handle.model_copy(update={"expires_at": time.time() + 600,
                                              "kv_transfer_params": params})))
    now = int(time.time())
    token = codec().encode(tenant="alpha", session=claims.session, handle=claims.handle,
                           iat=now, exp=now + 300)
    expired = "vllm:nixl_num_kv_expired_reqs_total"
    declined_before = e2e.metric(e2e.prefill_url, expired)
    # The token names the router's session key (`<caller>/<session id>`): the client
    # sends its own session id, the part after the caller.
    with session(e2e, system=None, messages=with_token(history, token),
                 session_id=claims.session.rpartition("/")[2]) as late:
        # Longer than `SKIP_PREFILL_MAX`: the turn goes through P, which reads D's blocks
        # (D's own prefix cache still has them, so a short delta would stay on D).
        r = checked_send(e2e, late, "And now? " + "Say each step again. " * 30, TEXT_TURN)
    declined = e2e.metric(e2e.prefill_url, expired) - declined_before
    print("after D expiry:", r.path, r.reused_tokens, "declined reads:", declined)
    assert r.cache_token_received
    assert r.path == "pd_reuse"  # the router did try; the answer above is still right
    assert declined >= 1  # P lacked D's generated blocks, saw them expired, recomputed
