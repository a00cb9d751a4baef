"""A spilled conversation's next turn, on plain facts: the tier-load price
(`paths.spill_path`) and what decide makes of it (`tier_path.with_spill` in the cost
model's decide, `tier_path.on_the_node` in the single and replicas policies)."""

from __future__ import annotations

import dataclasses

import pytest
from kvagent_server.router.kv.tiers import NodeTiers, TierCosts
from kvagent_server.router.nodes.registry import Node
from kvagent_server.router.reuse import paths, planner
from kvagent_server.router.reuse.identity import IdentityCheck
from kvagent_server.router.reuse.paths import LinearCost, PathCosts
from kvagent_server.router.reuse.queue import IDLE, NodeWork
from kvagent_server.router.reuse.spill import Spilled, TierReuse, spill_of
from kvagent_server.router.turns import policy, policy_params, tier_path
from kvagent_server.router.turns.shapes import NEED_PROMPT_IDS, TurnFacts
from test_stages import COST_MODEL, HELD, PROMPT, _facts, _handle, _plan

D0 = Node(name="d0", url="http://d0", role="decode", healthy=True, epoch="c1")
P0 = Node(name="p0", url="http://p0", role="prefill", healthy=True)
#: Loading a token from the host tier costs less than computing it, on P or on D.
COSTS = PathCosts(prefill=LinearCost(fixed_s=0.05, per_token_s=1e-3),
                  d_direct=LinearCost(fixed_s=0.0, per_token_s=1.2e-3))
TIERS = TierCosts(cpu_s_per_token=1e-5, disk_s_per_token=1e-4)


def tier(host: int = 128, disk: int = 0, shared: bool = False) -> TierReuse:
    return TierReuse(node="d0", epoch="c1", host_tokens=host, disk_tokens=disk,
                     shared=shared, common_prefix=max(host, disk))


# ------------------------------------------------------------------ the price


def test_the_holding_nodes_host_tier_beats_recomputing_a_long_prefix() -> None:
    assert paths.spill_path(tier(), 160, COSTS, TIERS, d_ok=True) == "d_direct"
    # not placed there (unhealthy, restarted, at its watermark): P, which has no copy
    assert paths.spill_path(tier(), 160, COSTS, TIERS, d_ok=False) == "recompute"
    # a shared disk: P loads it
    shared = tier(host=128, disk=128, shared=True)
    assert paths.spill_path(shared, 160, COSTS, TIERS, d_ok=False) == "p_tier"
    # a local disk is the holding node's alone
    assert paths.spill_path(tier(host=0, disk=128), 160, COSTS, TIERS, d_ok=False) == (
        "recompute")


def test_a_load_that_costs_more_than_computing_is_not_paid() -> None:
    slow = TierCosts(cpu_s_per_token=5e-3, disk_s_per_token=5e-3)  # above both lines
    assert paths.spill_path(tier(), 160, COSTS, slow, d_ok=True) == "recompute"
    assert paths.spill_path(tier(disk=128, shared=True), 160, COSTS, slow,
                            d_ok=False) == "recompute"


def test_the_stall_cap_and_the_queues_weigh_a_tier_load_as_they_weigh_d_direct() -> None:
    busy_d = NodeWork(prefill_tokens=0, streams=4)
    # D streaming: computing a 2000-token delta there stalls them past the cap
    long = tier(host=2048)
    assert paths.spill_path(long, 4096, COSTS, TIERS, d_ok=True, d_work=busy_d,
                            d_stall_max_s=0.05) == "recompute"
    assert paths.spill_path(long, 4096, COSTS, TIERS, d_ok=True, d_work=busy_d) in (
        "d_direct", "recompute")
    # P buried under queued prompts, D idle: the node holding the spill takes it
    busy_p = NodeWork(prefill_tokens=50_000, streams=0)
    assert paths.spill_path(tier(), 160, COSTS, TIERS, d_ok=True, p_work=busy_p,
                            d_work=IDLE) == "d_direct"
    with pytest.raises(ValueError):
        paths.spill_path(tier(host=160), 160, COSTS, TIERS, d_ok=True)


# ------------------------------------------------------------------ decide


