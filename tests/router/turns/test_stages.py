"""A turn's stages on plain data: the policies' decisions, the plan's fallbacks, gathering
from a real in-memory store, settling into it. (The legs and the relay run over HTTP
against fake nodes in tests/router/http/test_app.py and on real vLLM in tests/e2e/.)"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any

import pytest
from kvagent_server.router.auth.cache_token import TokenCodec
from kvagent_server.router.auth.keys import KeyRing
from kvagent_server.router.auth.tenancy import Tenant
from kvagent_server.router.nodes.legs import DecodeStart, Legs
from kvagent_server.router.nodes.registry import Node, NodeRegistry
from kvagent_server.router.reuse import identity, planner
from kvagent_server.router.reuse.learned import LearnedView
from kvagent_server.router.reuse.paths import LinearCost, PathCosts
from kvagent_server.router.reuse.queue import IDLE, NodeWork
from kvagent_server.router.settings import RouterSettings
from kvagent_server.router.store.handle import Handle
from kvagent_server.router.store.memory import MemoryStore
from kvagent_server.router.telemetry.metrics import RouterMetrics
from kvagent_server.router.turns import policy, policy_params
from kvagent_server.router.turns.context import Router
from kvagent_server.router.turns.gather import gather, with_prompt_ids
from kvagent_server.router.turns.settle import settle
from kvagent_server.router.turns.shapes import (
    NEED_PROMPT_IDS,
    Capture,
    NeedPromptIds,
    Turn,
    TurnFacts,
    TurnPlan,
    TurnRequest,
)

BS = 16
TENANT = Tenant(name="t", cache_salt="salt", max_concurrent_streams=4)
SESSION = TENANT.session_key("s1")
PROMPT = list(range(100, 100 + 160))  # 10 blocks
HELD = PROMPT[:130]  # the earlier turn's prompt and answer: KV for 129 tokens


def _req(body: dict[str, Any] | None = None, **kw: Any) -> TurnRequest:
    body = body or {"model": "m", "stream": True,
                    "messages": [{"role": "user", "content": "hi"}], "cache_salt": "salt"}
    return TurnRequest.build(endpoint="/v1/chat/completions", body=body, tenant=TENANT,
                             session=kw.pop("session", SESSION), token=None, **kw)


def _params(n_tokens: int) -> dict[str, Any]:
    return {"do_remote_prefill": False, "do_remote_decode": True,
            "remote_block_ids": [list(range(math.ceil(n_tokens / BS)))],
            "remote_engine_id": "eng-d", "remote_request_id": "rid-1",
            "remote_host": "127.0.0.1", "remote_port": 5600, "remote_num_tokens": n_tokens}


def _handle(epoch: str = "c1", **kw: Any) -> Handle:
    now = time.time()
    fields: dict[str, Any] = {
        "handle_id": "h1", "tenant": "t", "session": SESSION, "decode_node": "d0",
        "decode_epoch": epoch, "kv_transfer_params": _params(len(HELD) - 1),
        "token_ids": HELD, "block_size": BS, "created_at": now, "expires_at": now + 400,
        "identity": identity.identity_of(dict(_req().body), chat=True)} | kw
    return Handle(**fields)


def _router(**settings: Any) -> Router:
    s = RouterSettings(**({"block_size": BS} | settings))
    registry = NodeRegistry(["http://127.0.0.1:9"], ["http://127.0.0.1:10"])
    for node in registry.nodes.values():
        node.mark_up()
    return Router(settings=s, registry=registry,
                  legs=Legs(max_retries=0, timeout_s=1, max_body_bytes=1 << 20,
                            ledger=registry.ledger),
                  store=MemoryStore(), codec=TokenCodec(KeyRing.generate()),
                  metrics=RouterMetrics(),
                  policy=policy.policy_for(s))


def _facts(**kw: Any) -> TurnFacts:
    """A later turn whose prompt extends the held turn, D healthy and holding it."""
    handle = _handle()
    return TurnFacts(**({
        "req": _req(), "session": SESSION, "source": "kvagent", "handle": handle,
        "handle_node_healthy": True, "handle_node_epoch": "c1", "d_holds": True,
        "d_healthy": True, "prefill_block_size": BS, "prompt_ids": tuple(PROMPT),
        "p_work": IDLE, "d_work": IDLE,
        "identity": identity.IdentityCheck()} | kw))


def _extension_facts(**kw: Any) -> TurnFacts:
    """A later chat turn whose messages extend the held turn's, before any `/tokenize`:
    D holds the prefix, a node could tokenize, and the router has learned enough to
    estimate the delta from the new messages' size."""
    held_body = dict(_req().body)
    body = held_body | {"messages": [*held_body["messages"],
                                     {"role": "assistant", "content": "hello"},
                                     {"role": "user", "content": "and then?"}]}
    handle = _handle(identity=identity.identity_of(held_body, chat=True, history=True))
    new = identity.identity_of(body, chat=True)
    holder = Node(name="d0", url="http://d0", role="decode", healthy=True)
    return _facts(**({
        "req": _req(body), "handle": handle, "holder": holder, "d_first": holder,
        "prompt_ids": (), "new_identity": new, "identity": identity.check(handle.identity, new),
        "tokenizable": True,
        "learned": LearnedView(message_samples=3, tokenize_s=0.01)} | kw))


