"""The `single` topology on plain data: which node URLs make it, the policy it runs, and
the paths that policy picks from a turn's facts. (Over HTTP against a fake decode node:
tests/router/http/test_single_topology.py; on real vLLM:
tests/e2e/test_single_topology_vllm.py.)"""

from __future__ import annotations

import pytest
from kvagent_server.router.nodes.registry import NodeRegistry, topology_of
from kvagent_server.router.reuse import planner
from kvagent_server.router.settings import RouterSettings
from kvagent_server.router.turns import policy, policy_params
from kvagent_server.router.turns.shapes import TurnPlan
from test_stages import D_CHEAP, PROMPT, _extension_facts, _facts, _req

SINGLE = policy.SinglePolicy(policy_params.ReuseParams())


# ------------------------------------------------------------------ the topology


def test_no_prefill_node_and_one_decode_node_is_single() -> None:
    assert topology_of([], ["http://d"]) == "single"
    assert topology_of(["http://p"], ["http://d", "http://d2"]) == "pd"
    assert topology_of([], ["http://d", "http://d2"]) == "replicas"
    with pytest.raises(ValueError, match="needs a decode node"):
        topology_of(["http://p"], [])


def test_a_single_registry_is_ready_with_its_decode_node_alone() -> None:
    registry = NodeRegistry([], ["http://127.0.0.1:10"])
    assert registry.topology == "single" and not registry.ready
    assert registry.role("prefill") == []
    registry.nodes["d0"].mark_up()
    assert registry.ready
    pd = NodeRegistry(["http://127.0.0.1:9"], ["http://127.0.0.1:10"])
    pd.nodes["d0"].mark_up()
    assert pd.topology == "pd" and not pd.ready  # P/D needs its P too


# ------------------------------------------------------------------ the policy it runs


def test_single_runs_the_single_policy_and_refuses_a_policy_that_needs_p() -> None:
    # The default (`cost_model`, also what a bundle writes out in full) becomes `single`.
    assert policy.policy_for(RouterSettings(), "single").name == "single"
    assert policy.policy_for(RouterSettings(policy={"name": "single"}), "single").name == "single"
    for name in ("pd_reuse", "d_direct"):
        with pytest.raises(ValueError, match=f"'{name}' needs a prefill node"):
            policy.policy_for(RouterSettings(policy={"name": name}), "single")
    with pytest.raises(ValueError, match="unknown router.policy.name"):
        policy.policy_for(RouterSettings(policy={"name": "fastest"}), "single")
    # With P nodes, the setting is taken as it is (`single` too: D computes every prompt).
    assert policy.policy_for(RouterSettings(), "pd").name == "cost_model"
    assert policy.policy_for(RouterSettings(policy={"name": "single"}), "pd").name == "single"


# ------------------------------------------------------------------ its paths (pure)


def test_a_verified_prefix_on_the_node_is_extended_there() -> None:
    plan = SINGLE.decide(_facts(costs=D_CHEAP))
    assert plan.path == "d_direct"
    assert plan.reuse.reuse_tokens == 128 and plan.reuse.reason == planner.Reason.HIT
    assert plan.prompt_len == len(PROMPT) and plan.holder is None  # as the facts say


def test_the_costs_never_send_a_turn_to_p() -> None:
    """Whatever the costs, queues or D's fill, no P path: there is no P."""
    from kvagent_server.router.reuse.paths import LinearCost, PathCosts
    from kvagent_server.router.reuse.queue import NodeWork

    p_cheap = PathCosts(prefill=LinearCost(fixed_s=0.0, per_token_s=1e-6),
                        d_direct=LinearCost(fixed_s=5.0, per_token_s=1.0))
    busy_d = NodeWork(prefill_tokens=1e6, streams=60, prompts=9)
    for facts in (_facts(costs=p_cheap), _facts(d_work=busy_d), _facts(d_kv_usage=0.99)):
        assert SINGLE.decide(facts).path == "d_direct"
    first = _facts(handle=None, prompt_ids=(), identity=None, d_holds=False,
                   costs=p_cheap, est_tokens=500)
    plan = SINGLE.decide(first)
    assert (plan.path, plan.reuse.reason, plan.est_tokens) == (
        "d_fresh", planner.Reason.NO_HANDLE, 500)


def test_every_turn_without_a_usable_prefix_is_computed_on_the_node() -> None:
    cases = {
        planner.Reason.DIVERGED_AT_0: _facts(prompt_ids=tuple(range(9000, 9160))),
        planner.Reason.TOKENIZE_FAILED: _facts(prompt_ids=(), tokenize_failed=True),
        planner.Reason.STALE_EPOCH: _facts(handle_node_epoch="c2", d_holds=False),
        planner.Reason.TOKEN_REJECTED: _facts(handle=None, rejected="bad_signature"),
        planner.Reason.BELOW_THRESHOLD: _facts(prompt_ids=tuple(PROMPT[:40])),
    }
    for reason, facts in cases.items():
        plan = SINGLE.decide(facts)
        assert (plan.path, plan.reuse.reason, plan.reuse.reuse_tokens) == (
            "d_fresh", reason, 0), reason
        assert plan.est_tokens == (len(facts.prompt_ids) or facts.est_tokens)
    off = policy.SinglePolicy(policy_params.ReuseParams(reuse=False)).decide(_facts())
    assert (off.path, off.reuse.reason) == ("d_fresh", planner.Reason.REUSE_DISABLED)


def test_a_verified_prefix_held_elsewhere_is_recomputed_not_pulled() -> None:
    plan = SINGLE.decide(_facts(d_holds=False))
    assert plan.path == "d_fresh" and plan.reuse.reuse_tokens == 0
    assert (plan.reuse.reason, plan.reuse.detail) == (planner.Reason.NODE_UNHEALTHY,
                                                      "not_placed")


def test_unsplittable_requests_and_untokenized_extensions() -> None:
    n2 = _req({"model": "m", "n": 2, "messages": []})
    assert SINGLE.decide(_facts(req=n2)).path == "decode_only"
    facts = _facts()
    ext = planner.ReusePlan(reuse_tokens=128, reason=planner.Reason.HIT, tokenized=False)
    assert SINGLE.untokenized_path(facts, ext, (1, 10_000), 0.0) == "d_direct"
    plan = SINGLE.decide(_extension_facts())
    assert isinstance(plan, TurnPlan)
    assert (plan.path, plan.reuse.reuse_tokens, plan.reuse.tokenized) == ("d_direct", 128,
                                                                          False)
    assert plan.prompt_len > 129  # the held tokens and the new messages' estimate