def spilled_facts(tiers: NodeTiers, **kw: object) -> TurnFacts:
    """A session whose handle the watermark gave up on d0: no handle, its spill found."""
    handle = _handle(prompt_tokens=len(HELD))
    spill = spill_of(handle, tiers, now=0.0)
    assert spill is not None and spill.epoch == "c1"
    fields: dict[str, object] = {
        "handle": None, "d_holds": False, "d_first": D0, "d_healthy": True,
        "p_first": P0, "spilled": Spilled(spill, handle, costs=TIERS), "costs": COSTS,
        "identity": IdentityCheck()}
    return _facts(**(fields | kw))


def test_a_spilled_turn_goes_d_direct_to_the_node_whose_host_tier_holds_it() -> None:
    facts = spilled_facts(NodeTiers(host=True, chunk_tokens=16))
    plan = _plan(COST_MODEL.decide(facts))
    assert (plan.path, plan.reuse.label, plan.tier_source) == (
        "d_direct", "hit:tier_host", "tier_host")
    assert plan.holder is D0 and plan.handle is None and plan.reuse.reuse_tokens == 128
    assert plan.tier is not None and plan.tier.host_tokens == 128
    # D frees nothing (no handle) and keeps the new sequence for the next turn
    assert plan.decode_params(D0) == {"do_remote_prefill": False, "do_remote_decode": False}


def test_a_spilled_turn_that_cannot_go_to_its_node_loads_the_shared_disk_on_p() -> None:
    shared = NodeTiers(host=True, disk=True, shared=True, chunk_tokens=16)
    elsewhere = Node(name="d1", url="http://d1", role="decode", healthy=True, epoch="x")
    watermark = policy.CostModelPolicy(policy_params.ReuseParams(),
                                       policy_params.CostParams(d_kv_high=0.8))
    for facts in (spilled_facts(shared, d_first=elsewhere),  # placed on another node
                  spilled_facts(shared, d_first=dataclasses.replace(D0, epoch="c2")),
                  spilled_facts(shared, d_kv_usage=0.99)):  # D at its watermark
        plan = _plan(watermark.decide(facts))
        assert plan.path == "pd_fresh" and plan.tier_source == "tier_disk", plan
        assert plan.reuse.reason == planner.Reason.NO_HANDLE  # P's connector loads it
    # a host tier only: nothing P can read
    plan = _plan(COST_MODEL.decide(spilled_facts(NodeTiers(host=True, chunk_tokens=16),
                                                 d_first=elsewhere)))
    assert plan.path == "pd_fresh" and plan.tier_source is None


def test_only_a_verified_prefix_of_the_same_identity_is_loaded() -> None:
    tiers = NodeTiers(host=True, chunk_tokens=16)
    other = (999, *PROMPT[1:])  # diverged at 0
    assert _plan(COST_MODEL.decide(spilled_facts(tiers, prompt_ids=other))).tier is None
    salt = IdentityCheck(reason="identity_changed", detail="salt", cap=0)
    assert _plan(COST_MODEL.decide(spilled_facts(tiers, identity=salt))).tier is None
    # the KV events show the host tier lost it: not offered (a recompute, not a miss)
    facts = spilled_facts(tiers)
    assert facts.spilled is not None
    gone = dataclasses.replace(facts, spilled=dataclasses.replace(facts.spilled, host_reach=0))
    assert _plan(COST_MODEL.decide(gone)).path == "pd_fresh"


def test_a_spill_needs_the_prompt_ids() -> None:
    facts = spilled_facts(NodeTiers(host=True), prompt_ids=(), tokenizable=True)
    assert facts.ids_matter
    assert COST_MODEL.decide(facts) is NEED_PROMPT_IDS


# ------------------------------------------------------------------ no P to weigh


SINGLE = policy.SinglePolicy(policy_params.ReuseParams())