def _plan(decision: TurnPlan | NeedPromptIds) -> TurnPlan:
    assert isinstance(decision, TurnPlan), decision
    return decision


COST_MODEL = policy.CostModelPolicy(policy_params.ReuseParams(), policy_params.CostParams())
#: D computing a delta is cheap, P's prefill dear: the cost model picks `d_direct`.
D_CHEAP = PathCosts(prefill=LinearCost(fixed_s=0.1, per_token_s=1e-3),
                    d_direct=LinearCost(fixed_s=0.0, per_token_s=1e-4))


# ------------------------------------------------------------------ decide (pure)


#: The policies of a router with prefill nodes (`single` and `replicas` have tests of
#: their own: tests/router/turns/test_single.py, test_replicas.py).
PD_POLICIES = ("cost_model", "pd_reuse", "d_direct")


def test_every_policy_reuses_only_the_verified_block_aligned_prefix() -> None:
    for name in policy.POLICIES:
        plan = policy.POLICIES[name](RouterSettings()).decide(_facts(costs=D_CHEAP))
        assert plan.reuse.reuse_tokens == 128, name  # 129 held tokens: 8 whole blocks
        assert plan.prompt_len == len(PROMPT) and plan.handle is not None


def test_policies_differ_only_in_where_the_delta_is_computed() -> None:
    facts = _facts(costs=D_CHEAP)
    paths = {name: factory(RouterSettings()).decide(facts).path
             for name, factory in policy.POLICIES.items()}
    assert paths == {"cost_model": "d_direct", "pd_reuse": "pd_reuse", "d_direct": "d_direct",
                     "single": "d_direct", "replicas": "d_direct"}
    # D not holding the prefix: no P/D policy computes it there
    far = dataclasses.replace(facts, d_holds=False)
    assert {policy.POLICIES[n](RouterSettings()).decide(far).path
            for n in PD_POLICIES} == {"pd_reuse"}


def test_the_cost_model_sends_a_delta_to_p_when_p_is_cheaper() -> None:
    p_cheap = PathCosts(prefill=LinearCost(fixed_s=0.0, per_token_s=1e-5),
                        d_direct=LinearCost(fixed_s=0.5, per_token_s=1e-2))
    assert COST_MODEL.decide(_facts(costs=p_cheap)).path == "pd_reuse"


def test_a_diverged_prompt_recomputes_under_every_policy() -> None:
    facts = _facts(prompt_ids=tuple(range(9000, 9160)))
    for name, factory in policy.POLICIES.items():
        plan = factory(RouterSettings()).decide(facts)
        # with no P, D recomputes
        path = "d_fresh" if name in ("single", "replicas") else "recompute"
        assert (plan.path, plan.reuse.reason) == (path, planner.Reason.DIVERGED_AT_0)


