"""The `replicas` topology on plain data: which node URLs make it, the policy it runs, and
where that policy sends a session's turn, and its KV, from the turn's facts. (Over HTTP
against fake nodes: tests/router/http/test_replicas_topology.py; on real vLLM:
tests/e2e/test_replicas_topology_vllm.py.)"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from kvagent_server.router.nodes.registry import Node, NodeRegistry, topology_of
from kvagent_server.router.reuse import planner, transfer
from kvagent_server.router.reuse.paths import LinearCost, PathCosts
from kvagent_server.router.reuse.queue import NodeWork
from kvagent_server.router.settings import RouterSettings
from kvagent_server.router.turns import policy, policy_params, replicas
from kvagent_server.router.turns.shapes import NodeFacts, TurnFacts, TurnPlan
from test_stages import PROMPT, _facts

REPLICAS = policy.policy_for(RouterSettings(), "replicas")
#: Prompt work priced at 1 ms a token on a node, pulling at 10 us a token.
COSTS = PathCosts(d_direct=LinearCost(fixed_s=0.0, per_token_s=1e-3),
                  pull=LinearCost(fixed_s=0.01, per_token_s=1e-5))


def _node(name: str, in_flight: int = 0, *, healthy: bool = True, max_in_flight: int = 64,
          work: NodeWork | None = None) -> NodeFacts:
    node = Node(name=name, url=f"http://{name}", role="decode", healthy=healthy,
                max_in_flight=max_in_flight)
    return NodeFacts(node=node, state=node.state(in_flight), work=work or NodeWork())


def _turn(*nodes: NodeFacts, holder: str | None = "d0", **kw: Any) -> TurnFacts:
    """A later turn of the session whose KV `holder` keeps (None: a first turn)."""
    held = next((n.node for n in nodes if n.node.name == holder), None)
    base = {"candidates": nodes, "affinity": holder, "holder": held, "counts_work": True,
            "p_first": None, "d_first": None, "d_holds": False, "p_work": None,
            "d_work": None, "costs": COSTS, "ids_gathered": True}
    if holder is None:
        base |= {"handle": None, "prompt_ids": (), "identity": None, "est_tokens": 300}
    return _facts(**(base | kw))


def _plan(facts: TurnFacts, chosen: Any = REPLICAS) -> TurnPlan:
    plan = chosen.decide(facts)
    assert isinstance(plan, TurnPlan)
    return plan


# ------------------------------------------------------------------ the topology


def test_several_decode_nodes_and_no_prefill_node_are_replicas() -> None:
    assert topology_of([], ["http://d0", "http://d1"]) == "replicas"
    registry = NodeRegistry([], ["http://127.0.0.1:10", "http://127.0.0.1:11"])
    assert registry.topology == "replicas" and not registry.has_prefill
    assert not registry.ready
    registry.nodes["d1"].mark_up()
    assert registry.ready  # any one node serves


def test_replicas_runs_its_policy_and_refuses_what_it_cannot_run() -> None:
    assert REPLICAS.name == "replicas"
    assert isinstance(REPLICAS, policy.ReplicasPolicy)
    named = policy.policy_for(RouterSettings(policy={
        "name": "replicas", "params": {"move_cost_ratio": None, "pull_on_move": False}}),
        "replicas")
    assert isinstance(named, policy.ReplicasPolicy)
    assert (named.moves.move_cost_ratio, named.moves.pull_on_move) == (None, False)
    # `single` runs there too: a session never leaves its node but to recompute.
    assert policy.policy_for(RouterSettings(policy={"name": "single"}), "replicas").name == (
        "single")
    for name, says in (("pd_reuse", "needs a prefill node"),
                       ("d_direct", "needs a prefill node")):
        with pytest.raises(ValueError, match=f"'{name}' {says}; the router serves the "
                                             "replicas topology"):
            policy.policy_for(RouterSettings(policy={"name": name}), "replicas")
    with pytest.raises(ValueError, match="'replicas' needs several decode nodes"):
        policy.policy_for(RouterSettings(policy={"name": "replicas"}), "single")
    with pytest.raises(ValueError, match="move_cost_ratio"):
        policy.policy_for(RouterSettings(policy={"name": "replicas",
                                                 "params": {"move_cost_ratio": 1.0}}),
                          "replicas")


# ------------------------------------------------------------------ where a turn goes


def test_a_first_turn_goes_to_the_least_loaded_node_and_computes_there() -> None:
    d0, d1 = _node("d0", 3), _node("d1", 1)
    plan = _plan(_turn(d0, d1, holder=None))
    assert (plan.path, plan.d_first, plan.d_reason) == ("d_fresh", d1.node, "least_loaded")
    assert plan.reuse.reason == planner.Reason.NO_HANDLE and plan.est_tokens == 300
    assert plan.p_first is None and plan.p_reason is None  # no P, nothing of P/D
    params = plan.decode_params(d1.node)
    assert params == transfer.d_direct()


def test_a_session_stays_on_its_node_while_it_is_not_busy() -> None:
    d0, d1 = _node("d0", 3, work=NodeWork(streams=3)), _node("d1", 1)
    plan = _plan(_turn(d0, d1))
    assert (plan.path, plan.d_first, plan.d_reason) == ("d_direct", d0.node, "affinity")
    assert plan.reuse.reuse_tokens == 128 and plan.holder is d0.node


def test_a_saturated_node_hands_the_session_and_its_kv_to_another() -> None:
    d0, d1 = _node("d0", 2, max_in_flight=2), _node("d1", 1)
    facts = _turn(d0, d1)
    plan = _plan(facts)
    assert (plan.path, plan.d_first, plan.d_reason) == ("d_pull", d1.node,
                                                        "affinity_overloaded")
    assert plan.reuse.reason == planner.Reason.HIT and plan.reuse.reuse_tokens == 128
    # The new node pulls the verified prefix from the holder as a P leg would, then
    # decodes and keeps the whole (the holder frees its blocks once read).
    params = plan.decode_params(d1.node)
    assert params == {**transfer.reuse_transfer_params(facts.handle, 128),
                      transfer.RETAIN_KEY: True}
    assert params["remote_engine_id"] == "eng-d" and params["remote_num_tokens"] == 128
    assert params[transfer.EXPECT_KEY]["digests"] == transfer.block_digests(PROMPT[:128], 16)
    assert transfer.RELEASE_KEY not in params
    # The test-only negative control hands the new node the holder's blocks shifted.
    shifted = dataclasses.replace(plan, legs=dataclasses.replace(plan.legs, shift_blocks=True))
    assert shifted.decode_params(d1.node) == transfer.shifted_blocks(params)


def test_without_pull_on_move_the_new_node_recomputes_and_says_why() -> None:
    moves = policy_params.ReplicasParams(pull_on_move=False)
    chosen = dataclasses.replace(REPLICAS, moves=moves)
    d0, d1 = _node("d0", 2, max_in_flight=2), _node("d1")
    plan = _plan(_turn(d0, d1), chosen)
    assert (plan.path, plan.d_first, plan.reuse.reuse_tokens) == ("d_fresh", d1.node, 0)
    assert plan.reuse.label == "moved:affinity_overloaded"
    assert plan.holder is d0.node  # execute tells it to free the blocks
    assert transfer.RELEASE_KEY not in plan.decode_params(d1.node)  # d1 holds none of them


def test_a_busy_node_loses_the_session_when_waiting_there_costs_more() -> None:
    """2000 prompt tokens queued on the holder: 2 s before this turn's delta starts, where
    the idle node needs 10 ms plus 1.3 ms to pull 128 tokens over."""
    busy, idle = _node("d0", 2, work=NodeWork(prefill_tokens=2000, prompts=2)), _node("d1")
    plan = _plan(_turn(busy, idle))
    assert (plan.path, plan.d_first, plan.d_reason) == ("d_pull", idle.node, "affinity_busy")
    # A little queued work is not worth the move; nor is any, with the ratio off.
    little = _node("d0", 1, work=NodeWork(prefill_tokens=10, prompts=1))
    assert _plan(_turn(little, idle)).path == "d_direct"
    stay = dataclasses.replace(REPLICAS, moves=policy_params.ReplicasParams(
        move_cost_ratio=None))
    assert _plan(_turn(busy, idle), stay).path == "d_direct"
    # Nowhere better to go: every other node is as busy, unhealthy or saturated.
    also_busy = _node("d1", 2, work=NodeWork(prefill_tokens=2000, prompts=2))
    down = _node("d2", healthy=False)
    full = _node("d3", 1, max_in_flight=1)
    assert _plan(_turn(busy, also_busy, down, full)).path == "d_direct"


def test_busy_move_picks_the_cheapest_other_node() -> None:
    holder = _node("d0", work=NodeWork(prefill_tokens=5000))
    a = _node("a", 3, work=NodeWork(prefill_tokens=400))
    b = _node("b", 5, work=NodeWork(prefill_tokens=100))
    c = _node("c", 0, work=NodeWork(prefill_tokens=100))
    assert replicas.busy_move(holder, [a, b, c], COSTS, held_tokens=128, delta=64,
                              ratio=2.0) is c  # b's wait, fewer legs in flight
    assert replicas.busy_move(holder, [a, b, c], COSTS, held_tokens=128, delta=64,
                              ratio=1000.0) is None


def test_a_session_whose_node_is_gone_recomputes_on_another() -> None:
    d0, d1 = _node("d0", healthy=False), _node("d1")
    facts = _turn(d0, d1, holder=None, affinity="d0", handle=_facts().handle,
                  prompt_ids=tuple(PROMPT), identity=_facts().identity,
                  handle_node_healthy=False)
    plan = _plan(facts)
    assert (plan.path, plan.d_first, plan.d_reason) == ("d_fresh", d1.node,
                                                        "affinity_unhealthy")
    assert plan.reuse.reason == planner.Reason.NODE_UNHEALTHY


def test_a_moved_turn_asks_for_the_prompt_ids_it_verifies_against() -> None:
    """Not placed on its holder, a turn cannot skip `/tokenize`: the pull's offer is the
    verified prefix (the pulling node still checks every block's digest)."""
    d0, d1 = _node("d0", 2, max_in_flight=2), _node("d1")
    facts = _turn(d0, d1, prompt_ids=(), ids_gathered=False, tokenizable=True)
    assert REPLICAS.decide(facts) is policy.NEED_PROMPT_IDS


def test_after_a_failed_pull_the_plan_recomputes_and_keeps_the_holder_to_release() -> None:
    d0, d1 = _node("d0", 2, max_in_flight=2), _node("d1")
    plan = _plan(_turn(d0, d1)).after_decode_failure(("d1",))
    assert (plan.path, plan.holder, plan.d_failed) == ("recompute", d0.node, ("d1",))
    assert plan.reuse.reason == planner.Reason.DECODE_FAILED