def test_single_loads_a_spilled_turn_on_its_node_whatever_the_costs() -> None:
    """One node computes every prompt: a spill verified against its record goes
    `d_direct` there with the tier's reason, even where a recompute on a (missing) P
    would price lower or the node is at its watermark."""
    tiers = NodeTiers(host=True, disk=True, chunk_tokens=16)
    slow = TierCosts(cpu_s_per_token=5e-3, disk_s_per_token=5e-3)
    for facts in (spilled_facts(tiers, p_first=None),
                  spilled_facts(tiers, p_first=None, d_kv_usage=0.99),
                  spilled_facts(tiers, p_first=None, costs=COSTS,
                                d_work=NodeWork(prefill_tokens=0, streams=60))):
        assert facts.spilled is not None
        facts = dataclasses.replace(facts,
                                    spilled=dataclasses.replace(facts.spilled, costs=slow))
        plan = _plan(SINGLE.decide(facts))
        assert (plan.path, plan.reuse.label, plan.tier_source) == (
            "d_direct", "hit:tier_host", "tier_host"), plan
        assert plan.holder is D0 and plan.handle is None and plan.reuse.reuse_tokens == 128
        assert plan.decode_params(D0) == {"do_remote_prefill": False,
                                          "do_remote_decode": False}
    disk_only = _plan(SINGLE.decide(spilled_facts(NodeTiers(disk=True, chunk_tokens=16),
                                                  p_first=None)))
    assert (disk_only.path, disk_only.reuse.label) == ("d_direct", "hit:tier_disk")


def test_single_recomputes_a_spill_it_cannot_verify_or_that_another_node_holds() -> None:
    tiers = NodeTiers(host=True, chunk_tokens=16)
    other = Node(name="d1", url="http://d1", role="decode", healthy=True, epoch="x")
    salt = IdentityCheck(reason="identity_changed", detail="salt", cap=0)
    for facts in (spilled_facts(tiers, p_first=None, prompt_ids=(999, *PROMPT[1:])),
                  spilled_facts(tiers, p_first=None, identity=salt),
                  spilled_facts(tiers, p_first=None, d_first=other),  # another replica
                  spilled_facts(tiers, p_first=None,
                                d_first=dataclasses.replace(D0, epoch="c2")),  # restarted
                  spilled_facts(tiers, p_first=None, d_healthy=False)):
        plan = _plan(SINGLE.decide(facts))
        assert plan.path == "d_fresh" and plan.tier is None and plan.tier_source is None
        assert plan.reuse.reuse_tokens == 0
    assert SINGLE.decide(spilled_facts(tiers, p_first=None, prompt_ids=(),
                                       tokenizable=True)) is NEED_PROMPT_IDS


def test_a_turn_whose_handle_was_given_up_while_it_waited_loads_it_back() -> None:
    """`single`: the turn's own handle went for another turn's room (the admission gate)
    before its leg was sent; on a node with tiers the turn stays `d_direct` there, loading
    what it had verified from the tiers, and pins and frees no handle."""
    facts = _facts(d_first=D0, p_first=None, handle=_handle(prompt_tokens=len(HELD)))
    plan = dataclasses.replace(_plan(SINGLE.decide(facts)), holder=D0)
    assert plan.path == "d_direct" and plan.handle is not None
    verified = plan.reuse.reuse_tokens
    back = tier_path.reloaded(plan, NodeTiers(host=True, chunk_tokens=16), threshold=64,
                              now=0.0)
    assert back is not None and (back.path, back.reuse.label) == ("d_direct", "hit:tier_host")
    assert back.handle is None and back.holder is D0 and back.tier_source == "tier_host"
    # the prompt's whole chunks of what was verified (prompt-only tiers)
    assert back.reuse.reuse_tokens == min(verified, len(HELD) - len(HELD) % 16)
    assert back.decode_params(D0) == {"do_remote_prefill": False, "do_remote_decode": False}
    disk = tier_path.reloaded(plan, NodeTiers(disk=True, chunk_tokens=16), threshold=64,
                              now=0.0)
    assert disk is not None and disk.reuse.label == "hit:tier_disk"
    # nothing to load: no tiers, a chunk above what was verified, or not a d_direct reuse
    assert tier_path.reloaded(plan, None, threshold=64, now=0.0) is None
    assert tier_path.reloaded(plan, NodeTiers(), threshold=64, now=0.0) is None
    assert tier_path.reloaded(plan, NodeTiers(host=True, chunk_tokens=4096), threshold=64,
                              now=0.0) is None
    fresh = _plan(SINGLE.decide(_facts(handle=None, prompt_ids=(), identity=None,
                                       d_holds=False, est_tokens=500)))
    assert tier_path.reloaded(fresh, NodeTiers(host=True), threshold=64, now=0.0) is None