def test_a_first_turn_goes_to_d_only_while_p_is_busy() -> None:
    first = _facts(handle=None, prompt_ids=(), identity=None, d_holds=False, est_tokens=500)
    assert COST_MODEL.decide(first).path == "pd_fresh"  # an idle P computes it
    busy = dataclasses.replace(first, p_work=NodeWork(prefill_tokens=50_000, prompts=3),
                               p_first=Node(name="p0", url="http://p0", role="prefill",
                                            healthy=True))
    plan = COST_MODEL.decide(busy)
    assert plan.path == "d_fresh" and plan.est_tokens == 500
    never = policy.CostModelPolicy(policy_params.ReuseParams(),
                                   policy_params.CostParams(fresh_on_decode="never"))
    assert never.decide(busy).path == "pd_fresh"


def test_reuse_off_and_unsplittable_requests() -> None:
    off = policy.CostModelPolicy(policy_params.ReuseParams(reuse=False), policy_params.CostParams())
    plan = off.decide(_facts())
    assert (plan.path, plan.reuse.reason) == ("pd_fresh", planner.Reason.REUSE_DISABLED)
    n2 = _req({"model": "m", "n": 2, "messages": []})
    assert COST_MODEL.decide(_facts(req=n2)).path == "decode_only"


def test_a_failed_tokenize_recomputes() -> None:
    plan = COST_MODEL.decide(_facts(prompt_ids=(), tokenize_failed=True))
    assert (plan.path, plan.reuse.reason) == ("recompute", planner.Reason.TOKENIZE_FAILED)


def test_policies_are_found_by_name_and_unknown_names_fail_clearly() -> None:
    assert policy.policy_for(RouterSettings(policy={"name": "pd_reuse"})).name == "pd_reuse"
    with pytest.raises(ValueError, match="known: cost_model, d_direct, pd_reuse, replicas, single"):
        policy.policy_for(RouterSettings(policy={"name": "fastest"}))
    with pytest.raises(ValueError, match="already registered"):
        policy.register("cost_model", policy_params.PolicyParams,
                        policy.POLICIES["cost_model"].build)


# ------------------------------------------------------------------ the plan's fallbacks


def test_a_failed_decode_leg_falls_back_to_p() -> None:
    direct = COST_MODEL.decide(_facts(costs=D_CHEAP))
    after = direct.after_decode_failure(("d0",))
    assert (after.path, after.reuse.reason) == ("recompute", planner.Reason.DECODE_FAILED)
    assert after.holder is None and after.d_failed == ("d0",)
    fresh = TurnPlan(path="d_fresh", reuse=planner.ReusePlan(
        reuse_tokens=0, reason=planner.Reason.NO_HANDLE))
    assert fresh.after_decode_failure(("d0",)).path == "pd_fresh"


# ------------------------------------------------------------------ gather


async def test_gather_claims_the_sessions_handle_and_decides_nothing() -> None:
    r = _router()
    d0 = r.registry.get("d0")
    assert d0 is not None
    await r.store.put(_handle(epoch=d0.epoch))
    facts = await gather(r, _req())
    assert facts.handle is not None and facts.handle.handle_id == "h1"
    assert facts.holder is not None and facts.affinity == "d0"
    assert {c.node.name for c in facts.candidates} == {"p0", "d0"}
    assert facts.p_first is None and facts.d_first is None  # placing is decide's
    placed = policy.place(facts)
    assert placed.d_first is facts.holder and placed.d_holds and placed.d_healthy
    assert (placed.p_reason, placed.d_reason) == ("least_loaded", "affinity")
    assert await r.store.peek_latest("t", SESSION) is None  # claimed: single use
    # the holder is healthy and current: the prompt must be verified, so decide asks for
    # its ids; no node answers /tokenize here, so the facts say so (decide recomputes)
    assert not facts.ids_gathered and facts.tokenizable
    assert r.policy.decide(facts) is NEED_PROMPT_IDS
    facts = await with_prompt_ids(r, facts)
    assert facts.tokenize_failed and facts.prompt_ids == () and facts.ids_gathered
    assert _plan(r.policy.decide(facts)).path == "recompute"


async def test_gather_of_a_stale_handle_needs_no_tokenize() -> None:
    r = _router()
    await r.store.put(_handle(epoch="an-earlier-incarnation"))
    facts = await gather(r, _req())
    assert facts.holder is None and not facts.tokenize_failed
    plan = r.policy.decide(facts)
    assert (plan.path, plan.reuse.reason) == ("recompute", planner.Reason.STALE_EPOCH)


async def test_gather_of_a_first_turn() -> None:
    r = _router()
    facts = await gather(r, _req())
    assert facts.handle is None and facts.rejected is None and facts.est_tokens > 0
    assert r.policy.decide(facts).path == "pd_fresh"


def test_the_forwarded_body_is_read_only() -> None:
    req = _req()
    with pytest.raises(TypeError):
        req.body["cache_salt"] = "other"  # type: ignore[index]  # a Mapping: the point
    assert req.body_chars == len(b'{"model":"m","stream":true,"messages":[{"role":"user",'
                                 b'"content":"hi"}],"cache_salt":"salt"}')


# ------------------------------------------------------------------ settle


def _turn(r: Router, plan: TurnPlan, facts: TurnFacts) -> Turn:
    node = r.registry.get("d0")
    assert node is not None
    start = DecodeStart(node=node, response=None, elapsed_s=0.01)  # type: ignore[arg-type]  # settle reads no response
    return Turn(r.ledger, facts, plan, None, start, time.perf_counter())


async def test_settle_records_the_retained_blocks_and_mints_a_token_for_them() -> None:
    r = _router()
    facts = _facts(costs=D_CHEAP)
    turn = _turn(r, COST_MODEL.decide(facts), facts)
    turn.mark_first_byte()
    out = [7, 8, 9]
    capture = Capture(kv_params=_params(len(PROMPT) + 2), prompt_token_ids=PROMPT,
                      output_token_ids=out, choices={0},
                      usage={"prompt_tokens": len(PROMPT),
                             "prompt_tokens_details": {"cached_tokens": 128}})
    final = await settle(r, turn, capture)
    assert final.kvagent["path"] == "d_direct" and final.reused == 128
    assert final.cached_tokens == 128 and final.kvagent["reason"] == "hit"
    claims = r.codec.decode(final.kvagent["cache_token"], now=time.time())
    held = await r.store.claim("t", claims.handle)
    assert held is not None and held.token_ids == [*PROMPT, *out]
    assert held.session == SESSION and held.decode_node == "d0"


async def test_settle_without_a_session_records_nothing() -> None:
    r = _router()
    facts = _facts(session=None, handle=None, prompt_ids=(), identity=None)
    turn = _turn(r, COST_MODEL.decide(facts), facts)
    final = await settle(r, turn, Capture(kv_params=_params(10), prompt_token_ids=PROMPT[:10],
                                          choices={0}, usage={"prompt_tokens": 10}))
    assert final.kvagent["cache_token"] is None and final.reused == 0
    assert len(r.store) == 0  # type: ignore[arg-type]  # MemoryStore counts its handles


def test_a_decode_node_at_its_kv_high_watermark_computes_no_prompt() -> None:
    """Its retained turns fill its cache: a prompt it computed (and the release riding on
    it) would wait in its queue; P's pull frees its blocks without that queue."""
    policy_ = policy.CostModelPolicy(policy_params.ReuseParams(),
                                     policy_params.CostParams(d_kv_high=0.8))
    assert policy_.decide(_facts(costs=D_CHEAP, d_kv_usage=0.5)).path == "d_direct"
    full = _facts(costs=D_CHEAP, d_kv_usage=0.85)
    plan = policy_.decide(full)
    assert plan.path == "pd_reuse" and plan.reuse.reuse_tokens == 128
    assert policy_.untokenized_path(full, plan.reuse, (10, 20), 0.01) is None
    busy_first = _facts(handle=None, prompt_ids=(), identity=None, d_holds=False,
                        est_tokens=500, d_kv_usage=0.9,
                        p_work=NodeWork(prefill_tokens=50_000, prompts=3),
                        p_first=Node(name="p0", url="http://p0", role="prefill", healthy=True))
    assert policy_.decide(busy_first).path == "pd_fresh"
    default = policy.policy_for(RouterSettings())
    assert isinstance(default, policy.CostModelPolicy) and default.costs.d_kv_high == 0.8
